"""Reading and writing HF-format drafter checkpoints: `config.json` + safetensors weights.

A published drafter is a directory (what `save_pretrained` writes: config.json, model.safetensors
or shards listed in model.safetensors.index.json) or a hub id, fetched through huggingface_hub's
own download path (`snapshot_download`), which fails offline with a one-line error. Every failure
— no config, a config that is not JSON, a missing or truncated weights file — is a UserError.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specbench.errors import UserError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve(spec: str) -> Path:
    """A local directory holding config.json, or a hub id downloaded into the hub cache."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / CONFIG).is_file():
            raise UserError(f"drafter {spec}: no {CONFIG} in that directory")
        return path
    if path.exists():
        raise UserError(f"drafter {spec}: not a directory (a drafter directory with {CONFIG} is expected)")
    if HUB_ID.fullmatch(spec):
        return download(spec)
    raise UserError(f"drafter {spec!r}: no such directory, and not a hub id org/name")


def download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja", "*.tiktoken"], etag_timeout=10))
    except Exception as e:  # noqa: BLE001 - offline, 404, gated, DNS: all mean "cannot get it"
        text = (str(e).strip() or type(e).__name__).splitlines()[0][:300]
        raise UserError(f"cannot download drafter {repo_id!r} (offline?): {text}; pass a local directory") from None


def read_config(path: Path) -> dict:
    try:
        config = json.loads((path / CONFIG).read_text())
    except FileNotFoundError:
        raise UserError(f"drafter {path}: no {CONFIG}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"drafter {path}: corrupt {CONFIG}: {e}") from None
    if not isinstance(config, dict):
        raise UserError(f"drafter {path}: {CONFIG} is not a JSON object")
    return config


def weight_files(path: Path) -> list[Path]:
    if (path / INDEX).is_file():
        try:
            names = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"drafter {path}: corrupt {INDEX}: {e}") from None
        files = [path / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UserError(f"drafter {path}: weights file {missing[0]} listed in {INDEX} is missing")
        return files
    if (path / WEIGHTS).is_file():
        return [path / WEIGHTS]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"drafter {path}: no weights ({WEIGHTS} or shards) in that directory")
    return files


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        try:
            state.update(load_file(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"drafter {path}: corrupt or truncated weights file {f.name}: {str(e).splitlines()[0]}") from None
    return state


def unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors with no two sharing storage (safetensors refuses shared ones, e.g.
    the embedding and lm_head copies of a target with tied embeddings)."""
    out, seen = {}, set()
    for name, t in state.items():
        t = t.detach().contiguous().cpu()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        out[name] = t.clone() if key in seen else t
        seen.add(key)
    return out


def write_checkpoint(out: Path, config: dict, state: dict[str, torch.Tensor]) -> None:
    """config.json + model.safetensors into `out`, all or nothing: written into a temporary sibling
    directory that is renamed into place only when complete (no half-written checkpoint)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} already exists and is not an empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(unshared(state), str(tmp / WEIGHTS), metadata={"format": "pt"})
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint is meant to be shared
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        for f in tmp.glob("*"):
            f.unlink()
        tmp.rmdir()
        raise
