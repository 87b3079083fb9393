"""``ds4.durable.write_durably``, the one durable small-file write: the
whole new bytes or the old ones, never through a planted entry, never over
a symlink or a directory with ``regular_only``, no temp file left after a
failure, and the same with a directory file descriptor."""

from __future__ import annotations

import os
import stat

import pytest

from ds4.durable import write_durably


def _entries(d) -> list[str]:
    return sorted(os.listdir(d))


def test_writes_and_replaces_whole_with_mode_0600(tmp_path):
    p = tmp_path / "f.json"
    assert write_durably(str(p), b"one", sync_dir=True)
    assert write_durably(str(p), b"two, longer")
    assert p.read_bytes() == b"two, longer"
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert _entries(tmp_path) == ["f.json"]  # no temp file left


def test_a_fixed_temp_name_left_by_a_crash_is_replaced_and_a_planted_one_refused(tmp_path):
    p, tmp = tmp_path / "w", tmp_path / ".w.tmp"
    tmp.write_bytes(b"a crashed writer's half")
    assert write_durably(str(p), b"new", tmp=str(tmp))
    assert p.read_bytes() == b"new" and not tmp.exists()
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not yours")
    tmp.symlink_to(target)
    with pytest.raises(FileExistsError):
        write_durably(str(p), b"through the link?", tmp=str(tmp))
    assert target.read_bytes() == b"not yours" and p.read_bytes() == b"new"


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_regular_only_leaves_a_name_that_is_not_a_file(tmp_path, kind):
    p, target = tmp_path / "w", tmp_path / "target"
    target.write_bytes(b"keep")
    if kind == "symlink":
        p.symlink_to(target)
    else:
        p.mkdir()
    assert write_durably(str(p), b"x", regular_only=True) is False
    assert (p.is_symlink() if kind == "symlink" else p.is_dir()) and target.read_bytes() == b"keep"
    assert sorted(_entries(tmp_path)) == ["target", "w"]  # the temp file went


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    p = tmp_path / "f"
    write_durably(str(p), b"old")

    def broken(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(OSError, match="No space"):
        write_durably(str(p), b"new")
    assert p.read_bytes() == b"old" and _entries(tmp_path) == ["f"]


def test_relative_to_a_directory_descriptor(tmp_path):
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert write_durably("rec.json", b"{}", dir_fd=dfd, sync_dir=True)
        assert write_durably("rec.json", b"[1]", dir_fd=dfd)
    finally:
        os.close(dfd)
    assert (tmp_path / "rec.json").read_bytes() == b"[1]" and _entries(tmp_path) == ["rec.json"]
