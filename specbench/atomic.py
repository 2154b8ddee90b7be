"""Writing a file whole or not at all, and making it durable.

Every output a later run reads back (records rewritten on repair, sweep settings, reports,
profiles, calibration fits, drafter shards, training checkpoints and cards) is written the same
way, so a reader sees the old file or the complete new one, never half of either: write a
temporary file in the destination's folder (same filesystem, so the rename is atomic), fsync it,
rename it over the destination, then fsync the folder (the rename is on disk only once the
folder's entry is). A failure at any point removes the temporary file and leaves the
destination as it was.
"""
from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

FILE_MODE = 0o644  # mkstemp creates 0600; outputs are ordinary readable files


def fsync_dir(folder: Path) -> None:
    """Make the folder's entries (a rename into it, a new file) durable; best effort where the
    platform cannot open a directory."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_contents(folder: Path) -> None:
    """fsync every file directly in `folder`, then the folder: before renaming a freshly written
    folder into place, so the rename cannot point at empty files after a power loss."""
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(folder)


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` for a writer that wants a file name (torch.save,
    safetensors, matplotlib); on a clean exit it replaces `path` durably, on an exception it is
    removed and `path` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_bytes(path: str | Path, data: bytes) -> None:
    with replacing(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | Path, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | Path, obj, indent: int | None = 1) -> None:
    write_text(path, json.dumps(obj, indent=indent) + "\n")
