"""The EAGLE-3-style draft head (docs/eagle.md §2, §3), gpt-fast style.

Architecture (one decoder layer, target-shaped widths, heads and rope):
  * fused features: raw outputs of m target decoder layers (the taps, concatenated, m·d) →
    `fc` (m·d → d, no bias). EAGLE-3 fuses low / middle / high layers ([1, 14, 27] for
    SmolLM2-135M's 30 layers: `specbench.train.data.default_tap_layers`).
  * the layer takes two inputs per position: a hidden state h (the fused target feature at the
    first step; the head's *own* previous output afterwards) and the embedding of the next token
    (the target's frozen embedding). EAGLE-3's wide attention input: q/k/v read
    [input_layernorm(emb) ; hidden_norm(h)] (2d wide); the residual stream is h; then the usual
    post-attention norm + MLP. Everything else (GQA, rope, q/k norms, MLP) is `model.py`'s.
  * the layer output is the next step's hidden; logits = target lm_head(norm(output)) (frozen).

Indexing. Entry t of a row = (h = fc(f_t), token x_{t+1}) at rope position t, where f_t are the
target's taps at position t; its output predicts x_{t+2}. Training-time test (EAGLE-3 `traineagle3`)
unrolls step i at index t: (h = output of step i−1 at index t, token x_{t+1+i}) at rope position
t + i, attending to the step-0 keys at indices ≤ t and to its own earlier steps' keys at index t.
At inference that is exactly a draft-tree node at depth i below the last committed entry: it sees
the committed context and its ancestors (`Eagle` policy, specbench.policies.eagle).

Inference state: a per-row KV cache (model.Attention's own static cache) holding the committed
entries 0..L−2 (L = the row's committed length; the last entry carries the anchor's token), then
scratch slots for the current round's draft nodes, and one sink slot (never visible) that absorbs
padding writes. `h_last[r]` is the output of row r's last committed entry: the hidden that
drafting starts from (its logits give the depth-1 candidates).

Checkpoint: kind "eagle", `model_args` = EagleArgs.to_dict(), bf16 weights of this module only (the
target's embedding / lm_head are never stored) + `vocab_rank` (int32, the training tokens'
frequency order, for the optional reduced draft vocabulary). For SmolLM2-135M: 5.09 M
parameters, 10.4 MB in one safetensors file.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specbench.errors import UserError
from specbench.engine import huge_pages
from specbench.engine.model import (MLP, Attention, Linear, ModelArgs, RMSNorm, apply_rope, fresh_pack, linear,
                                    pack_weight, pack_linears, packs_in_huge_pages, rope_cos_sin, rope_inv_freq,
                                    round_to_bucket, seeded_normal)

KIND = "eagle"


@dataclass
class EagleArgs:
    """model_args: the layer's shapes = the target's ModelArgs with n_layers = 1.
    tap_layers: target layers whose raw outputs are fused by `fc` (the training data's).
    trained_vocab: the reduced draft vocabulary (its size, a prefix of `vocab_rank`) the head was
    trained on, 0 = the whole vocabulary; the policy drafts from it unless told otherwise."""

    model_args: ModelArgs
    tap_layers: list[int]
    trained_vocab: int = 0

    def __post_init__(self):
        if isinstance(self.model_args, dict):
            self.model_args = ModelArgs(**self.model_args)
        self.tap_layers = [int(t) for t in self.tap_layers]
        self.trained_vocab = int(self.trained_vocab)
        if not self.tap_layers:
            raise ValueError("at least one target tap layer is needed")

    @classmethod
    def for_target(cls, target_args: ModelArgs, tap_layers) -> "EagleArgs":
        return cls(model_args=ModelArgs(**{**target_args.to_dict(), "n_layers": 1}), tap_layers=list(tap_layers))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model_args"] = self.model_args.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EagleArgs":
        return cls(**d)


class EagleAttention(Attention):
    """model.Attention (its static per-row KV cache and forward) with 2d-wide q/k/v inputs."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        bias, wide = args.attention_bias, 2 * args.dim
        self.q_proj = Linear(wide, args.n_heads * args.head_dim, bias=bias)
        self.k_proj = Linear(wide, args.n_kv_heads * args.head_dim, bias=bias)
        self.v_proj = Linear(wide, args.n_kv_heads * args.head_dim, bias=bias)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Roped (and q/k-normed) q [b, q, nh, hd], k / v [b, q, nkv, hd] (the cache-free path)."""
        b, q, _ = x.shape
        xq = self.q_proj(x).view(b, q, self.n_heads, self.head_dim)
        xk = self.k_proj(x).view(b, q, self.n_kv_heads, self.head_dim)
        xv = self.v_proj(x).view(b, q, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        return apply_rope(xq, cos, sin), apply_rope(xk, cos, sin), xv


class EagleLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = EagleAttention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(args.dim, args.norm_eps)  # on the hidden input
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)

    def attn_input(self, hidden: Tensor, emb: Tensor) -> Tensor:
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: Tensor, attn_out: Tensor) -> Tensor:
        x = hidden + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, hidden, emb, cos, sin, slots, mask):
        """Cached path (inference): writes this step's K/V into the cache at `slots`."""
        return self.finish(hidden, self.self_attn(self.attn_input(hidden, emb), cos, sin, slots, mask))


def ttt_attention(q: Tensor, k0: Tensor, v0: Tensor, q_index: Tensor, diag_k: list[Tensor], diag_v: list[Tensor]) -> Tensor:
    """Training-time-test attention. q [B, N, nh, hd] at sequence indices q_index [B, N];
    k0/v0 [B, T, nkv, hd] the step-0 keys/values (query at index t sees indices ≤ t); diag_k/v:
    earlier steps' keys/values at the queries' own indices, each [B, N, nkv, hd]. → [B, N, nh·hd]."""
    B, N, nh, hd = q.shape
    T, nkv = k0.shape[1], k0.shape[2]
    g = nh // nkv
    qf = q.float().view(B, N, nkv, g, hd)
    scale = 1.0 / math.sqrt(hd)
    s0 = torch.einsum("bnkgd,btkd->bkgnt", qf, k0.float()) * scale  # [B, nkv, g, N, T]
    visible = torch.arange(T, device=q.device)[None, None, :] <= q_index[:, :, None]  # [B, N, T]
    s0 = s0.masked_fill(~visible[:, None, None], float("-inf"))
    sd = [torch.einsum("bnkgd,bnkd->bkgn", qf, k.float())[..., None] * scale for k in diag_k]
    p = torch.softmax(torch.cat([s0] + sd, dim=-1), dim=-1)
    out = torch.einsum("bkgnt,btkd->bnkgd", p[..., :T], v0.float())
    for j, v in enumerate(diag_v):
        out = out + p[..., T + j].permute(0, 3, 1, 2)[..., None] * v.float()[:, :, :, None]
    return out.reshape(B, N, nh * hd).to(q.dtype)


class EagleHead(nn.Module):
    """The head. `embed_weight` / `lm_head_weight` are the target's own frozen tensors, kept as
    plain references (never trained, saved or moved with the head)."""

    def __init__(self, args: EagleArgs, embed_weight: Tensor, lm_head_weight: Tensor):
        super().__init__()
        self.args = args
        a = args.model_args
        self.fc = Linear(len(args.tap_layers) * a.dim, a.dim, bias=False)
        self.layer = EagleLayer(a)
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(a), persistent=False)
        # Token ids by training-data frequency (most frequent first; set by the trainer): the
        # first n are the reduced draft vocabulary of `set_draft_vocab(n)`.
        self.register_buffer("vocab_rank", torch.arange(a.vocab_size, dtype=torch.int32))
        self._frozen = (embed_weight, lm_head_weight)  # a tuple hides them from nn.Module
        self._head_pack: dict | None = None  # {key: packs} of the heads in use, see _project
        self.ctx_len: Tensor | None = None
        self.h_last: Tensor | None = None
        self.max_batch = self.max_seq = 0

    # ------------------------------------------------------------------------------------------
    @property
    def embed_weight(self) -> Tensor:
        return self._frozen[0]

    @property
    def lm_head_weight(self) -> Tensor:
        return self._frozen[1]

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return tuple(self.args.tap_layers)

    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """Linear ~ N(0, std) (HF post_init), biases 0, RMSNorm 1; drawn in module order from
        `generator`, so a seed gives bit-identical weights."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    module.weight.copy_(seeded_normal(module.weight, std, generator))
                    if module.bias is not None:
                        module.bias.zero_()
                elif isinstance(module, RMSNorm):
                    module.weight.fill_(1.0)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def embed(self, tokens: Tensor) -> Tensor:
        return F.embedding(tokens, self.embed_weight).to(self.dtype)

    def fuse(self, features: Tensor) -> Tensor:
        """Target taps [..., m·d] → the first step's hidden [..., d]."""
        return self.fc(features.to(self.dtype))

    def pack_weights(self) -> None:
        """bf16 on a CPU: the projections' weights reordered once for oneDNN's GEMM, as the
        target's (model.pack_weight; a stale pack is refused, so training is unaffected). Runs
        after every .to(), which replaces parameter storage."""
        pack_linears(self)
        self._head_pack = None

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.pack_weights()
        return out

    def __getstate__(self):  # copies and pickles leave the oneDNN packs behind
        return {**super().__getstate__(), "_head_pack": None, "_draft_vocab_memo": {}}

    def logits(self, hidden: Tensor) -> Tensor:
        """lm_head(norm(h)) with the target's frozen head (under autocast F.linear casts it)."""
        return self._project(self.norm(hidden), self.lm_head_weight)

    def _project(self, h: Tensor, w: Tensor) -> Tensor:
        """h · wᵀ for the head `w` (the whole lm_head or a draft vocabulary's rows). In inference,
        bf16 on a CPU, through `w` packed once (it scores every frontier node of every tree level):
        the GEMV takes one reduced-vocabulary row in a third of F.linear's time (0.13 against 0.39 ms
        for 8192 × 576, one thread, 2-core EPYC), which reorders the weight on every call."""
        if w.dtype != h.dtype and not torch.is_autocast_enabled(h.device.type):
            w = w.to(h.dtype)
        elif w.dtype == h.dtype and not torch.is_grad_enabled():
            key = (w.data_ptr(), w._version)
            packs = self._head_pack or {}
            if key not in packs:  # at most the whole head and one draft vocabulary's rows in use
                packs = {k: v for k, v in list(packs.items())[-1:]}
                packs[key] = packs_in_huge_pages(pack_weight(w))  # read every draft step, as the layers' packs
                self._head_pack = packs
            return linear(h, w, None, fresh_pack(w, packs[key]))
        return F.linear(h, w)

    def draft_vocab(self, n: int = 0) -> tuple[Tensor, Tensor] | None:
        """The n most frequent tokens of the training data (EAGLE-3's reduced draft vocabulary, here
        as rows of the target's frozen lm_head: no extra weights): (ids [n] ascending, their lm_head
        rows [n, d]), or None for the whole vocabulary (n = 0 or ≥ V). Drafting over it cuts the
        per-level vocabulary projection by V/n; tokens outside it are never drafted."""
        if not n or n >= self.args.model_args.vocab_size:
            return None
        # Kept for the head's life: the packed copy of the rows (`_project`) is keyed by their storage.
        key = (n, self.vocab_rank.data_ptr(), self.vocab_rank._version, self.dtype, self.device)
        memo = self.__dict__.setdefault("_draft_vocab_memo", {})
        if key not in memo:
            ids = self.vocab_rank[:n].long().sort().values.to(self.device)
            memo[key] = (ids, self.lm_head_weight[ids].to(self.dtype))
        return memo[key]

    def draft_logits(self, hidden: Tensor, vocab: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
        """(logits [..., n] over `vocab` (from `draft_vocab`; None = all tokens), its ids or None)."""
        if vocab is None:
            return self.logits(hidden), None
        return self._project(self.norm(hidden), vocab[1]), vocab[0]

    # ------------------------------------------------------------------------------------------
    # Training: the step-0 pass over whole sequences and the unrolled training-time-test steps

    def forward_ttt(self, features: Tensor, input_ids: Tensor, steps: int, q_index: Tensor | None = None) -> list[Tensor]:
        """features [B, T, m·d] target taps, input_ids [B, T]. Returns the outputs of `steps`
        unrolled steps, each [B, N, d] at the query indices q_index [B, N] (default: all T).
        Step i at index t: hidden = step i−1's output at t (step 0: fc(f_t)), token x_{t+1+i}
        (0 past the end: such slots are never supervised), rope position t + i; it sees step-0
        keys at indices ≤ t and its own earlier steps' keys at t. Output i predicts x_{t+2+i}."""
        B, T, _ = features.shape
        device = features.device
        layer, attn = self.layer, self.layer.self_attn
        ar = torch.arange(T, device=device)
        padded = torch.cat([input_ids, input_ids.new_zeros(B, steps + 1)], dim=1)

        # Step 0 at every index (its keys are everyone's context).
        hidden = self.fuse(features)
        cos, sin = rope_cos_sin(self.inv_freq, ar.expand(B, T), hidden.dtype)
        q, k0, v0 = attn.qkv(layer.attn_input(hidden, self.embed(padded[:, 1:T + 1])), cos, sin)
        full_index = ar.expand(B, T)
        causal = F.scaled_dot_product_attention(q.transpose(1, 2), k0.transpose(1, 2), v0.transpose(1, 2),
                                                is_causal=True, enable_gqa=True)
        h = layer.finish(hidden, attn.o_proj(causal.transpose(1, 2).reshape(B, T, -1)))
        if q_index is None:
            q_index = full_index
        else:
            h = h.gather(1, q_index[..., None].expand(-1, -1, h.shape[-1]))
        outs = [h]
        diag_k: list[Tensor] = []  # steps 1..i's keys / values at the query indices
        diag_v: list[Tensor] = []
        for i in range(1, steps):
            tokens = padded.gather(1, q_index + 1 + i)
            cos, sin = rope_cos_sin(self.inv_freq, q_index + i, h.dtype)
            q, k, v = attn.qkv(layer.attn_input(h, self.embed(tokens)), cos, sin)
            diag_k, diag_v = diag_k + [k], diag_v + [v]
            h = layer.finish(h, attn.o_proj(ttt_attention(q, k0, v0, q_index, diag_k, diag_v)))
            outs.append(h)
        return outs

    # ------------------------------------------------------------------------------------------
    # Inference: per-row KV cache (committed entries, then scratch for draft nodes, then a sink)

    def setup_cache(self, max_batch: int, max_seq: int, dtype: torch.dtype | None = None) -> None:
        """Room for max_seq slots per row (the last is the sink); every row starts empty."""
        dtype = dtype or self.dtype
        attn = self.layer.self_attn
        if max_batch > self.max_batch or max_seq > self.max_seq:
            a = self.args.model_args
            shape = (max_batch, a.n_kv_heads, max_seq, a.head_dim)
            # Normal tensors; on a CPU in 2 MB pages like every other tensor a round streams (huge_pages.py;
            # with the head pack of `_project`, no measurable change on its own: docs/performance.md "Session 30").
            attn.k_cache, attn.v_cache = huge_pages.cache_zeros([(shape, dtype)] * 2, self.device)
            self.max_batch, self.max_seq = max_batch, max_seq
        self.ctx_len = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self.h_last = torch.zeros(max_batch, self.args.model_args.dim, dtype=self.dtype, device=self.device)

    @property
    def sink(self) -> int:
        return self.max_seq - 1

    def kv_len(self, needed: int) -> int:
        return round_to_bucket(needed, self.sink)

    def step(self, hidden: Tensor, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor) -> Tensor:
        """One cached pass: hidden [b, q, d], tokens [b, q] (their embeddings are the 2nd input),
        rope positions / cache slots [b, q], mask [b, q, kv_len] → outputs [b, q, d]."""
        cos, sin = rope_cos_sin(self.inv_freq, positions, hidden.dtype)
        return self.layer(hidden, self.embed(tokens), cos, sin, slots, mask)

    @torch.no_grad()
    def append_context(self, features: Tensor, tokens: Tensor, counts: Tensor) -> None:
        """Commit entries to each row's context: features [b, n, m·d] (target taps at the next
        positions of the row) and tokens [b, n] (the token *after* each of those positions);
        row r takes its first counts[r] entries (padding goes to the sink). Updates ctx_len and,
        for rows with counts > 0, h_last (the output of the row's new last entry)."""
        b, n, _ = features.shape
        device = features.device
        ctx = self.ctx_len[:b]
        offsets = torch.arange(n, device=device)[None]
        counts = counts.to(device).long()
        if int((ctx + counts).max()) >= self.sink:
            raise ValueError(f"EAGLE head cache overflow (capacity {self.max_seq}); call setup_cache with more room")
        positions = ctx[:, None] + offsets
        slots = torch.where(offsets < counts[:, None], positions, self.sink)
        kv_len = self.kv_len(int(ctx.max()) + n)
        mask = torch.arange(kv_len, device=device)[None, None] <= positions[..., None]
        out = self.step(self.fuse(features), tokens, positions, slots, mask)
        rows = torch.arange(b, device=device)
        last = out[rows, (counts - 1).clamp(min=0)]
        self.h_last[:b] = torch.where((counts > 0)[:, None], last.to(self.h_last.dtype), self.h_last[:b])
        self.ctx_len[:b] = ctx + counts


# ----------------------------------------------------------------------------------------------
# Construction and checkpoints


def build_head(args: EagleArgs, target_model, dtype: torch.dtype | None = None) -> EagleHead:
    """A fresh head sharing `target_model`'s (a specbench Transformer) embedding and lm_head."""
    head = EagleHead(args, target_model.model.embed_tokens.weight, target_model.lm_head.weight)
    return head.to(device=target_model.device, dtype=dtype or target_model.lm_head.weight.dtype)


def load_eagle_head(spec: str, target) -> EagleHead:
    """Load an "eagle" checkpoint for `target` (a loading.LoadedModel) on the target's device and
    dtype, sharing its frozen embedding / lm_head. A head trained for another target, another
    kind of drafter, or corrupt files are refused with a UserError."""
    from specbench.drafters.checkpoints import load_drafter

    def check_widths(args: EagleArgs) -> None:
        if args.model_args.dim != target.model.args.dim or args.model_args.vocab_size != target.model.args.vocab_size:
            raise UserError(f"drafter {spec}: its widths do not match target {target.name!r}")

    return load_drafter(spec, target, KIND, EagleArgs.from_dict, EagleHead, check_widths)
