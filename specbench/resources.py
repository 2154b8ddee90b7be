"""Where the shipped specs and drafters are: `policies/`, `workloads/`, `drafters/` and the
committed cost profiles `results/profiles/`.

Specs name shipped things by their path in the repository (`drafter =
"drafters/smollm2-135m/fixed-k"`), so every place that holds them has the repository's layout.
Those places, first match wins:

1. `$SPECBENCH_HOME`, when set: a folder of your own specs / drafters (or another checkout);
2. the source checkout this package runs from: the folder above `specbench/` when it holds
   `pyproject.toml` (a clone, `pip install -e .`, `python -m specbench` in the repository);
3. the copy installed with the package: `pip install .` ships the four folders as package data
   under `specbench/_shipped/` (pyproject.toml maps them there).

A later place fills in what an earlier one lacks: `$SPECBENCH_HOME` with only a `policies/`
folder still finds the shipped drafters and workloads.
"""
from __future__ import annotations

import os
from pathlib import Path

from specbench.errors import UserError

HOME_VARIABLE = "SPECBENCH_HOME"
PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE_ROOT = PACKAGE_DIR.parent
INSTALLED_ROOT = PACKAGE_DIR / "_shipped"


def cache_dir() -> Path:
    """The suite's cache folder (converted models, cost profiles, built kernels, training data):
    $SPECBENCH_CACHE, else ~/.cache/specbench."""
    return Path(os.environ.get("SPECBENCH_CACHE") or Path.home() / ".cache" / "specbench")


def source_checkout() -> Path | None:
    """The repository this package runs from, or None for an installed (non-editable) package."""
    return SOURCE_ROOT if (SOURCE_ROOT / "pyproject.toml").is_file() else None


def roots() -> list[Path]:
    """The places that may hold shipped folders, in lookup order (existing ones only)."""
    found = []
    home = os.environ.get(HOME_VARIABLE)
    if home:
        home_path = Path(home).expanduser()
        if not home_path.is_dir():
            raise UserError(f"{HOME_VARIABLE}={home} is not a directory")
        found.append(home_path)
    checkout = source_checkout()
    if checkout is not None:
        found.append(checkout)
    if INSTALLED_ROOT.is_dir():
        found.append(INSTALLED_ROOT)
    return found


def find(relative: str | Path) -> Path | None:
    """The first place's copy of `relative` (e.g. "drafters/smollm2-135m/eagle"), or None."""
    for root in roots():
        candidate = root / relative
        if candidate.exists():
            return candidate
    return None


def folders(name: str) -> list[Path]:
    """Every place's copy of the shipped folder `name` ("policies", "results/profiles"), in
    lookup order; a listing takes a file name from the first folder that has it."""
    return [root / name for root in roots() if (root / name).is_dir()]


def files(name: str, pattern: str) -> dict[str, Path]:
    """{stem: path} of the files matching `pattern` in the shipped folder `name`, earlier places
    overriding later ones (a `policies/dspark.toml` of your own replaces the shipped one)."""
    found: dict[str, Path] = {}
    for folder in folders(name):
        for path in sorted(folder.glob(pattern)):
            found.setdefault(path.stem, path)
    return dict(sorted(found.items()))
