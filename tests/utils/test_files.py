"""The one atomic-write helper (``elastic_ssm/utils/files.py``) that every writer of the package uses: the
target is replaced only by a complete file, its mode follows the umask like ``open(path, "w")``, a failed write
leaves the old file and no temporary behind, and its temporary files are the ones the run clean-up removes."""

import hashlib
import os
import stat

import numpy as np
import pytest

from elastic_ssm.utils.files import atomic_write_bytes, atomic_write_text, atomic_writer, is_temp_name


def _mode(p) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_write_returns_sha256_and_follows_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        target = tmp_path / "sub" / "w.bin"   # the parent is created
        assert atomic_write_bytes(target, b"abc" * 1000) == hashlib.sha256(b"abc" * 1000).hexdigest()
        assert target.read_bytes() == b"abc" * 1000 and _mode(target) == 0o644
        os.umask(0o077)
        atomic_write_text(tmp_path / "t.txt", "h\u00e9")
        assert (tmp_path / "t.txt").read_text(encoding="utf-8") == "h\u00e9" and _mode(tmp_path / "t.txt") == 0o600
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["t.txt", "w.bin"]


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "arrays.npz"
    atomic_write_bytes(target, b"old")
    with pytest.raises(RuntimeError), atomic_writer(target) as f:
        f.write(b"half of the new")
        seen = [p.name for p in tmp_path.iterdir() if p.name != "arrays.npz"]
        raise RuntimeError("disk went away")
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["arrays.npz"]
    assert len(seen) == 1 and is_temp_name(seen[0])   # what train/rundir.py cleans up after a crash
    with atomic_writer(target) as f:                    # a streaming writer (np.savez takes the file)
        np.savez(f, x=np.arange(3))
    assert np.load(target)["x"].tolist() == [0, 1, 2]


def test_a_folder_where_the_file_goes_is_named_and_kept(tmp_path):
    """E.g. a run's ``pretrain/latest`` made a folder: the error names it, not the temporary file, and keeps it."""
    (tmp_path / "latest").mkdir()
    (tmp_path / "latest" / "notes").write_text("mine")
    with pytest.raises(IsADirectoryError) as e:
        atomic_write_bytes(tmp_path / "latest", b"step_0000010")
    assert e.value.filename == str(tmp_path / "latest") and "folder" in e.value.strerror
    assert [p.name for p in tmp_path.iterdir()] == ["latest"] and (tmp_path / "latest" / "notes").read_text() == "mine"


@pytest.mark.parametrize("name,temp", [(".model.safetensors.k3j_9.tmp", True), (".step_0000010.tmp", True),
                                       ("model.safetensors", False), ("notes.tmp", False)])
def test_temp_names(name, temp):
    assert is_temp_name(name) == temp
