"""specbench/atomic.py: a file is replaced whole or not at all, and no temporary file is left."""
import json
import stat

import pytest

from specbench import atomic


def _names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_write_replaces_whole_file_with_readable_mode(tmp_path):
    path = tmp_path / "sub" / "out.json"
    atomic.write_json(path, {"a": 1})
    atomic.write_json(path, {"b": 2})
    assert json.loads(path.read_text()) == {"b": 2}
    assert _names(path.parent) == ["out.json"]
    assert stat.S_IMODE(path.stat().st_mode) == atomic.FILE_MODE


def test_failed_writer_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "out.txt"
    atomic.write_text(path, "old")
    with pytest.raises(RuntimeError):
        with atomic.replacing(path) as tmp:
            tmp.write_text("half of the new")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "old"
    assert _names(tmp_path) == ["out.txt"]


def test_fsync_contents_and_dir_accept_real_folders(tmp_path):
    (tmp_path / "a").write_bytes(b"1")
    (tmp_path / "sub").mkdir()
    atomic.fsync_contents(tmp_path)  # files and sub-folders alike: no error
    atomic.fsync_dir(tmp_path / "missing")  # best effort: a folder that cannot be opened is skipped
