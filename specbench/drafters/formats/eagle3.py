"""The EAGLE-3 layout of SpecForge / SafeAILab (`LlamaForCausalLMEagle3`,
specforge/modeling/draft/llama3_eagle.py), as an `EagleHead`.

Checkpoint: a LlamaConfig (`architectures ["LlamaForCausalLMEagle3"]`, one decoder layer,
`draft_vocab_size`, optional `target_hidden_size`, `fc_norm`, `norm_output`, and
`eagle_config.eagle_aux_hidden_state_layer_ids`: the three target layers whose outputs are fused,
default [1, L/2 − 1, L − 4] as SpecForge's `resolve_eagle_capture_layers`); weights `fc` (3d → d),
`midlayer.*` (the layer: q/k/v read [input_layernorm(emb) ; hidden_norm(h)], 2d wide), `norm`,
its **own** `lm_head` over the draft vocabulary, `d2t` (draft index j → token j + d2t[j]) and `t2d`,
and usually a frozen copy of the target's `embed_tokens`.

The suite's own head (specbench/drafters/eagle.py) is the same layer and the same training-time-test
indexing; it differs in the output: it scores with the target's frozen lm_head (optionally the
rows of its most frequent tokens) where EAGLE-3 trains its own head over a reduced vocabulary. This
subclass uses the checkpoint's head and d2t map (and its embedding copy, when stored).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specbench.drafters.eagle import EagleArgs, EagleHead
from specbench.errors import UserError
from specbench.engine.model import ModelArgs, RMSNorm, rope_inv_freq

ARCHITECTURES = ("LlamaForCausalLMEagle3",)


class PublishedEagleHead(EagleHead):
    """`own_head` [V_d, d] is the checkpoint's lm_head; `draft_ids` [V_d] the token id of each of its
    rows (None: the identity over the whole vocabulary)."""

    def __init__(self, args: EagleArgs, embed_weight: Tensor, own_head: Tensor, draft_ids: Tensor | None,
                 fc_norm: bool = False, norm_output: bool = True):
        super().__init__(args, embed_weight, own_head)
        a = args.model_args
        self.fc_norm = nn.ModuleList(RMSNorm(a.dim, a.norm_eps) for _ in args.tap_layers) if fc_norm else None
        self.norm_output = norm_output
        self.draft_ids = draft_ids

    def fuse(self, features: Tensor) -> Tensor:
        x = features.to(self.dtype)
        if self.fc_norm is not None:  # per tapped layer, before fc
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(x)

    def _head_input(self, hidden: Tensor) -> Tensor:
        return self.norm(hidden) if self.norm_output else hidden

    def logits(self, hidden: Tensor) -> Tensor:
        """Logits over the draft vocabulary (index j ↔ token draft_ids[j])."""
        return F.linear(self._head_input(hidden), self.lm_head_weight.to(hidden.dtype))

    def draft_vocab(self, n: int = 0) -> tuple[Tensor, Tensor] | None:
        """The checkpoint's draft vocabulary (its d2t map), whatever n asks for: the head was
        trained over exactly those rows."""
        if self.draft_ids is None:
            return None
        return self.draft_ids.to(self.device), self.lm_head_weight

    def draft_logits(self, hidden: Tensor, vocab: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
        if vocab is None:
            return self.logits(hidden), None
        return F.linear(self._head_input(hidden), vocab[1].to(hidden.dtype)), vocab[0]


def default_taps(num_target_layers: int) -> list[int]:
    return [1, num_target_layers // 2 - 1, num_target_layers - 4]


def load(where: str, config: dict, state: dict, target) -> PublishedEagleHead:
    base = target.model
    t = base.args
    try:
        margs = ModelArgs.from_hf_config({**config, "model_type": "llama"})
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"drafter {where}: bad architecture in its config.json: {e}") from None
    margs.qk_norm, margs.attention_bias = False, False
    target_hidden = int(config.get("target_hidden_size") or margs.dim)
    if margs.dim != t.dim or target_hidden != t.dim:
        raise UserError(f"drafter {where} is for a target of hidden size {target_hidden}, not {target.name!r} ({t.dim})")
    if margs.vocab_size != t.vocab_size:
        raise UserError(f"drafter {where} has a vocabulary of {margs.vocab_size}, target {target.name!r} has {t.vocab_size}")
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise UserError(f"drafter {where}: EAGLE-3 heads have one layer, its config says {config.get('num_hidden_layers')}")
    taps = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or default_taps(t.n_layers)
    taps = [int(x) for x in taps]
    if len(taps) != 3 or any(not 0 <= x < t.n_layers for x in taps):
        raise UserError(f"drafter {where} taps target layers {taps}; target {target.name!r} has layers 0..{t.n_layers - 1}")
    dtype = base.lm_head.weight.dtype
    state = dict(state)
    own_head = state.pop("lm_head.weight", None)
    if own_head is None:
        raise UserError(f"drafter {where}: no lm_head.weight in its weights")
    d2t = state.pop("d2t", None)
    state.pop("t2d", None)
    vd = int(config.get("draft_vocab_size") or margs.vocab_size)
    if tuple(own_head.shape) != (vd, margs.dim) or (d2t is not None and tuple(d2t.shape) != (vd,)):
        raise UserError(f"drafter {where}: lm_head / d2t do not match draft_vocab_size {vd}")
    draft_ids = None
    if d2t is not None:
        ids = torch.arange(vd) + d2t.long()
        if int(ids.min()) < 0 or int(ids.max()) >= t.vocab_size or len(ids.unique()) != vd:
            raise UserError(f"drafter {where}: its d2t map does not give {vd} distinct token ids of the vocabulary")
        if not (vd == t.vocab_size and torch.equal(ids, torch.arange(vd))):
            draft_ids = ids.to(base.device)
    elif vd != t.vocab_size:
        raise UserError(f"drafter {where}: a reduced draft vocabulary ({vd}) needs a d2t map")
    embed = state.pop("embed_tokens.weight", None)
    if embed is not None and tuple(embed.shape) != tuple(base.model.embed_tokens.weight.shape):
        raise UserError(f"drafter {where}: its embed_tokens is {tuple(embed.shape)}, the target's "
                        f"{tuple(base.model.embed_tokens.weight.shape)}")
    embed = base.model.embed_tokens.weight if embed is None else embed.to(device=base.device, dtype=dtype)
    suite = {("layer." + k[len("midlayer."):]) if k.startswith("midlayer.") else k: v for k, v in state.items()}
    suite["vocab_rank"] = torch.arange(t.vocab_size, dtype=torch.int32)
    args = EagleArgs(model_args=ModelArgs(**{**margs.to_dict(), "n_layers": 1}), tap_layers=taps)
    with torch.device("meta"):
        head = PublishedEagleHead(args, embed, own_head.to(device=base.device, dtype=dtype), draft_ids,
                                  fc_norm=bool(config.get("fc_norm", False)),
                                  norm_output=bool(config.get("norm_output", True)))
    try:
        head.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in suite.items()},
                             assign=True, strict=True)
    except RuntimeError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise UserError(f"drafter {where}: weights do not match its config: {(lines[1] if len(lines) > 1 else lines[0])[:300]}") from None
    head.inv_freq = rope_inv_freq(args.model_args).to(base.device)
    return head.to(base.device).eval().requires_grad_(False)


def export_config(head: EagleHead, target_config: dict) -> dict:
    m = head.args.model_args
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": m.dim, "target_hidden_size": m.dim, "num_hidden_layers": 1,
        "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads, "head_dim": m.head_dim,
        "intermediate_size": m.intermediate_size, "rms_norm_eps": m.norm_eps, "vocab_size": m.vocab_size,
        "draft_vocab_size": m.vocab_size, "rope_theta": m.rope_theta, "rope_scaling": m.rope_scaling,
        "max_position_embeddings": m.max_position_embeddings, "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": False, "pretraining_tp": 1, "pad_token_id": None, "norm_output": True,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(head.args.tap_layers)},
    }


def export_state(head: EagleHead) -> dict:
    """The suite's head under EAGLE-3 names, with the target's embedding and lm_head as its copies
    (the full vocabulary: d2t all zeros, t2d all true)."""
    state = {("midlayer." + k[len("layer."):]) if k.startswith("layer.") else k: v
             for k, v in head.state_dict().items() if k != "vocab_rank"}
    v = head.args.model_args.vocab_size
    state["embed_tokens.weight"] = head.embed_weight
    state["lm_head.weight"] = head.lm_head_weight
    state["d2t"] = torch.zeros(v, dtype=torch.int64)
    state["t2d"] = torch.ones(v, dtype=torch.bool)
    return state
