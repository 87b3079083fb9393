"""``ds4 serve`` whose checkpoint writes fail on a schedule (the isolation
test's server processes): the same command line, the store's writer
wrapped. ``DS4_TEST_WRITE_FAULTS`` is ``N:kind,N:kind,...``: the Nth
checkpoint write of this process (1-based) fails, as

* ``disk_full``: nothing written, ``ENOSPC``;
* ``torn``: half of the file written under the writer's own temp name and
  left there (as a write cut off mid-file leaves it), then ``EIO``;
* ``late``: the file complete and renamed into place, then ``EIO`` (the
  directory's fsync failed: the store is told the save failed while the
  file is there).

Each injected fault is logged as ``injected write fault N kind``. Started by
path (``python tests/helpers/fault_serve.py <serve's flags>``)."""

import errno
import logging
import os
import sys

import ds4.kvstore.save as save
from ds4.cli import main
from ds4.kvstore.files import pid_space

log = logging.getLogger("ds4.kvstore")
SCHEDULE = {
    int(n): kind
    for n, kind in (item.split(":") for item in os.environ.get("DS4_TEST_WRITE_FAULTS", "").split(",") if item)
}
_real = save.write_checkpoint
_calls = [0]


def _faulty(path, *a, **kw):
    _calls[0] += 1
    kind = SCHEDULE.get(_calls[0])
    if kind is None:
        return _real(path, *a, **kw)
    log.warning("injected write fault %d %s", _calls[0], kind)
    if kind == "disk_full":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    if kind == "torn":
        d, name = os.path.split(path)
        tmp = os.path.join(d, f".{name}.tmp.{os.getpid()}.{pid_space()}.f{_calls[0]:x}")
        _real(tmp, *a, **kw)  # the writer's own bytes, then cut off half way
        with open(tmp, "r+b") as f:
            f.truncate(os.path.getsize(tmp) // 2)
    elif kind == "late":
        _real(path, *a, **kw)
    else:
        raise ValueError(kind)
    raise OSError(errno.EIO, os.strerror(errno.EIO), path)


save.write_checkpoint = _faulty

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
