"""The cost profile's file format: its sections, their keys, and the drafter-cost table's keys.

A profile (`specbench profile`, :mod:`specbench.costs.profile`) is one JSON object:

    context      the context length it was measured at
    entries      [{batch, q, median_ms, ...}]       one bare target forward over q tokens per row
    round        [{batch, q, median_ms, ...}]       optional: one whole decode round of the core
    prefill      [{batch, tokens, median_ms, ...}]  optional: one prefill forward
    draft        [{batch, median_ms, ...}]          optional: one drafting round of its drafter
    target, target_fingerprint, device_name, dtype  what was measured, where

Drafter costs measured apart from a profile live in `drafters.json` tables, keyed
"<drafter path>@<checkpoint digest>|<device name>" (:func:`drafter_cost_key`). Everything that
reads a profile — DSpark's scheduler, the regression gate, the simulator — checks it here, so a
malformed file is one line of error wherever it is read.
"""
from __future__ import annotations

import json
from pathlib import Path

from specbench.errors import UserError

#: section → the numeric keys every entry of it has; `entries` is required, the rest optional
SECTIONS = {
    "entries": ("batch", "q", "median_ms"),
    "round": ("batch", "q", "median_ms"),
    "prefill": ("batch", "tokens", "median_ms"),
    "draft": ("batch", "median_ms"),
}
REQUIRED = ("entries",)
DRAFTER_COSTS_FILE = "drafters.json"


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_profile(data, source: str) -> dict:
    """`data` if it is a cost profile, else UserError naming `source` and the section at fault."""
    if not isinstance(data, dict):
        raise UserError(f"{source}: not a cost profile (a JSON object with \"entries\": [{{batch, q, median_ms}}, ...])")
    for section, fields in SECTIONS.items():
        entries = data.get(section)
        if entries is None and section not in REQUIRED:
            continue
        if not (isinstance(entries, list) and entries
                and all(isinstance(e, dict) and all(_is_number(e.get(k)) for k in fields) for e in entries)):
            keys = ", ".join(fields)
            if section in REQUIRED:
                raise UserError(f"{source}: not a cost profile (needs \"{section}\": [{{{keys}}}, ...])")
            raise UserError(f"{source}: the cost profile's \"{section}\" must be a list of {{{keys}}}")
    return data


def read_profile(path: str | Path) -> dict:
    """The checked profile stored at `path`; unreadable or malformed files are one-line UserErrors."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise UserError(f"cannot read cost profile {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"cost profile {path}: invalid JSON ({e.msg})") from None
    return check_profile(data, str(path))


def drafter_cost_key(drafter: str, digest: str, device: str, dtype: str = "float32") -> str:
    """The `drafters.json` key of a drafter's cost on a device in a dtype (fp32 keys carry no dtype:
    they predate --dtype)."""
    return f"{drafter}@{digest}|{device}" + ("" if dtype == "float32" else f"|{dtype}")


def cut_variant(draft_vocab: int, block: int = 0) -> str:
    """The cost variant of a drafter loaded with its draft vocabulary cut to `draft_vocab` tokens and its
    block cut to `block` slots, each 0 where uncut (profile.load_or_measure's `variant`; build_dspark's
    draft_vocab and block); "" for the drafter as saved."""
    return "-".join(([f"vocab{draft_vocab}"] if draft_vocab else []) + ([f"block{block}"] if block else []))


def split_cost_digest(digest: str) -> tuple[str, str]:
    """(checkpoint digest, variant) of a `drafters.json` key's digest, which load_or_measure writes as
    checkpoint.engine[.variant]; variant "" when the loaded drafter is the checkpoint as saved."""
    parts = digest.split(".")
    return parts[0], ".".join(parts[2:])


def parse_drafter_cost_key(key: str) -> tuple[str, str, str]:
    """(drafter, digest, device) of a `drafters.json` key; digest "" for keys written without one."""
    name, _, rest = key.partition("|")
    device = rest.partition("|")[0]  # a dtype may follow (drafter_cost_key)
    drafter, _, digest = name.partition("@")
    return drafter, digest, device
