"""Argument types and checks every command shares.

Each type converts and validates one value and fails as argparse's one-line usage error; the
parser (:class:`Parser`) turns every parse error into a :class:`specbench.errors.UserError`, so a
bad argument is `specbench: error: <message>` and exit status 2, before any file or model is
touched.
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
import re
import tomllib
from pathlib import Path

from specbench.errors import UserError


class Parser(argparse.ArgumentParser):
    def error(self, message):  # default: usage + message, exit 2 → we want one line
        raise UserError(message)


def checked_type(convert, valid, expected: str, must: str):
    """An argparse `type`: convert (ValueError → "expected …"), then check (False → "must …");
    both become argparse's one-line usage error."""

    def parse(s: str):
        try:
            v = convert(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {s!r}") from None
        if not valid(v):
            raise argparse.ArgumentTypeError(f"{must}, got {s!r}")
        return v

    return parse


positive_int = checked_type(int, lambda v: v > 0, "a positive integer", "must be a positive integer")
nonneg_int = checked_type(int, lambda v: v >= 0, "an integer ≥ 0", "must be ≥ 0")
positive_float = checked_type(float, lambda v: math.isfinite(v) and v > 0, "a number > 0", "must be a finite number > 0")
nonneg_float = checked_type(float, lambda v: math.isfinite(v) and v >= 0, "a number ≥ 0", "must be a finite number ≥ 0")
fraction = checked_type(float, lambda v: 0 <= v < 1, "a number in [0, 1)", "must be in [0, 1)")
temperature = checked_type(float, lambda v: math.isfinite(v) and v >= 0, "a number ≥ 0",
                           "temperature must be a finite number ≥ 0")
top_p = checked_type(float, lambda v: 0 < v <= 1, "a number in (0, 1]", "top-p must be in (0, 1]")


def list_of(item_type, what: str):
    """A comma-separated list of `item_type` values, non-empty, without duplicates."""

    def parse(s: str):
        parts = [p.strip() for p in s.split(",")]
        if not s.strip() or any(not p for p in parts):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {s!r}")
        out = [item_type(p) for p in parts]
        if len(set(map(str, out))) != len(out):
            raise argparse.ArgumentTypeError(f"duplicate entries in {s!r}")
        return out

    return parse


def param(s: str) -> tuple[str, object]:
    """NAME=VALUE of a policy parameter override (`--param k=6`)."""
    key, sep, raw = s.partition("=")
    key = key.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {s!r}")
    return key, parse_scalar(raw.strip())


def parse_scalar(raw: str):
    """A TOML scalar (`4`, `0.5`, `true`, `"x"`); anything else is taken as a bare string."""
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    if isinstance(value, (dict, list)) or hasattr(value, "isoformat"):
        return raw
    return value


def check_writable(path: Path, what: str) -> None:
    """`path` can be created (or, if it exists, written), checked by actually doing it and undoing
    it: `os.access` says yes to root even where the kernel refuses (/proc, read-only mounts)."""
    if path.exists():
        if what == "directory" and not path.is_dir():
            raise UserError(f"output directory {path} exists and is not a directory")
        if what == "file" and path.is_dir():
            raise UserError(f"output file {path} is a directory")
    anc = path if path.is_dir() else path.parent
    while not anc.exists():
        if anc == anc.parent:
            break
        anc = anc.parent
    if anc.exists() and not anc.is_dir():
        raise UserError(f"cannot create output {what} {path}: {anc} is not a directory")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise UserError(f"cannot create output {what} {path}: {anc} is not writable")
    made: list[Path] = []  # directories this probe created, removed again (deepest first)
    folder = path if what == "directory" else path.parent
    try:
        for d in reversed([folder, *folder.parents]):
            if not d.exists():
                d.mkdir()
                made.append(d)
        if path.is_file():
            with open(path, "ab"):  # appending nothing changes neither the content nor the mtime
                pass
        else:
            fd, probe = tempfile.mkstemp(prefix=".specbench-write-check.", dir=folder)
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise UserError(f"output {what} {path} is not writable ({e.strerror or e})") from None
    finally:
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass

def add_dtype_argument(sp) -> None:
    """`--dtype` for every command that loads a model (specbench/engine/dtypes.py)."""
    from specbench.engine.dtypes import CHOICES

    sp.add_argument("--dtype", choices=CHOICES, default="auto",
                    help="target and drafter dtype (default auto: bfloat16 on CUDA; on a CPU the faster of "
                         "float32 and bfloat16, measured once and cached)")
