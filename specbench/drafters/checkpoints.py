"""Drafter checkpoints: load them for a target, refusing drafters trained for another target.

A drafter checkpoint is a directory with `drafter.json` (kind, architecture, training summary and
the target's fingerprint) and `*.safetensors` shards (each ≤ 16 MB so they can be committed).
Drafters never store the target's token embedding or output head: they use the target's own
(frozen) tensors, which keeps a drafter for a 49k-vocabulary target a few MB.

Draft-LM specs for the fixed-K policy:
  "self"          the target drafting for itself (a mechanics check: every draft is accepted)
  "truncate:N"    the target's first N layers + its final norm and head (no training needed)
  a directory     a trained draft LM checkpoint (`python -m specbench train --policy fixed-k`)
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specbench import resources
from specbench.errors import UserError
from specbench.engine.model import ModelArgs, Transformer, rope_inv_freq

CONFIG_NAME = "drafter.json"


def resolve_checkpoint(spec: str) -> Path:
    """A checkpoint directory given as a path, or a shipped drafter by its path in the repository
    ("drafters/smollm2-135m/eagle", found as specbench/resources.py says)."""
    for candidate in (Path(spec), resources.find(spec)):
        if candidate is not None and (candidate / CONFIG_NAME).is_file():
            return candidate
    raise UserError(f"drafter {spec!r}: no {CONFIG_NAME} found there (a drafter checkpoint directory is expected)")


def read_checkpoint(spec: str, target, kind: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """Config and weights of a drafter checkpoint of `kind`, checked against `target`."""
    path = resolve_checkpoint(spec)
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"drafter {path}: corrupt {CONFIG_NAME}: {e}") from None
    if config.get("kind") != kind:
        raise UserError(f"drafter {path} is a {config.get('kind')!r} drafter, not {kind!r}")
    if config.get("target_fingerprint") != target.fingerprint:
        raise UserError(
            f"drafter {path} was trained for target {config.get('target_name')!r} "
            f"(fingerprint {config.get('target_fingerprint')}), not {target.name!r} ({target.fingerprint})"
        )
    state: dict[str, torch.Tensor] = {}
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise UserError(f"drafter {path}: no .safetensors weights")
    for shard in shards:
        try:
            state.update(load_file(shard))
        except (SafetensorError, OSError) as e:
            raise UserError(f"drafter {path}: corrupt weights file {shard.name}: {e}") from None
    return config, state


def read_draft_lm(spec: str, target) -> tuple[dict, dict[str, torch.Tensor], torch.Tensor | None]:
    """A fixed-K draft LM's config, weights and token ranking apart: `vocab_rank`, the token ids by
    training frequency that fixed-K's `draft_vocab` takes a prefix of, is stored beside the weights
    by the trainer (train/draft_lm.py); None for a draft LM saved without one."""
    config, state = read_checkpoint(spec, target, kind="draft-lm")
    return config, state, state.pop("vocab_rank", None)


def load_drafter(spec: str, target, kind: str, parse_args, build, check_args=None) -> torch.nn.Module:
    """A drafter module of `kind` from its checkpoint, for `target` (a loading.LoadedModel): the
    architecture from its config (`parse_args`, then `check_args` to refuse a mismatch), the
    module built by `build(args, target embedding, target lm_head)` on the meta device, the weights
    loaded in the target's dtype, on its device, frozen. Bad configs / weights are UserErrors."""
    config, state = read_checkpoint(spec, target, kind=kind)
    try:
        args = parse_args(config["model_args"])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"drafter {spec}: bad architecture in its config: {e}") from None
    if check_args is not None:
        check_args(args)
    base = target.model
    dtype = base.lm_head.weight.dtype
    with torch.device("meta"):
        drafter = build(args, base.model.embed_tokens.weight, base.lm_head.weight)
    try:
        drafter.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()},
                                assign=True, strict=True)
    except RuntimeError as e:
        raise UserError(f"drafter {spec}: weights do not match its config: {str(e).splitlines()[0]}") from None
    drafter.inv_freq = rope_inv_freq(args.model_args).to(base.device)  # meta-initialised buffer
    return drafter.to(base.device).eval().requires_grad_(False)


def load_draft_lm(spec: str, target) -> Transformer:
    """A draft LM for the fixed-K policy, on the target's device and dtype."""
    base = target.model
    dtype = base.lm_head.weight.dtype
    if spec == "self" or spec.startswith("truncate:"):
        n_layers = base.args.n_layers
        if spec != "self":
            try:
                n_layers = int(spec.split(":", 1)[1])
            except ValueError:
                raise UserError(f"drafter {spec!r}: expected truncate:N with an integer N") from None
            if not 1 <= n_layers <= base.args.n_layers:
                raise UserError(f"drafter {spec!r}: N must be between 1 and {base.args.n_layers}")
        args = ModelArgs(**{**base.args.to_dict(), "n_layers": n_layers})
        state = {k: v for k, v in base.state_dict().items()
                 if not k.startswith("model.layers.") or int(k.split(".")[2]) < n_layers}
    else:
        config, state, rank = read_draft_lm(spec, target)
        args = ModelArgs(**config["model_args"])
        state = {k: v.to(dtype) for k, v in state.items()}
        state["model.embed_tokens.weight"] = base.model.embed_tokens.weight
        state["lm_head.weight"] = base.lm_head.weight
    with torch.device("meta"):
        draft = Transformer(args)
    # assign=True shares the target's tensors instead of copying them; the draft gets its own cache.
    draft.load_state_dict(state, assign=True, strict=True)
    draft.inv_freq = rope_inv_freq(args).to(base.device)  # a buffer, so meta-initialised: recompute
    # The assigned tensors replaced what the constructor packed: pack again, or every draft step runs
    # unpacked (one-row torch.mv per projection, no one-call layers: fixed-k's drafting round took
    # 94 ms against the target's 21 ms verify, docs/performance.md "Session 16"). The head the draft
    # shares with the target keeps the target's packs rather than a second copy of them.
    draft.pack_weights()
    if draft.lm_head.weight is base.lm_head.weight:
        draft.lm_head.gemm_pack = base.lm_head.gemm_pack
    draft.vocab_rank = None if spec == "self" or spec.startswith("truncate:") else rank
    return draft.eval().requires_grad_(False)
