"""A cache directory someone else can write is not trusted: anyone who can
write there can plant a checkpoint under a prompt's name or swap one. The
store refuses a directory owned by another user or writable by group or
others, with a StoreError that names the fix; trust_dir=True (or
--kv-trust-dir) overrides."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import ds4
from ds4.errors import StoreError


def test_own_private_directory_is_used(tmp_path):
    d = tmp_path / "mine"
    st = ds4.KVStore(d)
    assert st.dir == str(d) and (os.stat(d).st_mode & 0o777) == 0o700  # created private


@pytest.mark.parametrize(
    "mode,who", [(0o777, "others"), (0o1777, "others"), (0o770, "its group"), (0o720, "its group")]
)
def test_a_directory_writable_by_others_is_refused(tmp_path, mode, who):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(StoreError) as ei:
        ds4.KVStore(d)
    assert f"writable by {who}" in str(ei.value) and "chmod go-w" in str(ei.value) and "--kv-trust-dir" in str(ei.value)
    assert ds4.KVStore(d, trust_dir=True).dir == str(d)  # the override
    os.chmod(d, 0o755)
    assert ds4.KVStore(d).dir == str(d)  # readable by others is fine: the checkpoints themselves are 0600


def test_a_directory_owned_by_another_user_is_refused(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    other = os.geteuid() + 4242
    if os.geteuid() == 0:
        os.chown(d, other, other)
    else:  # not root: a directory we do not own (the filesystem root's)
        d, other = "/", 0
    with pytest.raises(StoreError) as ei:
        ds4.KVStore(d)
    assert f"owned by uid {other}" in str(ei.value) and "trust_dir=True" in str(ei.value)


def test_the_commands_refuse_it_too_unless_told(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    base = [sys.executable, "-m", "ds4", "run", "-p", "hi", "--engine", "reference", "--max-tokens", "1"]
    r = subprocess.run([*base, "--kv-disk-dir", str(d)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "writable by others" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([*base, "--kv-disk-dir", str(d), "--kv-trust-dir"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
