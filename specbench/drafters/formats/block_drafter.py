"""The published DSpark / DFlash drafter architecture, as a `DSparkDrafter` (gpt-fast style).

The suite's own drafter (specbench/drafters/dspark.py) and the published ones share the backbone:
fc + hidden_norm over the concatenated target taps, Qwen3 decoder layers with KV injection
(context K/V through each layer's own k_proj / v_proj, k-norm, rope at absolute positions),
the final norm and the vanilla Markov bias W1[x_{k−1}]·W2. They differ in five places, which this
subclass adds so that a published checkpoint computes exactly what its own code computes
(docs/formats.md lists them with the reference files):

  * mask slots are the embedding of a vocabulary id (`mask_token_id`), not a learned vector:
    `mask_embedding` is set to that row at load time (the row of the checkpoint's own embedding
    where it carries one, DeepSpec; the target's otherwise, SpecForge / z-lab);
  * which slots predict (`first_slot`): DeepSpec's and SpecForge's DSpark read all γ slots
    (slot k → token anchor_pos + k + 1, the suite's convention); DFlash (z-lab, SpecForge) reads
    the mask slots only (slot k ≥ 1 → token anchor_pos + k), so a block of γ slots gives γ − 1
    drafts;
  * two more Markov heads: "gated", B_k = W2(σ(W_g[h_k ; W1[x_{k−1}]] + b_g) ⊙ W1[x_{k−1}]),
    and "rnn", s_k = σ(g)⊙s_{k−1} + (1 − σ(g))⊙tanh(c), B_k = W2(tanh(o)) with (g, c, o) =
    W_j[s_{k−1} ; W1[x_{k−1}] ; h_k] + b_j and s_0 = 0 (docs/dspark.md §2.3);
  * the embedding and the output head may be the checkpoint's own tensors (DeepSpec stores frozen
    copies of the target's) instead of the target's;
  * draft-layer widths come from the checkpoint's config (only the hidden size must match the
    target), and the whole vocabulary is drafted from (no reduced draft vocabulary).

Everything else — the context cache, `append_context`, the policy interface — is the parent's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specbench.drafters.dspark import DSparkArgs, DSparkDrafter
from specbench.engine.model import round_to_bucket
from specbench.errors import UserError
from specbench.engine.model import ModelArgs, rope_inv_freq
from specbench.engine.sampling import probs_from_logits, sample

MARKOV_HEADS = ("vanilla", "gated", "rnn")


class PublishedBlockDrafter(DSparkDrafter):
    """A DSpark / DFlash drafter in the published layout. `args.block_size` is the number of slots
    (the published `block_size`); `block_size` (the property the policy reads) is the number of
    drafts, slots − first_slot."""

    def __init__(self, args: DSparkArgs, embed_weight: Tensor, lm_head_weight: Tensor, *,
                 markov_head_type: str = "vanilla", first_slot: int = 0, mask_token_id: int = 0):
        if markov_head_type not in MARKOV_HEADS:
            raise ValueError(f"markov_head_type must be one of {MARKOV_HEADS}, not {markov_head_type!r}")
        if args.draft_vocab:
            raise ValueError("published drafters draft from the whole vocabulary")
        if first_slot not in (0, 1) or args.block_size - first_slot < 1:
            raise ValueError(f"first_slot {first_slot} leaves no draft slot in a block of {args.block_size}")
        super().__init__(args, embed_weight, lm_head_weight)
        self.markov_head_type = markov_head_type
        self.first_slot = first_slot
        self.mask_token_id = int(mask_token_id)
        d, r = args.model_args.dim, args.markov_rank
        self.markov_gate = nn.Linear(d + r, r) if r > 0 and markov_head_type == "gated" else None
        self.markov_rnn = nn.Linear(2 * r + d, 3 * r) if r > 0 and markov_head_type == "rnn" else None

    def forward_blocks(self, features: Tensor, input_ids: Tensor, anchors: Tensor) -> Tensor:
        raise NotImplementedError("published drafters are loaded to draft, not trained here: the suite trains "
                                  "its own DSparkDrafter (specbench/train/dspark.py)")

    @property
    def slots(self) -> int:
        return self.args.block_size

    @property
    def block_size(self) -> int:
        return self.args.block_size - self.first_slot

    def block_inputs(self, anchors: Tensor) -> Tensor:
        """anchors [...] → [..., slots, d]: the anchor's embedding, then slots − 1 mask embeddings."""
        emb = F.embedding(anchors, self.embed_weight).to(self.dtype)
        masks = self.mask_embedding.expand(*anchors.shape, self.slots - 1, emb.shape[-1])
        return torch.cat([emb[..., None, :], masks], dim=-2)

    @torch.no_grad()
    def block_hidden(self, anchor_tokens: Tensor, anchor_positions: Tensor | None = None) -> Tensor:
        """Backbone pass for one block per row against the cached context → h [b, drafts, d] (the
        hidden states of the predicting slots only)."""
        b, g = anchor_tokens.shape[0], self.slots
        device = anchor_tokens.device
        ctx_len = self.ctx_len[:b]
        if anchor_positions is None:
            anchor_positions = ctx_len
        kv_len = round_to_bucket(int(ctx_len.max()), self.max_ctx)
        x = self.block_inputs(anchor_tokens)
        positions = anchor_positions[:, None] + torch.arange(g, device=device)[None]
        ctx_visible = torch.arange(kv_len, device=device)[None, :] < ctx_len[:, None]
        mask = torch.cat([ctx_visible[:, None, :].expand(b, g, kv_len),
                          torch.ones(b, g, g, dtype=torch.bool, device=device)], dim=-1)
        return self._run_layers(x, positions, None, None, mask, cached=True)[:, self.first_slot:]

    def markov_step(self, h: Tensor, prev_tokens: Tensor, state: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        """One sequential step: (bias B_k [..., V] or None without a head, the next RNN state).
        h [..., d] the slot's normed hidden h_k, prev_tokens [...] = x_{k−1}, state s_{k−1} (rnn)."""
        if self.markov_w1 is None:
            return None, None
        prev = self.markov_w1(prev_tokens).to(h.dtype)
        if self.markov_head_type == "vanilla":
            return self.markov_w2(prev), None
        if self.markov_head_type == "gated":
            gate = torch.sigmoid(self.markov_gate(torch.cat([h, prev], dim=-1)))
            return self.markov_w2(gate * prev), None
        if state is None:
            state = torch.zeros_like(prev)
        gate, candidate, output = self.markov_rnn(torch.cat([state, prev, h], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(output)), state

    def teacher_forced_logits(self, h: Tensor, prev_tokens: Tensor) -> Tensor:
        """Bias-corrected logits of every draft slot for given previous tokens: h [b, n, d],
        prev_tokens [b, n] (x_0 = anchor, then the drafts before each slot) → [b, n, V]."""
        base = self.base_logits(h)
        state, out = None, []
        for k in range(h.shape[1]):
            bias, state = self.markov_step(h[:, k], prev_tokens[:, k], state)
            out.append(base[:, k] if bias is None else base[:, k] + bias.to(base.dtype))
        return torch.stack(out, dim=1)

    @torch.no_grad()
    def draft_block(self, anchor_tokens: Tensor, anchor_positions: Tensor | None, temperature: float,
                    top_p: float = 1.0, generator: torch.Generator | None = None, return_logits: bool = False,
                    with_probs: bool = True):
        """The parent's contract (tokens [b, γ], exact probs [b, γ, V] or None when not
        with_probs, confidence logits or None, optionally the corrected logits), with the
        published heads' sequential step."""
        h = self.block_hidden(anchor_tokens, anchor_positions)  # [b, γ, d]
        base = self.base_logits(h)
        prev, state = anchor_tokens, None
        tokens, probs, logits_out, prevs = [], [], [], []
        for k in range(self.block_size):
            bias, state = self.markov_step(h[:, k], prev, state)
            logits = base[:, k] if bias is None else base[:, k] + bias.to(base.dtype)
            p = probs_from_logits(logits, temperature, top_p)
            x = sample(p, generator)
            prevs.append(prev)
            tokens.append(x)
            probs.append(p)
            logits_out.append(logits)
            prev = x
        prev_tokens = torch.stack(prevs, dim=1)
        out = (torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if with_probs else None,
               self.confidence_logits(h, prev_tokens))
        return out + (torch.stack(logits_out, dim=1),) if return_logits else out


# ----------------------------------------------------------------------------------------------
# Published configs and weight names ↔ this module

# Published weight names that differ from this module's (the backbone's are the same: layers.*,
# fc, hidden_norm, norm). SpecForge's early checkpoints nest the heads under `logit_head.`.
HEAD_NAMES = {
    "markov_head.markov_w1.": "markov_w1.",
    "markov_head.markov_w2.": "markov_w2.",
    "markov_head.gate_proj.": "markov_gate.",
    "markov_head.joint_proj.": "markov_rnn.",
    "confidence_head.proj.": "confidence_head.",
}


def published_to_suite_name(name: str) -> str:
    if name.startswith("logit_head."):
        name = name[len("logit_head."):]
    for published, suite in HEAD_NAMES.items():
        if name.startswith(published):
            return suite + name[len(published):]
    return name


def suite_to_published_name(name: str) -> str:
    for published, suite in HEAD_NAMES.items():
        if name.startswith(suite):
            return published + name[len(suite):]
    return name


def draft_model_args(config: dict, where: str):
    """The draft layers' ModelArgs from a published (Qwen3Config-shaped) config."""
    if config.get("hidden_act", "silu") != "silu":
        raise UserError(f"drafter {where}: hidden_act {config.get('hidden_act')!r} is not supported (silu only)")
    if config.get("attention_bias"):
        raise UserError(f"drafter {where}: attention_bias=true is not supported")
    layer_types = config.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise UserError(f"drafter {where}: only full_attention draft layers are supported, got {sorted(set(layer_types))}")
    try:
        return ModelArgs.from_hf_config({**config, "model_type": "qwen3"})
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"drafter {where}: bad architecture in {where}/config.json: {e}") from None


def load_block_drafter(where: str, config: dict, state: dict, target, *, taps, block_size: int, mask_token_id,
                       markov_rank: int, markov_head_type: str, confidence_head: bool,
                       confidence_with_markov: bool, first_slot: int) -> PublishedBlockDrafter:
    """Build the suite's module for a published block drafter and load its weights, after checking
    that it fits `target` (a loading.LoadedModel): hidden size, vocabulary, tapped layers."""
    base = target.model
    t = base.args
    args = draft_model_args(config, where)
    if args.dim != t.dim:
        raise UserError(f"drafter {where} is for a target of hidden size {args.dim}, not {target.name!r} ({t.dim})")
    if args.vocab_size != t.vocab_size:
        raise UserError(f"drafter {where} has a vocabulary of {args.vocab_size}, target {target.name!r} has {t.vocab_size}")
    try:
        taps = [int(x) for x in taps]
    except (TypeError, ValueError):
        raise UserError(f"drafter {where}: target_layer_ids must be a list of integers, got {taps!r}") from None
    bad = [x for x in taps if not 0 <= x < t.n_layers]
    if not taps or bad:
        raise UserError(f"drafter {where} taps target layers {taps}; target {target.name!r} has layers 0..{t.n_layers - 1}"
                        + (" (−1, the embedding output, is not supported)" if -1 in bad else ""))
    if mask_token_id is None or not 0 <= int(mask_token_id) < t.vocab_size:
        raise UserError(f"drafter {where}: mask_token_id {mask_token_id!r} is not a token id of the vocabulary")
    if markov_head_type not in MARKOV_HEADS:
        raise UserError(f"drafter {where}: unknown markov_head_type {markov_head_type!r} (supported: {', '.join(MARKOV_HEADS)})")
    try:
        dargs = DSparkArgs(model_args=args, tap_layers=taps, block_size=int(block_size), markov_rank=int(markov_rank),
                           confidence_head=bool(confidence_head),
                           confidence_with_markov=bool(confidence_with_markov) and int(markov_rank) > 0)
    except (TypeError, ValueError) as e:
        raise UserError(f"drafter {where}: bad architecture: {e}") from None
    dtype = base.lm_head.weight.dtype
    suite_state = {published_to_suite_name(k): v for k, v in state.items()}
    embed = suite_state.pop("embed_tokens.weight", None)
    head = suite_state.pop("lm_head.weight", None)
    for name, own, target_w in (("embed_tokens", embed, base.model.embed_tokens.weight), ("lm_head", head, base.lm_head.weight)):
        if own is not None and tuple(own.shape) != tuple(target_w.shape):
            raise UserError(f"drafter {where}: its {name} is {tuple(own.shape)}, target {target.name!r} has {tuple(target_w.shape)}")
    embed = base.model.embed_tokens.weight if embed is None else embed.to(device=base.device, dtype=dtype)
    head = base.lm_head.weight if head is None else head.to(device=base.device, dtype=dtype)
    suite_state["mask_embedding"] = embed[int(mask_token_id)].detach().clone()
    try:
        with torch.device("meta"):
            drafter = PublishedBlockDrafter(dargs, embed, head, markov_head_type=markov_head_type,
                                            first_slot=first_slot, mask_token_id=int(mask_token_id))
    except ValueError as e:
        raise UserError(f"drafter {where}: {e}") from None
    try:
        drafter.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in suite_state.items()},
                                assign=True, strict=True)
    except RuntimeError as e:
        raise UserError(f"drafter {where}: weights do not match its config: {_first_problem(e)}") from None
    drafter.inv_freq = rope_inv_freq(args).to(base.device)  # a non-persistent buffer: meta until set
    return drafter.to(base.device).eval().requires_grad_(False)


def _first_problem(e: RuntimeError) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[1] if len(lines) > 1 else lines[0])[:300]


def published_state(drafter: DSparkDrafter, own_embedding: bool) -> dict[str, Tensor]:
    """The drafter's weights under the published names (+ embed_tokens / lm_head copies when the
    layout stores them). The learned mask vector is not a published tensor: the exporter writes
    it into the embedding copy's mask row (formats/export.py)."""
    state = {suite_to_published_name(k): v for k, v in drafter.state_dict().items()
             if k not in ("mask_embedding", "vocab_ids")}
    if own_embedding:
        state["embed_tokens.weight"] = drafter.embed_weight
        state["lm_head.weight"] = drafter.lm_head_weight
    return state
