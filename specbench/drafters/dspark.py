"""DSpark and DFlash drafters (docs/dspark.md §2, §3), gpt-fast style.

One class serves both methods. DFlash is DSpark's parallel backbone alone (`markov_rank = 0`, no
confidence head, docs/dspark.md §2.6); DSpark adds the sequential Markov head and the confidence head.

Backbone (docs/dspark.md §2.1):
  * target features: raw outputs of m target decoder layers ("taps"), concatenated [.., m·d],
    projected once by `fc` (m·d → d, no bias) and `hidden_norm` (RMSNorm): H_ctx (Eq. 2);
  * a block of γ slots [anchor, MASK × (γ−1)] at positions anchor_pos + k; every slot predicts
    (slot k → token anchor_pos + k + 1), so γ inputs give γ drafts;
  * draft decoder layers as wide as the target (same heads, KV heads, head_dim, MLP, rope): Q from
    the block only, K/V from [H_ctx ; block hidden] through the *same* k_proj / v_proj (KV
    injection, Eq. 3), k-norm on both parts, rope at absolute positions, attention bidirectional
    inside the block and to context positions strictly before the anchor;
  * final `norm` → h_k, base logits U_k = lm_head(h_k) with the *target's* frozen lm_head.

Sequential stage (docs/dspark.md §2.3): logits_k = U_k + B_k with the vanilla Markov bias B_k = W1[x_{k−1}]·W2
(W1 V×r embedding, W2 r×V), tokens sampled left to right from exactly those logits.
Confidence (docs/dspark.md §2.4): c_k = σ(w·[h_k ; W1[x_{k−1}]] + b) — it sees the previous token, never x_k.

Mask token: a learned `mask_embedding` vector (d), not a token id. The target's embedding is
frozen and shared (not stored with the drafter), and SmolLM2's vocabulary has no padded unused
rows, so a separate trainable vector is the clean equivalent of DeepSpec's `mask_token_id`.

Two entry points compute the same function:
  * training: `forward_blocks` runs every anchor's block of a (batch of) sequence(s) in one pass
    with an explicit boolean mask (the offline counterpart of DeepSpec's flex_attention BlockMask);
  * inference: a per-row context KV cache (`append_context`; context KV persists, block KV is
    never stored) and `draft_block`, which samples a block left to right.

Use from a policy (rows = the core's BatchState rows; the cache must hold exactly each row's
committed prefix *before* its anchor, i.e. ctx_len == state.lengths − 1 at every propose):
    begin:   setup_cache(b, seq_cap); append_context(prompt_features, counts=prompt_lengths)
    propose: tokens, probs, conf = draft_block(anchors, None, T, top_p, state.generator)
    observe: append_context(verify_features, counts=(accepted + 1) * active)
             (the anchor and the accepted drafts are now committed; docs/dspark.md §2.2)

Checkpoint (`specbench.train.dspark` writes it with `common.save_drafter`): drafter.json with
kind "dspark" / "dflash" and `model_args` = DSparkArgs.to_dict() (the draft layers' ModelArgs
nested inside), bf16 shards of this module's state_dict (no target tensors).
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specbench.errors import UserError
from specbench.engine import cpu_kernels, huge_pages
from specbench.engine.model import (MLP, Attention, Linear, ModelArgs, RMSNorm, Snapshot, apply_rope, fresh_pack,
                                    linear, pack_weight, pack_linears, packs_in_huge_pages, rope_cos_sin, rope_inv_freq,
                                    round_to_bucket, seeded_normal)
from specbench.engine.sampling import greedy_ids, probs_from_logits, sample

KINDS = ("dspark", "dflash")
# bf16 on a CPU: a block pass runs every draft layer in one kernel call (DSparkDrafter.block_hidden).
# Tests switch it off to compare with the SDPA path.
FUSED_BLOCK = True
# bf16 on a CPU at temperature 0: the Markov head's sequential loop in one kernel call
# (cpu_kernels.markov_draft, the same tokens). Tests switch it off to compare.
FUSED_MARKOV = True
# bf16 on a CPU at temperature 0: a whole drafting round (context append + draft_block) in one kernel
# call (DSparkDrafter.draft_round, the same bits). Tests switch it off to compare.
FUSED_ROUND = True


@dataclass
class DSparkArgs:
    """Architecture of a DSpark / DFlash drafter.

    model_args: the draft layers' shapes — the target's ModelArgs with n_layers = draft layers
        (docs/dspark.md §2.1: a deep copy of the target config, so widths, heads and rope settings match).
    block_size: γ, the number of slots and of drafts per block. 7 = the paper's offline setting
        (Table 1 "block7"; the loss's decay constant 4, docs/dspark.md §6.2, is tuned for it).
    tap_layers: target layers whose raw outputs feed `fc` (m = len(tap_layers)).
    markov_rank: r of W1 (V×r) and W2 (r×V_d); 0 = no sequential head (DFlash).
    confidence_head / confidence_with_markov: docs/dspark.md §2.4; the Markov flag needs markov_rank > 0.
    draft_vocab: V_d > 0 drafts only from the V_d token ids in the `vocab_ids` buffer (the most
        frequent response tokens of the training data, set by the trainer), like EAGLE-3's reduced
        draft vocabulary; 0 = the target's whole vocabulary (the paper). Why: with a 135M target
        and a 49k vocabulary, γ slots through the full lm_head cost more than a target decode step
        on a CPU; V_d = 8192 cuts that six-fold. Drafts outside the subset are never proposed,
        which only lowers acceptance; verification stays exact (probs are full-vocabulary).
    """

    model_args: ModelArgs
    tap_layers: list[int]
    block_size: int = 7
    markov_rank: int = 64
    confidence_head: bool = True
    confidence_with_markov: bool = True
    draft_vocab: int = 0

    def __post_init__(self):
        if isinstance(self.model_args, dict):
            self.model_args = ModelArgs(**self.model_args)
        self.tap_layers = [int(t) for t in self.tap_layers]
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if not self.tap_layers:
            raise ValueError("at least one target tap layer is needed")
        if self.markov_rank == 0:
            self.confidence_with_markov = False
        if not 0 <= self.draft_vocab <= self.model_args.vocab_size:
            raise ValueError(f"draft_vocab must be in [0, {self.model_args.vocab_size}], got {self.draft_vocab}")

    @property
    def kind(self) -> str:
        return "dspark" if self.markov_rank > 0 or self.confidence_head else "dflash"

    @classmethod
    def for_target(cls, target_args: ModelArgs, tap_layers: list[int], variant: str = "dspark", n_layers: int = 2,
                   block_size: int = 7, markov_rank: int = 64, draft_vocab: int = 0,
                   qk_norm: bool | None = None) -> "DSparkArgs":
        """Defaults sized for a small target (issue 4: fewer layers and a smaller rank than the
        paper's 5 / 256): 2 draft layers, γ = 7, r = 64. variant "dflash" drops both heads.
        tap_layers: the training data's (specbench.train.data.default_tap_layers: 1 … L−3).
        qk_norm: per-head q/k norms in the draft layers (None: the target's choice); True gives a
        Llama target a drafter in the Qwen3 layout that DeepSpec and vLLM load."""
        if variant not in KINDS:
            raise ValueError(f"variant must be one of {KINDS}, not {variant!r}")
        layers = {"n_layers": n_layers} if qk_norm is None else {"n_layers": n_layers, "qk_norm": bool(qk_norm)}
        args = ModelArgs(**{**target_args.to_dict(), **layers})
        taps = list(tap_layers)
        dspark = variant == "dspark"
        return cls(model_args=args, tap_layers=taps, block_size=block_size,
                   markov_rank=markov_rank if dspark else 0, confidence_head=dspark,
                   confidence_with_markov=dspark and markov_rank > 0, draft_vocab=draft_vocab)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model_args"] = self.model_args.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DSparkArgs":
        return cls(**d)


def gqa_attention(xq: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """xq [b, q, nh, hd], keys/values [b, nkv, kv, hd], mask [b, q, kv] bool → [b, q, nh·hd].
    Query heads of one KV group are folded into the query axis, as in model.Attention (head h
    uses KV head h // group, transformers' repeat_kv convention)."""
    b, q, nh, hd = xq.shape
    nkv, kv_len = keys.shape[1], keys.shape[2]
    group = nh // nkv
    xq = xq.transpose(1, 2).reshape(b, nkv, group * q, hd)
    folded = mask[:, None, None].expand(b, 1, group, q, kv_len).reshape(b, 1, group * q, kv_len)
    out = F.scaled_dot_product_attention(xq, keys.to(xq.dtype), values.to(xq.dtype), attn_mask=folded)
    return out.reshape(b, nh, q, hd).transpose(1, 2).reshape(b, q, nh * hd)


class DraftAttention(Attention):
    """Target-shaped attention (same q/k/v/o projections and q/k norms as model.Attention) with
    KV injection: keys/values of the projected context are computed by `context_kv` with this
    layer's own k_proj / v_proj, and concatenated before the block's keys/values (Eq. 3)."""

    def context_kv(self, ctx: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """ctx [b, n, d] (H_ctx, already hidden_norm'ed; DFlash does not re-norm it per layer)
        → roped, k-normed keys and values [b, nkv, n, hd]."""
        b, n, _ = ctx.shape
        k = self.k_proj(ctx).view(b, n, self.n_kv_heads, self.head_dim)
        v = self.v_proj(ctx).view(b, n, self.n_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = apply_rope(k, cos, sin)
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor) -> Tensor:
        """x [b, q, d] block hidden (input-normed); ctx_k/ctx_v [b, nkv, c, hd];
        mask [b, q, c + q] over [context keys ; block keys]."""
        b, q, _ = x.shape
        xq = self.q_proj(x).view(b, q, self.n_heads, self.head_dim)
        xk = self.k_proj(x).view(b, q, self.n_kv_heads, self.head_dim)
        xv = self.v_proj(x).view(b, q, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = apply_rope(xq, cos, sin), apply_rope(xk, cos, sin)
        keys = torch.cat([ctx_k.to(xk.dtype), xk.transpose(1, 2)], dim=2)
        values = torch.cat([ctx_v.to(xv.dtype), xv.transpose(1, 2)], dim=2)
        return self.o_proj(gqa_attention(xq, keys, values, mask))


class DraftLayer(nn.Module):
    """Pre-norm residual decoder layer (Llama/Qwen3 layout) around DraftAttention."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = DraftAttention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DSparkDrafter(nn.Module):
    """The drafter. `embed_weight` / `lm_head_weight` are the target's own frozen tensors: kept as
    plain references (not parameters or buffers), so they are never trained nor saved."""

    def __init__(self, args: DSparkArgs, embed_weight: Tensor, lm_head_weight: Tensor):
        super().__init__()
        self.args = args
        a = args.model_args
        d, m, r = a.dim, len(args.tap_layers), args.markov_rank
        self.fc = Linear(m * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, a.norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(DraftLayer(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(d, a.norm_eps)
        self.markov_w1 = nn.Embedding(a.vocab_size, r) if r > 0 else None
        self.markov_w2 = Linear(r, args.draft_vocab or a.vocab_size, bias=False) if r > 0 else None
        conf_in = d + (r if args.confidence_with_markov else 0)
        self.confidence_head = nn.Linear(conf_in, 1) if args.confidence_head else None
        self.register_buffer("inv_freq", rope_inv_freq(a), persistent=False)
        # Reduced draft vocabulary: draft index j ↔ token id vocab_ids[j] (saved with the weights).
        if args.draft_vocab:
            self.register_buffer("vocab_ids", torch.arange(args.draft_vocab, dtype=torch.long))
        else:
            self.vocab_ids = None
        self._draft_head: tuple | None = None  # (cache key, lm_head rows of vocab_ids)
        self._layer_packs: tuple | None = None  # (cache key, per-layer packs for cpu_kernels.decoder_layers)
        # Inside round_routes_pinned: draft_round's route per round shape, else None (checked every round).
        self._round_routes: dict | None = None
        self.set_frozen(embed_weight, lm_head_weight)
        # Inference state (setup_cache): per layer context K/V [max_batch, nkv, max_ctx + 1 + γ, hd]
        # (slot max_ctx is a write-only sink for padding entries; the fused block pass writes a
        # block's own K/V after each row's context, where the next append overwrites them), and
        # per-row context lengths.
        self.k_cache: list[Tensor] = []
        self.v_cache: list[Tensor] = []
        self.ctx_len: Tensor | None = None
        self.max_batch = self.max_ctx = 0

    # ------------------------------------------------------------------------------------------
    # Set-up

    def set_frozen(self, embed_weight: Tensor, lm_head_weight: Tensor) -> None:
        # A tuple hides them from nn.Module registration (state_dict, parameters(), .to()).
        self._frozen = (embed_weight, lm_head_weight)
        self._draft_head = None
        self._forget_round_routes()

    @property
    def embed_weight(self) -> Tensor:
        return self._frozen[0]

    @property
    def lm_head_weight(self) -> Tensor:
        return self._frozen[1]

    @property
    def block_size(self) -> int:
        return self.args.block_size

    @property
    def kind(self) -> str:
        return self.args.kind

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """HF `post_init` defaults (docs/dspark.md §2.5): Linear/Embedding ~ N(0, 0.02), biases 0, RMSNorm 1. The
        initial Markov bias is then ≈ 0, so DSpark starts as DFlash. Drawn from `generator` in a
        fixed module order, so a seed gives bit-identical weights."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    module.weight.copy_(seeded_normal(module.weight, 0.02, generator))
                    if getattr(module, "bias", None) is not None:
                        module.bias.zero_()
                elif isinstance(module, RMSNorm):
                    module.weight.fill_(1.0)
            self.mask_embedding.copy_(seeded_normal(self.mask_embedding, 0.02, generator))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------------------------------------
    # Pieces shared by training and inference

    def project_context(self, features: Tensor) -> Tensor:
        """Eq. 2: H_ctx = RMSNorm(W_c [H(l1); …; H(lm)]), applied once, shared by every layer."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def block_inputs(self, anchors: Tensor) -> Tensor:
        """anchors [...] → [..., γ, d]: slot 0 the anchor's (target) embedding, then γ−1 mask vectors."""
        emb = F.embedding(anchors, self.embed_weight).to(self.dtype)
        masks = self.mask_embedding.expand(*anchors.shape, self.block_size - 1, emb.shape[-1])
        return torch.cat([emb[..., None, :], masks], dim=-2)

    def markov_bias(self, prev_tokens: Tensor) -> Tensor | None:
        """B(x_{k−1}, ·) = W1[x_{k−1}] · W2 (Eq. 5): [...] → [..., V], or None for DFlash."""
        if self.markov_w1 is None:
            return None
        return self.markov_w2(self.markov_w1(prev_tokens))

    @property
    def draft_vocab_size(self) -> int:
        return self.args.draft_vocab or self.args.model_args.vocab_size

    def draft_head_weight(self) -> Tensor:
        """The frozen lm_head rows the drafter scores: all of them, or those of `vocab_ids`
        (gathered once and cached; rebuilt when the head or the subset tensor changes)."""
        w = self.lm_head_weight
        if self.vocab_ids is None:
            return w
        # No values in the key (reading them would sync a GPU every round): the subset tensor only
        # changes in place through set_draft_vocab, which drops the cache; loading or .to() makes
        # a new tensor, which changes its data_ptr.
        key = (w.data_ptr(), w.dtype, w.device, self.vocab_ids.data_ptr())
        if self._draft_head is None or self._draft_head[0] != key:
            with torch.inference_mode(False), torch.no_grad():  # a normal tensor, usable in training too
                rows = w.index_select(0, self.vocab_ids.to(w.device))
            self._draft_head = (key, rows, packs_in_huge_pages(pack_weight(rows)))
        return self._draft_head[1]

    def pack_weights(self) -> None:
        """bf16 on a CPU: the projections' weights reordered once for oneDNN's GEMM, as the
        target's (model.pack_weight; a stale pack is refused, so training is unaffected). Runs
        after every .to(), which replaces parameter storage; the draft head rows are re-gathered
        (and packed) on next use."""
        pack_linears(self)
        self._draft_head = None
        self._layer_packs = None
        self._forget_round_routes()

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.pack_weights()
        return out

    def __getstate__(self):  # copies and pickles leave the packs of the head rows and layers behind
        return {**super().__getstate__(), "_draft_head": None, "_layer_packs": None, "_round_routes": None}

    def set_draft_vocab(self, token_ids: Tensor) -> None:
        """The trainer's choice of the V_d draft tokens (e.g. the most frequent response tokens)."""
        if self.vocab_ids is None or token_ids.numel() != self.vocab_ids.numel():
            raise ValueError(f"this drafter drafts from {self.draft_vocab_size} tokens, got {token_ids.numel()}")
        self.vocab_ids.copy_(token_ids.to(self.vocab_ids))
        self._draft_head = None
        self._forget_round_routes()

    def keep_draft_vocab(self, n: int) -> None:
        """Draft from the first n of the V_d draft tokens only. The trainer stores them most frequent
        first (train/common.py `vocab_rank`), so the first n are the n most frequent response tokens;
        the draft head's rows and the Markov head's W2 rows of the others are dropped. Every draft is
        still verified, so the output is the target's at any n; only which drafts are proposed changes.
        On a CPU the draft head over V_d rows is a third of the drafter's bytes, read after every target
        step has evicted them (docs/performance.md "Session 25")."""
        if self.vocab_ids is None:
            raise ValueError("this drafter drafts from the whole vocabulary: it has no ranked draft vocabulary to cut")
        if not 0 < n <= self.draft_vocab_size:
            raise ValueError(f"draft_vocab must be in 1..{self.draft_vocab_size} for this drafter, got {n}")
        if n == self.draft_vocab_size:
            return
        with torch.no_grad(), torch.inference_mode(False):
            self.vocab_ids = self.vocab_ids[:n].clone()
            if self.markov_w2 is not None:
                w2 = self.markov_w2.weight
                self.markov_w2.weight = nn.Parameter(w2[:n].clone(), requires_grad=w2.requires_grad)
                self.markov_w2.out_features = n
        self.args.draft_vocab = n
        self.pack_weights()

    def keep_block(self, n: int) -> None:
        """Draft n slots a round (the anchor's and n − 1 mask slots) instead of the γ it was trained with.
        The block's attention is bidirectional, so the first n drafts are not exactly what the whole block
        would draft: a different proposal, verified like any other, so the output is the target's at any n.
        Worth it where a round's cost grows with its rows and the last slots are rarely accepted: on a CPU a
        round of γ = 7 rows is compute-bound in the GEMV, while 1–4 rows cost one stream of the weights
        (docs/performance.md "Session 26")."""
        if not 1 <= n <= self.args.block_size:
            raise ValueError(f"block must be in 1..{self.args.block_size} for this drafter, got {n}")
        if n != self.args.block_size:
            self.args.block_size = n
            self.block_cut = n  # recorded with the results (DSpark.params)
            self._forget_round_routes()

    def _linear(self, h: Tensor, w: Tensor) -> Tensor:
        if w.dtype != h.dtype and not torch.is_autocast_enabled(h.device.type):
            w = w.to(h.dtype)
        return F.linear(h, w)

    def base_logits(self, h: Tensor) -> Tensor:
        """U_k over the draft vocabulary (index j = token vocab_ids[j], or all tokens) with the
        target's frozen head (under autocast F.linear casts it)."""
        rows = self.draft_head_weight()
        if self.vocab_ids is not None and rows.dtype == h.dtype and not torch.is_autocast_enabled(h.device.type):
            return linear(h, rows, None, fresh_pack(rows, self._draft_head[2]))
        return self._linear(h, rows)

    def target_logits(self, h: Tensor) -> Tensor:
        """The target's own logits from its final normed hidden state (whole vocabulary)."""
        return self._linear(h, self.lm_head_weight)

    def to_token_ids(self, draft_index: Tensor) -> Tensor:
        return draft_index if self.vocab_ids is None else self.vocab_ids[draft_index]

    def token_to_draft_index(self, token_ids: Tensor) -> Tensor:
        """Draft-vocabulary index of each token id, −1 where the token is outside it."""
        if self.vocab_ids is None:
            return token_ids
        lookup = torch.full((self.args.model_args.vocab_size,), -1, dtype=torch.long, device=token_ids.device)
        lookup[self.vocab_ids.to(token_ids.device)] = torch.arange(len(self.vocab_ids), device=token_ids.device)
        return lookup[token_ids]

    def block_logits(self, h: Tensor, prev_tokens: Tensor) -> Tensor:
        """Bias-corrected logits U_k + B_k (Eq. 4) over the draft vocabulary. h [..., d];
        prev_tokens [...] = x_{k−1} (token ids)."""
        logits = self.base_logits(h)
        bias = self.markov_bias(prev_tokens)
        return logits if bias is None else logits + bias.to(logits.dtype)

    def confidence_logits(self, h: Tensor, prev_tokens: Tensor) -> Tensor | None:
        """z_k with c_k = σ(z_k) = σ(w·[h_k ; W1[x_{k−1}]] + b) (Eq. 7); None without the head.
        Depends on x_{k−1} (prev_tokens), never on x_k: required for lossless scheduling (docs/dspark.md §4.3)."""
        if self.confidence_head is None:
            return None
        if self.args.confidence_with_markov:
            h = torch.cat([h, self.markov_w1(prev_tokens).to(h.dtype)], dim=-1)
        return self.confidence_head(h).squeeze(-1)

    def _run_layers(self, x: Tensor, positions: Tensor, ctx: Tensor | None, ctx_positions: Tensor | None,
                    mask: Tensor, cached: bool) -> Tensor:
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        if not cached:
            ccos, csin = rope_cos_sin(self.inv_freq, ctx_positions, x.dtype)
        for i, layer in enumerate(self.layers):
            if cached:
                kv_len = mask.shape[-1] - x.shape[1]
                ctx_k = self.k_cache[i][: x.shape[0], :, :kv_len]
                ctx_v = self.v_cache[i][: x.shape[0], :, :kv_len]
            else:
                ctx_k, ctx_v = layer.self_attn.context_kv(ctx, ccos, csin)
            x = layer(x, cos, sin, ctx_k, ctx_v, mask)
        return self.norm(x)

    # ------------------------------------------------------------------------------------------
    # Training-time forward: every anchor's block in one pass (docs/dspark.md §6.1)

    def forward_blocks(self, features: Tensor, input_ids: Tensor, anchors: Tensor) -> Tensor:
        """features [B, T, m·d] target taps, input_ids [B, T], anchors [B, N] (positions p with a
        next token; padding anchors may be 0 — their blocks see no context and are masked out of
        the loss by the caller). Returns h [B, N, γ, d], the normed hidden of every slot.

        Keys are [context positions 0..T−1 ; N blocks × γ slots]; a query of block n sees context
        keys at positions < anchors[n] and the γ keys of its own block only (docs/dspark.md §2.1, visibility)."""
        B, T, _ = features.shape
        N, g = anchors.shape[1], self.block_size
        device = features.device
        ctx = self.project_context(features)
        ctx_positions = torch.arange(T, device=device).expand(B, T)
        x = self.block_inputs(input_ids.gather(1, anchors)).reshape(B, N * g, -1)
        slot = torch.arange(g, device=device)
        positions = (anchors[:, :, None] + slot).reshape(B, N * g)
        ctx_visible = torch.arange(T, device=device)[None, None, :] < anchors[:, :, None]  # [B, N, T]
        ctx_visible = ctx_visible[:, :, None, :].expand(B, N, g, T).reshape(B, N * g, T)
        block_id = torch.arange(N, device=device).repeat_interleave(g)
        own_block = (block_id[:, None] == block_id[None, :]).expand(B, N * g, N * g)
        mask = torch.cat([ctx_visible, own_block], dim=-1)
        h = self._run_layers(x, positions, ctx, ctx_positions, mask, cached=False)
        return h.view(B, N, g, -1)

    # ------------------------------------------------------------------------------------------
    # Inference: persistent per-row context KV cache + block drafting (docs/dspark.md §2.2)

    def setup_cache(self, max_batch: int, max_ctx: int, dtype: torch.dtype | None = None) -> None:
        """Allocate (or reuse, when big enough) the context cache; every row starts empty."""
        dtype = dtype or self.dtype
        if max_batch > self.max_batch or max_ctx > self.max_ctx:
            a = self.args.model_args
            shape = (max_batch, a.n_kv_heads, max_ctx + 1 + self.block_size, a.head_dim)
            # Normal tensors (usable inside and outside inference_mode); on a CPU in 2 MB pages like every
            # other tensor a drafting round streams (huge_pages.py).
            caches = huge_pages.cache_zeros([(shape, dtype)] * (2 * len(self.layers)), self.device)
            self.k_cache, self.v_cache = caches[0::2], caches[1::2]
            self.max_batch, self.max_ctx = max_batch, max_ctx
            self._forget_round_routes()
        self.reset(max_batch)

    @contextlib.contextmanager
    def round_routes_pinned(self):
        """Within this block draft_round decides its route (one kernel call or the module path) once per
        round shape and reuses it: the decode loop changes no drafter weight between rounds, and the
        check (every pack fresh, every tensor bf16 on a CPU) cost ~0.15 ms of Python a round on a cold
        cache (docs/performance.md "Session 24"). setup_cache with new caches, a .to(), new frozen
        weights or a new draft vocabulary forget the routes, so those are picked up inside the block too."""
        was, self._round_routes = self._round_routes, {}
        try:
            yield self
        finally:
            self._round_routes = was

    def _forget_round_routes(self) -> None:
        if self._round_routes is not None:
            self._round_routes = {}

    def reset(self, batch: int | None = None) -> None:
        """Empty every row's context (a new batch of prompts)."""
        with torch.inference_mode(False):
            self.ctx_len = torch.zeros(batch or self.max_batch, dtype=torch.long, device=self.device)

    @torch.no_grad()
    def append_context(self, features: Tensor, counts: Tensor | None = None, positions: Tensor | None = None) -> None:
        """Commit target features of newly committed tokens to each row's context.

        features [b, n, m·d]: row r's first counts[r] entries are appended (ragged rows are
        right-padded; counts None = all n). They go to cache slots ctx_len[r] + i; rope positions
        default to the same (the cache then holds exactly the committed prefix before the
        anchor, which is what the draft must see: context positions < anchor, docs/dspark.md §2.1, §2.2).
        Context K/V depend only on the features, so they are computed once here, per layer."""
        b, n, _ = features.shape
        device = features.device
        offsets = torch.arange(n, device=device)[None]
        counts = torch.full((b,), n, device=device, dtype=torch.long) if counts is None else counts.to(device).long()
        slots = self.ctx_len[:b, None] + offsets
        if positions is None:
            positions = slots
        if int((self.ctx_len[:b] + counts).max()) > self.max_ctx:
            raise ValueError(f"draft context cache overflow (capacity {self.max_ctx}); call setup_cache with more room")
        slots = torch.where(offsets < counts[:, None], slots, self.max_ctx)  # padding → the sink slot
        ctx = self.project_context(features)
        cos, sin = rope_cos_sin(self.inv_freq, positions, ctx.dtype)
        kv_packs = self._context_kv_packs(ctx) if FUSED_BLOCK else None
        if kv_packs is not None:  # bf16 on a CPU: per layer one k|v GEMV, then rope + cache write in one call
            a = self.args.model_args
            for i, kv in enumerate(kv_packs):
                cpu_kernels.qkv_rope_cache(cpu_kernels.gemv(ctx, kv, 2 * a.n_kv_heads * a.head_dim), cos, sin, slots,
                                           self.k_cache[i], self.v_cache[i], 0, a.n_kv_heads, a.head_dim)
            self.ctx_len[:b] += counts
            return
        rows = torch.arange(b, device=device)[:, None]
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.context_kv(ctx, cos, sin)  # [b, nkv, n, hd]
            self.k_cache[i][rows, :, slots] = k.transpose(1, 2).to(self.k_cache[i].dtype)
            self.v_cache[i][rows, :, slots] = v.transpose(1, 2).to(self.v_cache[i].dtype)
        self.ctx_len[:b] += counts

    def _kernel_layer_packs(self, x: Tensor) -> tuple[list[Tensor], ...] | None:
        """The per-layer tensors of cpu_kernels.decoder_layers for a block pass, or None where it
        does not apply (not bf16 on a CPU, a gradient needed, biases or q/k norms, more rows than
        the GEMV takes, a head size the attention kernel lacks)."""
        b, g, _ = x.shape
        if not cpu_kernels.applies(x) or not cpu_kernels.decoder_layers_apply(self.args.model_args, b * g, g):
            return None
        packs = self._layer_packs_now()
        return packs[:6] if packs is not None else None

    def _layer_packs_now(self) -> tuple[list[Tensor], ...] | None:
        """Per layer: the norm weights and the GEMV packs of q|k|v, o, gate|up, down (the block
        pass's cpu_kernels.decoder_layers) and of k|v (the context append), or None where a weight
        is not bf16 on a CPU. Packed as one matrix each (copies, so training's parameters stay as
        they are), cached until any parameter is replaced or written (a Snapshot of every module's
        parameters: walking self.parameters() each call cost ~0.1 ms, twice a round)."""
        if self._layer_packs is None or not self._layer_packs[0].holds():
            snapshot = Snapshot([(m._parameters, name, True) for m in self.modules() for name in m._parameters])
            lists = tuple([] for _ in range(7)) if cpu_kernels.applies(*snapshot.tensors) else None
            for layer in self.layers if lists is not None else ():
                attn, mlp = layer.self_attn, layer.mlp
                qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
                gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
                kv = torch.cat([attn.k_proj.weight, attn.v_proj.weight])
                packs = [cpu_kernels.pack(w) for w in (qkv, attn.o_proj.weight, gate_up, mlp.down_proj.weight, kv)]
                if any(p is None for p in packs):
                    lists = None
                    break
                for out, t in zip(lists, (layer.input_layernorm.weight, packs[0], packs[1],
                                          layer.post_attention_layernorm.weight, packs[2], packs[3], packs[4])):
                    out.append(t)
            if lists is not None and huge_pages.ENABLED:  # streamed every round, as the target's are
                # One mapping for every layer's packs, as the target's: not one partly used 2 MB page per list.
                streamed = (1, 2, 4, 5, 6)
                copies = iter(huge_pages.huge_page_copies([t for i in streamed for t in lists[i]]))
                for i in streamed:
                    lists[i][:] = [next(copies) for _ in lists[i]]
            self._layer_packs = (snapshot, lists)  # None too: not rebuilt until a weight changes
        return self._layer_packs[1]

    @torch.no_grad()
    def block_hidden(self, anchor_tokens: Tensor, anchor_positions: Tensor | None = None) -> Tensor:
        """Backbone pass for one block per row against the cached context → h [b, γ, d].

        bf16 on a CPU (where the kernels apply) every draft layer runs in one call,
        cpu_kernels.decoder_layers, as the target's layers do: a draft layer is a target layer
        whose new keys/values are the block's, written after the row's context (slots ctx_len + k,
        beyond what the context holds, so the next append overwrites them) and visible to the whole
        block. The same function as the SDPA path below, with the attention kernel's roundings:
        drafts may differ in the last bits, which verification makes harmless."""
        b, g = anchor_tokens.shape[0], self.block_size
        device = anchor_tokens.device
        ctx_len = self.ctx_len[:b]
        if anchor_positions is None:
            anchor_positions = ctx_len
        x = self.block_inputs(anchor_tokens)
        positions = anchor_positions[:, None] + torch.arange(g, device=device)[None]
        packs = self._kernel_layer_packs(x) if FUSED_BLOCK else None
        if packs is not None:
            a = self.args.model_args
            slots = ctx_len[:, None] + torch.arange(g, device=device)[None]
            kv_len = int(ctx_len.max()) + g
            span = torch.arange(kv_len, device=device)[None, :]
            visible = (span < ctx_len[:, None] + g)[:, None, :].expand(b, g, kv_len)  # context and own block
            cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
            x, _ = cpu_kernels.decoder_layers(x, packs[0], packs[1], packs[2], packs[3], packs[4], packs[5],
                                              self.k_cache, self.v_cache, cos, sin, slots, visible, a.norm_eps,
                                              a.n_heads, a.n_kv_heads, a.head_dim, a.intermediate_size, [])
            return self.norm(x)
        kv_len = round_to_bucket(int(ctx_len.max()), self.max_ctx)
        ctx_visible = torch.arange(kv_len, device=device)[None, :] < ctx_len[:, None]  # [b, kv_len]
        mask = torch.cat([ctx_visible[:, None, :].expand(b, g, kv_len),
                          torch.ones(b, g, g, dtype=torch.bool, device=device)], dim=-1)
        return self._run_layers(x, positions, None, None, mask, cached=True)

    def _context_kv_packs(self, ctx: Tensor) -> list[Tensor] | None:
        """Per layer the k|v GEMV pack where append_context's kernel route computes what the loop
        over context_kv does, with its bits (the GEMV as k_proj's and v_proj's Linear runs it for
        this many rows, rope as apply_rope rounds): bf16 on a CPU, no k norm or projection bias,
        bf16 caches, few enough rows; else None."""
        a = self.args.model_args
        if (a.qk_norm or a.attention_bias or not self.k_cache
                or not cpu_kernels.gemv_takes(ctx.numel() // ctx.shape[-1], a.dim, cpu_kernels.tokens_per_row(ctx))
                or not cpu_kernels.applies(ctx, self.k_cache[0], self.v_cache[0])):
            return None
        packs = self._layer_packs_now()
        return packs[6] if packs is not None else None

    def _markov_kernel_pack(self, base: Tensor) -> Tensor | None:
        """markov_w2's GEMV pack where cpu_kernels.markov_draft computes draft_block's greedy loop
        with its bits: a Markov head, bf16 on a CPU, and every bias product one the loop would also
        run on the GEMV (`linear`'s route for that many rows and this rank); else None."""
        if self.markov_w1 is None or not cpu_kernels.applies(base, self.markov_w1.weight):
            return None
        packs = fresh_pack(self.markov_w2.weight, self.markov_w2.gemm_pack)
        if packs is None or packs.gemv is None or not cpu_kernels.gemv_takes(base.shape[0], self.markov_w1.weight.shape[1]):
            return None
        return packs.gemv

    @torch.no_grad()
    def draft_block(self, anchor_tokens: Tensor, anchor_positions: Tensor | None, temperature: float,
                    top_p: float = 1.0, generator: torch.Generator | None = None, return_logits: bool = False,
                    with_probs: bool = True):
        """Draft γ tokens per row after its anchor (semi-autoregressive, docs/dspark.md §2.3).

        anchor_tokens [b]; anchor_positions [b] (None = each row's context length, the normal
        case). Returns (tokens [b, γ], probs [b, γ, V] float32 — the exact processed distribution
        each token was drawn from, Markov bias for the realised prefix included, over the target's
        whole vocabulary (zero outside a reduced draft vocabulary) —, confidence logits [b, γ] or
        None for DFlash), plus the bias-corrected logits [b, γ, V_d] if return_logits.
        temperature 0 = greedy (one-hot probs). with_probs=False returns None for probs (a greedy
        verifier reads the tokens only), which spares a sampler pass per slot at temperature 0."""
        h = self.block_hidden(anchor_tokens, anchor_positions)  # [b, γ, d]
        base = self.base_logits(h)  # U_k, all slots in parallel
        greedy = temperature <= 0
        w2_pack = self._markov_kernel_pack(base) if greedy and not return_logits and FUSED_MARKOV else None
        probs, confidence = [], None
        if w2_pack is not None:  # bf16 on a CPU: the greedy loop below in one call, the same tokens
            head = self.confidence_head
            fused_head = head is not None and head.bias is not None and cpu_kernels.applies(head.weight, head.bias, h)
            tokens, prev_tokens, confidence = cpu_kernels.markov_draft(
                base, anchor_tokens, self.markov_w1.weight, w2_pack, self.vocab_ids,
                *((h, head.weight, head.bias) if fused_head else ()))
        else:
            prev = anchor_tokens
            tokens, logits_out, prevs = [], [], []
            for k in range(self.block_size):  # the sequential part: only a bias per step
                bias = self.markov_bias(prev)
                logits = base[:, k] if bias is None else base[:, k] + bias.to(base.dtype)
                if greedy:  # the argmax: what sampling the one-hot probs_from_logits(·, 0) gives
                    index = greedy_ids(logits)
                else:
                    p = probs_from_logits(logits, temperature, top_p)
                    index = sample(p, generator)
                    probs.append(p)
                x = self.to_token_ids(index)
                prevs.append(prev)
                tokens.append(x)
                logits_out.append(logits)
                prev = x
            prev_tokens = torch.stack(prevs, dim=1)  # [anchor, x_1..x_{γ−1}]
            tokens = torch.stack(tokens, dim=1)
        if not with_probs:
            probs = None
        else:  # over the target's whole vocabulary: what the verifier compares against
            b, g = tokens.shape
            full = torch.zeros(b, g, self.args.model_args.vocab_size, dtype=torch.float32, device=tokens.device)
            if greedy:
                probs = full.scatter_(2, tokens[..., None], 1.0)
            elif self.vocab_ids is not None:
                probs = full.scatter_(2, self.vocab_ids.to(tokens.device).expand(b, g, -1), torch.stack(probs, dim=1))
            else:
                probs = torch.stack(probs, dim=1)
        if confidence is None:
            confidence = self.confidence_logits(h, prev_tokens)
        out = (tokens, probs, confidence)
        return out + (torch.stack(logits_out, dim=1),) if return_logits else out

    @torch.no_grad()
    def draft_round(self, features: Tensor | None, counts: Tensor | None, anchor_tokens: Tensor, temperature: float,
                    top_p: float = 1.0, generator: torch.Generator | None = None, with_probs: bool = True):
        """A policy's drafting round: append_context(features, counts) (None: nothing new), then
        draft_block(anchor_tokens, None, ...), with draft_block's return. bf16 on a CPU, where every step
        would take its kernel route, both run in one kernel call (cpu_kernels.dspark_round), without the
        Python between the kernels. Greedy: the same bits as the two calls (3.17 → 2.32 ms a round after a
        target step, but 0.1–0.3 ms a round in decoding, within the noise; docs/performance.md "Session 14").
        Sampled at top_p = 1: the Markov head samples in the kernel too, from distributions it computes
        and returns, so the drafts are exact draws from the returned probs (equal to draft_block's up to
        fp32 rounding); this is where the one call pays most (docs/performance.md "Session 22")."""
        b = anchor_tokens.shape[0]
        # Sampled rounds take the kernel only at top_p = 1 (its sampler has no nucleus filter).
        kernel_samples = temperature <= 0 or top_p >= 1.0
        fused = self._round_route(features, b) if kernel_samples and FUSED_ROUND else None
        if fused is None:
            if features is not None:
                self.append_context(features, counts=counts)
            return self.draft_block(anchor_tokens, None, temperature, top_p, generator, with_probs=with_probs)
        if features is not None and int((self.ctx_len[:b] + counts).max()) > self.max_ctx:
            raise ValueError(f"draft context cache overflow (capacity {self.max_ctx}); call setup_cache with more room")
        a = self.args.model_args
        # One uniform per slot, drawn up front (the Python loop draws them slot by slot: the same
        # stream at b = 1, another assignment to rows beyond; each is one U[0, 1) either way).
        uniforms = (torch.rand(b, self.block_size, generator=generator, dtype=torch.float64)
                    if temperature > 0 else None)
        tokens, _, confidence, draft_probs = cpu_kernels.dspark_round(
            features, counts.long() if counts is not None else None, self.ctx_len, *fused, anchor_tokens,
            self.embed_weight, self.mask_embedding, self._layer_packs[1][:6], self.k_cache, self.v_cache,
            self.inv_freq, self.norm.weight,
            self._draft_head[2].gemv, self.draft_vocab_size, self.markov_w1.weight, self._markov_w2_pack,
            self.vocab_ids, self.confidence_head.weight, self.confidence_head.bias, a.norm_eps, a.n_heads,
            a.n_kv_heads, a.head_dim, a.intermediate_size, self.block_size, self.max_ctx, uniforms, temperature)
        probs = None
        if with_probs:  # over the target's vocabulary, as draft_block gives them (zero outside the draft vocabulary)
            probs = torch.zeros(b, self.block_size, a.vocab_size, dtype=torch.float32, device=tokens.device)
            if draft_probs is None:  # greedy: one-hot
                probs.scatter_(2, tokens[..., None], 1.0)
            else:
                probs.scatter_(2, self.vocab_ids.expand(b, self.block_size, -1), draft_probs)
        return tokens, probs, confidence

    def _round_route(self, features: Tensor | None, b: int) -> tuple | None:
        """_round_kernel_args, remembered per round shape inside round_routes_pinned."""
        routes = self._round_routes
        if routes is None or torch.is_autocast_enabled("cpu"):
            return self._round_kernel_args(features, b)
        key = (b, torch.is_grad_enabled(), None if features is None else (features.shape, features.dtype, features.device))
        if key not in routes:
            routes[key] = self._round_kernel_args(features, b)
        return routes[key]

    def _round_kernel_args(self, features: Tensor | None, b: int) -> tuple | None:
        """(fc pack, hidden_norm weight, per-layer k|v packs) for draft_round's one call, where each of
        its steps would take the kernel route in append_context and draft_block (the same checks, so
        the same bits) and neither method is overridden; else None. Leaves the packs it checked in
        self._layer_packs, self._draft_head and self._markov_w2_pack."""
        cls = type(self)
        if (cls.draft_block is not DSparkDrafter.draft_block or cls.append_context is not DSparkDrafter.append_context
                or "draft_block" in self.__dict__ or "append_context" in self.__dict__
                or not (FUSED_BLOCK and FUSED_MARKOV) or self.markov_w1 is None or self.vocab_ids is None
                or torch.is_autocast_enabled("cpu")):
            return None
        a, g = self.args.model_args, self.block_size
        head = self.confidence_head
        if (head is None or head.bias is None or a.qk_norm or a.attention_bias or not self.k_cache
                or not cpu_kernels.decoder_layers_apply(a, b * g, g)):
            return None
        tensors = [self.embed_weight, self.mask_embedding, self.norm.weight, head.weight, head.bias,
                   self.markov_w1.weight, self.k_cache[0], self.v_cache[0]]
        if features is not None:
            tensors += [features, self.hidden_norm.weight]
        if not cpu_kernels.applies(*tensors):
            return None
        packs = self._layer_packs_now()
        if packs is None:
            return None
        rows = self.draft_head_weight()
        head_pack = fresh_pack(rows, self._draft_head[2])
        w2 = fresh_pack(self.markov_w2.weight, self.markov_w2.gemm_pack)
        if (rows.dtype != torch.bfloat16 or head_pack is None or head_pack.gemv is None or w2 is None
                or w2.gemv is None or not cpu_kernels.gemv_takes(b * g, a.dim, g)
                or not cpu_kernels.gemv_takes(b, self.markov_w1.weight.shape[1])):
            return None
        self._markov_w2_pack = w2.gemv
        if features is None:
            return None, None, []
        n = features.shape[1]
        fc = fresh_pack(self.fc.weight, self.fc.gemm_pack)
        if (self.fc.bias is not None or fc is None or fc.gemv is None
                or not cpu_kernels.gemv_takes(b * n, features.shape[-1], n)
                or not cpu_kernels.gemv_takes(b * n, a.dim, n)):
            return None
        return fc.gemv, self.hidden_norm.weight, packs[6]


# ----------------------------------------------------------------------------------------------
# Checkpoints


def build_drafter(args: DSparkArgs, target_model, dtype: torch.dtype | None = None) -> DSparkDrafter:
    """A fresh drafter sharing `target_model`'s (a specbench Transformer) embedding and lm_head."""
    drafter = DSparkDrafter(args, target_model.model.embed_tokens.weight, target_model.lm_head.weight)
    return drafter.to(device=target_model.device, dtype=dtype or target_model.lm_head.weight.dtype)


def load_dspark_drafter(spec: str, target, kind: str | None = None) -> DSparkDrafter:
    """Load a "dspark" or "dflash" checkpoint for `target` (a loading.LoadedModel), on the
    target's device and dtype, sharing its frozen embedding / lm_head. A drafter trained for
    another target, of another kind, or with corrupt files is refused with a UserError."""
    import json

    from specbench.drafters.checkpoints import CONFIG_NAME, load_drafter, resolve_checkpoint

    if kind is None:
        path = resolve_checkpoint(spec)
        try:
            kind = json.loads((path / CONFIG_NAME).read_text()).get("kind")
        except json.JSONDecodeError as e:
            raise UserError(f"drafter {path}: corrupt {CONFIG_NAME}: {e}") from None
        if kind not in KINDS:
            raise UserError(f"drafter {path} is a {kind!r} drafter, not one of {KINDS}")
    return load_drafter(spec, target, kind, DSparkArgs.from_dict, DSparkDrafter)
