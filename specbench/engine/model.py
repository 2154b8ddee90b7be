"""One Llama-family decoder (llama / qwen2 / qwen3 / mistral configs), gpt-fast style.

Explicit tensors, a static KV cache with room for every batch row, and a forward over `q` new
tokens per row whose attention mask, rope positions and cache slots are all given by the caller.
That is what lets one forward serve prefill, plain decode, ragged chain verification (rows with
different numbers of draft tokens) and tree verification (tree mask + depth positions).

Module and parameter names follow transformers' `LlamaForCausalLM`, so a transformers state dict
loads with `load_state_dict` as it is.
"""
from __future__ import annotations

import contextlib
import functools
import math
import operator
import os
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specbench.engine import cpu_f32, cpu_kernels, huge_pages

# Attention over a static cache reads it up to a whole number of buckets rather than to the exact
# committed length, so a run's forwards see a few repeated shapes (cheap for the allocator, and
# what CUDA graphs / compiled kernels need). Target, drafters and policies size their caches with it.
KV_BUCKET = 64


def round_to_bucket(slots: int, cap: int | None = None) -> int:
    """`slots` rounded up to a whole number of KV_BUCKETs, at most `cap`."""
    rounded = -(-slots // KV_BUCKET) * KV_BUCKET
    return rounded if cap is None else min(rounded, cap)


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: dim // n_heads
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # llama3-style {"rope_type": "llama3", ...} or None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_bias: bool = False  # qwen2: bias on q/k/v projections
    qk_norm: bool = False  # qwen3: per-head RMSNorm on q and k
    max_position_embeddings: int = 8192
    extra: dict = field(default_factory=dict)  # config fields kept for fingerprints only

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelArgs":
        """Read a transformers config (object or dict) of a llama / qwen2 / qwen3 / mistral model."""
        c = cfg if isinstance(cfg, dict) else cfg.to_dict()
        model_type = c.get("model_type", "llama")
        supported = ("llama", "qwen2", "qwen3", "mistral")
        if model_type not in supported:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(supported)})")
        return cls(
            vocab_size=c["vocab_size"],
            dim=c["hidden_size"],
            n_layers=c["num_hidden_layers"],
            n_heads=c["num_attention_heads"],
            n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            intermediate_size=c["intermediate_size"],
            head_dim=c.get("head_dim") or 0,
            rope_theta=float(c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(c),
            norm_eps=c.get("rms_norm_eps", 1e-5),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=bool(c.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            max_position_embeddings=c.get("max_position_embeddings", 8192),
            extra={"model_type": model_type},
        )

    def to_dict(self) -> dict:
        return asdict(self)


def _rope_scaling(c: dict) -> dict | None:
    scaling = c.get("rope_scaling") or c.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"rope scaling {kind!r} is not supported (supported: llama3)")
    return dict(scaling)


# Fold each KV group's query heads into the query axis (see Attention.forward). Benchmarks switch it
# off to measure the plain path; both compute the same attention.
FOLD_GQA_HEADS = True
# Where every layer of a forward takes the bf16 CPU kernels, run them all in one call
# (cpu_kernels.decoder_layers: the same kernels in the same order, without Python between them); an
# fp32 decode or verify forward on an AVX2 CPU likewise (cpu_f32.decoder_layers, whose bits are close
# to the per-module path's, not equal). Tests and benchmarks switch it off to compare with that path.
FUSED_LAYERS = True


class Packs(NamedTuple):
    """A weight's copies in faster layouts, and the key they were made from (its storage and
    version counter: any in-place write, such as a load_state_dict, an optimizer step or a write to
    a view, or a replaced tensor makes them stale, and `fresh_pack` then refuses them)."""

    key: tuple[int, int]
    gemm: Tensor | None  # oneDNN's blocked layout, for its bf16 GEMM (more than cpu_kernels.max_rows() rows)
    gemv: Tensor | None  # the suite's GEMV layout (cpu_kernels.pack), for up to cpu_kernels.max_rows() rows


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, packs: Packs | None = None) -> Tensor:
    """F.linear, with a faster route for fp32 decode / verify forwards on a CPU with AVX2 + FMA (the
    suite's GEMV, engine/cpu_f32.py: each weight row read once, each row of x the same bits alone or
    in a batch), and faster routes for bf16 on a CPU:

    * up to cpu_kernels.max_rows() rows with `packs.gemv` (a CPU with AVX-512 BF16, the kernel built): the
      suite's own GEMV (engine/cpu_kernels.py). It streams the weights at close to the machine's read rate
      and gives each row the same bits whatever the number of rows, so a verify forward at b = 1
      projects exactly as the AR steps it replaces. Its bits are not F.linear's (both sum bf16
      products in fp32, in other orders).

    Where that kernel is absent, routes that compute F.linear's bits:

    * one row: a matrix-vector product. torch.mv gave bit-identical results and took 0.57-0.78x
      the time of F.linear's GEMM path for every SmolLM2-135M projection (576x576 to the 49152x576
      head; Xeon with AMX, torch 2.13, min of 25 interleaved calls; fp32 showed no difference).
    * several rows with `packs.gemm`: oneDNN's GEMM on the weight reordered once into its blocked
      layout, instead of reordering it on every call. Bit-identical to F.linear (checked for 2 to
      300 rows on every projection shape of the default model) and 8-20% less time for a whole
      verify or batched-decode forward (docs/performance.md "Decode core, session 5")."""
    if x.dtype == torch.float32 and cpu_f32.applies(x, weight):  # fp32 decode / verify on an AVX2 CPU
        y = cpu_f32.gemv(x, weight)
        return y if bias is None else y + bias
    if packs is not None and torch.is_grad_enabled() and x.requires_grad:
        packs = None  # neither packed route has a backward: a gradient must reach x (F.linear's route)
    if packs is not None and cpu_kernels.gemv_applies(x, packs.gemv):
        y = cpu_kernels.gemv(x, packs.gemv, weight.shape[0])
        return y if bias is None else y + bias
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.numel() == x.shape[-1]:
        y = torch.mv(weight, x.reshape(-1))
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], -1)
    if packs is not None and packs.gemm is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packs.gemm, bias, "none", [], "")
    return F.linear(x, weight, bias)


@functools.cache
def _onednn_packs_bf16() -> bool:
    """Whether oneDNN has a bf16 GEMM on this CPU: it needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT,
    and refuses to pack a bf16 weight elsewhere (seen on an AVX2-only AMD EPYC); bf16 then runs on
    torch's own, slower route, which `--dtype auto` measures like any other."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: Tensor | None) -> Packs | None:
    """`Packs` of a bf16 CPU weight, or None where no faster layout applies (not bf16, not a CPU)."""
    if weight is None or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    gemm = None
    if _onednn_packs_bf16():
        with torch.no_grad(), torch.inference_mode(False):
            # 8: the row count oneDNN tunes the layout for; the results are the same for any count.
            gemm = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)
    kernel = cpu_kernels.pack(weight)
    if gemm is None and kernel is None:
        return None
    return Packs((weight.data_ptr(), weight._version), gemm, kernel)


def fresh_pack(weight: Tensor, packs: Packs | None) -> Packs | None:
    """`packs` if they still match `weight` and no gradient must reach `weight` (neither faster
    route has a backward)."""
    if packs is None or packs.key != (weight.data_ptr(), weight._version):
        return None
    if torch.is_grad_enabled() and weight.requires_grad:
        return None
    return packs


PACK_ATTRIBUTES = ("gemm_pack", "qkv_gemm_pack", "gate_up_gemm_pack")  # where modules keep their Packs


def pack_linears(module: nn.Module) -> None:
    """`pack_weight` for every `Linear` under `module` (a drafter's projections: bf16 on a CPU
    they then run packed like the target's; elsewhere the packs are None). Call again after
    anything that replaces parameter storage (.to(), load_state_dict(assign=True))."""
    for m in module.modules():
        if isinstance(m, Linear):
            m.gemm_pack = pack_weight(m.weight)
    gemv_packs_in_huge_pages(module)


def gemv_packs_in_huge_pages(module: nn.Module) -> None:
    """Move the GEMV packs of every projection under `module` into one buffer of 2 MB pages
    (huge_pages.py: a decode step streams them all, and with 4 KB pages it ran 5% slower at b = 1)."""
    if not huge_pages.ENABLED:
        return
    owners = [(m, name, getattr(m, name)) for m in module.modules() for name in PACK_ATTRIBUTES
              if isinstance(getattr(m, name, None), Packs) and getattr(m, name).gemv is not None]
    copies = huge_pages.huge_page_copies([packs.gemv for _, _, packs in owners])
    for (m, name, packs), copy in zip(owners, copies):
        setattr(m, name, packs._replace(gemv=copy))


def packs_in_huge_pages(packs: Packs | None) -> Packs | None:
    """`packs` with its GEMV pack moved into 2 MB pages (gemv_packs_in_huge_pages, for one weight)."""
    if packs is None or packs.gemv is None or not huge_pages.ENABLED:
        return packs
    return packs._replace(gemv=huge_pages.huge_page_copies([packs.gemv])[0])


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) through `linear`; `gemm_pack` is set by
    Transformer.pack_weights."""

    gemm_pack: Packs | None = None

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, fresh_pack(self.weight, self.gemm_pack))

    def __getstate__(self):  # copies and pickles leave the oneDNN pack behind (it has no storage to copy)
        return _without_packs(super().__getstate__())


def _without_packs(state: dict) -> dict:
    return {**state, **{k: None for k in PACK_ATTRIBUTES if k in state}}


def pack_rows(projections) -> tuple[Tensor, Tensor | None]:
    """The weights (and biases) of `projections` stacked into one tensor, each projection's
    parameters made views of their rows in it (Attention.pack_qkv, MLP.pack_gate_up): names,
    state dicts and in-place loads are unchanged, and writes to a parameter land in the stack."""
    with torch.no_grad(), torch.inference_mode(False):
        weight = torch.cat([p.weight.detach() for p in projections])
        has_bias = projections[0].bias is not None
        bias = torch.cat([p.bias.detach() for p in projections]) if has_bias else None
        start = 0
        for p in projections:
            rows = p.weight.shape[0]
            requires_grad = p.weight.requires_grad
            p.weight = nn.Parameter(weight[start:start + rows], requires_grad=requires_grad)
            if bias is not None:
                p.bias = nn.Parameter(bias[start:start + rows], requires_grad=requires_grad)
            start += rows
    return weight, bias


def packed_rows_hold(weight: Tensor | None, projections) -> bool:
    """Whether `projections`' weights are still consecutive views of `weight` (pack_rows; a .to(),
    an assigning load or a replaced parameter breaks that) and no gradient must reach them."""
    if weight is None or (torch.is_grad_enabled() and any(p.weight.requires_grad for p in projections)):
        return False
    step = weight.stride(0) * weight.element_size()
    start = 0
    for p in projections:
        if p.weight.data_ptr() != weight.data_ptr() + start * step:
            return False
        start += p.weight.shape[0]
    return True


def fold_mask(mask: Tensor, group: int) -> Tensor:
    """[b, q, kv_len] → [b, 1, group·q, kv_len]: the mask of the folded-GQA query axis (query head
    h of a KV group at row (h mod group)·q + i sees what query i sees). Built once per forward."""
    b, q, kv_len = mask.shape
    return mask[:, None, None].expand(b, 1, group, q, kv_len).reshape(b, 1, group * q, kv_len)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if cpu_kernels.applies(x, self.weight):  # bf16 on a CPU: one fused call (cpu_kernels.cpp)
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        bias = args.attention_bias
        self.q_proj = Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.k_proj = Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.v_proj = Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.o_proj = Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.k_cache: Tensor | None = None  # [max_batch, n_kv_heads, max_seq, head_dim]
        self.v_cache: Tensor | None = None
        self.qkv_weight: Tensor | None = None  # see pack_qkv
        self.qkv_bias: Tensor | None = None
        self.qkv_gemm_pack = None  # pack_weight(qkv_weight), set by Transformer.pack_weights

    def __getstate__(self):
        return _without_packs(super().__getstate__())

    def pack_qkv(self) -> None:
        """Put the q, k and v projection weights (and biases) into one [(nh + 2·nkv)·hd, dim]
        tensor and make the three parameters views of it, so a forward projects with one matrix
        product instead of three. Names, state dicts and in-place loads are unchanged (the
        parameters are still q_proj.weight, …; writes to them land in the packed tensor).

        Why: at b = 1 the 192x576 k/v and 576x576 q GEMVs are too small to stream their weights
        at full speed (bf16, 2 threads: 3.3 / 6.5 GB/s against 13.6 GB/s for the packed 960x576;
        docs/performance.md "Decode core, session 5"). For a GEMV each output is its own
        dot product, so the packed product is bit-identical to the three separate ones; a GEMM
        (prefill) may block its work differently and round differently in bf16."""
        self.qkv_weight, self.qkv_bias = pack_rows((self.q_proj, self.k_proj, self.v_proj))

    def _packed(self) -> bool:
        """Whether the q/k/v parameters are still views of the packed tensor (a .to(), an
        assigning load or a replaced parameter breaks that), and no gradient must reach them."""
        return packed_rows_hold(self.qkv_weight, (self.q_proj, self.k_proj, self.v_proj))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, mask: Tensor,
                folded_mask: Tensor | None = None) -> Tensor:
        """folded_mask: fold_mask(mask, group), when the caller built it once for all layers."""
        b, q, _ = x.shape
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv_heads
        if self._packed():
            qkv = linear(x, self.qkv_weight, self.qkv_bias, fresh_pack(self.qkv_weight, self.qkv_gemm_pack))
            if self.q_norm is None and cpu_kernels.applies(qkv, self.k_cache, self.v_cache):
                # bf16 on a CPU: split, rope and the cache write in one call, with the same bits
                # as the steps below; q comes back as [b, nh, q, hd]
                xq = cpu_kernels.qkv_rope_cache(qkv, cos, sin, slots, self.k_cache, self.v_cache, nh, nkv, hd)
                return self._attend(xq, mask, folded_mask)
            xq, xk, xv = qkv.split((nh * hd, nkv * hd, nkv * hd), dim=-1)
            xq, xk, xv = xq.reshape(b, q, nh, hd), xk.reshape(b, q, nkv, hd), xv.reshape(b, q, nkv, hd)
        else:
            xq = self.q_proj(x).view(b, q, nh, hd)
            xk = self.k_proj(x).view(b, q, nkv, hd)
            xv = self.v_proj(x).view(b, q, nkv, hd)
        if self.q_norm is not None:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = apply_rope(xq, cos, sin), apply_rope(xk, cos, sin)

        # Write the new keys/values into each row's own cache slots (one row: an index_copy_ along
        # the slot axis, the same write without advanced indexing's index_put).
        if b == 1:
            self.k_cache[0].index_copy_(1, slots[0], xk[0].transpose(0, 1).to(self.k_cache.dtype))
            self.v_cache[0].index_copy_(1, slots[0], xv[0].transpose(0, 1).to(self.v_cache.dtype))
        else:
            rows = torch.arange(b, device=x.device)[:, None]
            self.k_cache[rows, :, slots] = xk.to(self.k_cache.dtype)
            self.v_cache[rows, :, slots] = xv.to(self.v_cache.dtype)
        return self._attend(xq.transpose(1, 2), mask, folded_mask)

    def _attend(self, xq: Tensor, mask: Tensor, folded_mask: Tensor | None) -> Tensor:
        """SDPA of the new queries xq [b, nh, q, hd] over the cache (already holding their own keys
        and values), then o_proj."""
        b, nh, q, hd = xq.shape
        if cpu_kernels.attend_applies(xq, self.k_cache, self.v_cache, mask):
            # bf16 on a CPU, decode / verify: one call, the same bits for a row whatever the number of
            # rows and tokens (cpu_kernels.cpp: attend_bf16)
            return self.o_proj(cpu_kernels.attend(xq, self.k_cache, self.v_cache, mask))
        nkv = self.n_kv_heads
        kv_len = mask.shape[-1]
        keys = self.k_cache[:b, :, :kv_len]
        values = self.v_cache[:b, :, :kv_len]

        # Fold each KV group's query heads into the query axis: [b, nkv, group*q, hd]. Attention then
        # reads each KV head once, whatever q is (plain GQA SDPA re-reads KV per query head when
        # q >= 2; docs/hardware.md §2). Query head h uses KV head h // group, as in
        # transformers' repeat_kv, so this is the same computation.
        group = nh // nkv
        keys, values = keys.to(xq.dtype), values.to(xq.dtype)
        if FOLD_GQA_HEADS:
            xq = xq.reshape(b, nkv, group * q, hd)
            if folded_mask is None:
                folded_mask = fold_mask(mask, group)
            out = F.scaled_dot_product_attention(xq, keys, values, attn_mask=folded_mask)
        else:  # the plain path (benchmarks compare against it): KV repeated per query head
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(xq, keys, values, attn_mask=mask[:, None])
        out = out.reshape(b, nh, q, hd).transpose(1, 2).reshape(b, q, nh * hd)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = Linear(args.dim, args.intermediate_size, bias=False)
        self.up_proj = Linear(args.dim, args.intermediate_size, bias=False)
        self.down_proj = Linear(args.intermediate_size, args.dim, bias=False)
        self.gate_up_weight: Tensor | None = None  # see pack_gate_up
        self.gate_up_gemm_pack = None  # pack_weight(gate_up_weight), set by Transformer.pack_weights

    def __getstate__(self):
        return _without_packs(super().__getstate__())

    def pack_gate_up(self) -> None:
        """Put the gate and up projection weights into one [2·I, dim] tensor and make the two
        parameters views of it (as Attention.pack_qkv does, for the same reason): one product
        instead of two, whose outputs are bit-identical to the two separate GEMVs."""
        self.gate_up_weight, _ = pack_rows((self.gate_proj, self.up_proj))

    def _packed(self) -> bool:
        """Whether gate and up are still views of the packed tensor, no gradient needed."""
        return packed_rows_hold(self.gate_up_weight, (self.gate_proj, self.up_proj))

    def forward(self, x: Tensor) -> Tensor:
        if not self._packed():
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = linear(x, self.gate_up_weight, None, fresh_pack(self.gate_up_weight, self.gate_up_gemm_pack))
        if cpu_kernels.applies(gate_up):  # bf16 on a CPU: silu(gate) · up in one call
            return self.down_proj(cpu_kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, slots, mask, folded_mask=None):
        delta = self.self_attn(self.input_layernorm(x), cos, sin, slots, mask, folded_mask)
        norm = self.post_attention_layernorm
        if cpu_kernels.applies(x, delta, norm.weight):  # bf16 on a CPU: the add and the norm in one call
            x, h = cpu_kernels.add_rms_norm(x, delta, norm.weight, norm.eps)
        else:
            x = x + delta
            h = norm(x)
        return x + self.mlp(h)


class Backbone(nn.Module):
    """`model.` prefix of transformers' checkpoints: embeddings, layers, final norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)


_version = operator.attrgetter("_version")


class Snapshot:
    """What a cached outcome read (Transformer._kernel_stack, DSparkDrafter._layer_packs_now): slots
    (a holder's dict, a name, whether to watch the tensor's contents) with the object each held, and
    each watched tensor's storage and version counter. `holds()` is True while every slot holds the
    same object and no watched tensor was written in place (also through a view: a view shares its
    base's counter) or given new storage (`.data =`).

    Checked per forward, so with map() over built-ins rather than a Python loop: the target's 750
    slots took 150–200 µs a forward as a generator expression, 96–140 µs so, on the 2-core EPYC
    (docs/performance.md, "Session 14")."""

    def __init__(self, slots: list[tuple[dict, str, bool]]):
        self.dicts = [d for d, _, _ in slots]
        self.names = [name for _, name, _ in slots]
        self.objects = list(map(dict.get, self.dicts, self.names))
        watched = {id(t): t for t, (_, _, watch) in zip(self.objects, slots) if watch and isinstance(t, Tensor)}
        self.tensors = list(watched.values())
        self.storages = list(map(Tensor.data_ptr, self.tensors))
        self.versions = list(map(_version, self.tensors))

    def holds(self) -> bool:
        return (all(map(operator.is_, map(dict.get, self.dicts, self.names), self.objects))
                and list(map(_version, self.tensors)) == self.versions
                and list(map(Tensor.data_ptr, self.tensors)) == self.storages)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.max_batch = 0
        self.max_seq = 0
        self._stack_cache = None  # _kernel_stack's last outcome and what it read
        self._stack_pinned = False  # kernel_stack_pinned: that outcome trusted without its checks
        self._rope_tables = None  # rope_tables' last tables and what they were made for
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.pack_weights()

    def pack_weights(self) -> None:
        """Attention.pack_qkv and MLP.pack_gate_up in every layer, then (bf16 on a CPU) every projection's weight copied
        into the faster layouts (`pack_weight`: oneDNN's GEMM, the suite's GEMV kernel) — unless
        those copies would take more than a quarter of the machine's memory (they triple the
        weights' footprint). Runs at
        construction and after every .to() (which replaces parameter storage); a loader that
        assigns new parameters calls it again."""
        for layer in self.model.layers:
            layer.self_attn.pack_qkv()
            layer.mlp.pack_gate_up()
        weight_bytes = sum(p.numel() * p.element_size() for p in self.parameters())
        room = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4 if hasattr(os, "sysconf") else 0
        pack = 2 * weight_bytes <= room
        attentions = [layer.self_attn for layer in self.model.layers]
        mlps = [layer.mlp for layer in self.model.layers]
        run_packed = ({id(p) for a in attentions for p in (a.q_proj, a.k_proj, a.v_proj)}
                      | {id(p) for m in mlps for p in (m.gate_proj, m.up_proj)})
        for module in self.modules():
            if isinstance(module, Linear):
                module.gemm_pack = pack_weight(module.weight) if pack and id(module) not in run_packed else None
        for a in attentions:
            a.qkv_gemm_pack = pack_weight(a.qkv_weight) if pack else None
        for m in mlps:
            m.gate_up_gemm_pack = pack_weight(m.gate_up_weight) if pack else None
        gemv_packs_in_huge_pages(self)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.pack_weights()
        self._stack_cache = None
        return out

    def __getstate__(self):  # copies and pickles rebuild the kernel stack (its snapshot names this object's dicts)
        return {**super().__getstate__(), "_stack_cache": None, "_stack_pinned": False, "_rope_tables": None}

    @contextlib.contextmanager
    def kernel_stack_pinned(self):
        """Within this block, `_kernel_stack` reuses its last outcome without checking the ~750 slots
        it read (its snapshot): the decode loop (core.generate) changes no weight between its forwards,
        and on a cold cache, where a step starts after 270 MB of weight reads, that check cost ~0.3 ms
        of a ~10 ms b = 1 step (docs/performance.md "Session 23"). Checked once on entry; setup_cache
        and a .to() drop the outcome, so new caches or weights are picked up inside the block too."""
        if self._stack_cache is not None and not self._stack_cache[0].holds():
            self._stack_cache = None
        was, self._stack_pinned = self._stack_pinned, True
        try:
            yield self
        finally:
            self._stack_pinned = was

    def rope_tables(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """rope's cos and sin [max_seq, head_dim] for every cache position, rope_cos_sin's values row
        by row (elementwise ops: a position's row does not depend on the others; tests/test_cpu_kernels.py
        checks it), for the one-call forward to look up instead of computing them per forward."""
        key = (self.max_seq, dtype, self.inv_freq.device, self.inv_freq.data_ptr())
        if self._rope_tables is None or self._rope_tables[0] != key:
            with torch.inference_mode(False):
                positions = torch.arange(self.max_seq, device=self.inv_freq.device)[None]
                cos, sin = rope_cos_sin(self.inv_freq, positions, dtype)
                self._rope_tables = (key, cos[0, :, 0].contiguous(), sin[0, :, 0].contiguous())
        return self._rope_tables[1], self._rope_tables[2]

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def setup_cache(self, max_batch: int, max_seq: int, dtype: torch.dtype | None = None) -> None:
        """Allocate (or reuse, when big enough) the static KV cache."""
        dtype = dtype or self.lm_head.weight.dtype
        if max_batch <= self.max_batch and max_seq <= self.max_seq:
            return
        self._stack_cache = None  # it holds the caches being replaced
        a = self.args
        shape = (max_batch, a.n_kv_heads, max_seq, a.head_dim)
        # Normal tensors (not inference tensors), so the cache works inside and outside inference_mode.
        # On a CPU in 2 MB pages, as the weight packs (huge_pages.py): a b = 16 step over 256 cached
        # tokens ran 2-6% faster at q = 1 (docs/performance.md "Session 29").
        # One mapping for every layer's K and V, so small caches do not each take a 2 MB page.
        caches = huge_pages.cache_zeros([(shape, dtype)] * (2 * len(self.model.layers)), self.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = caches[2 * i], caches[2 * i + 1]
        self.max_batch, self.max_seq = max_batch, max_seq

    def move_cache(self, rows: Tensor, src_slots: Tensor, dst_slots: Tensor) -> None:
        """Copy KV entries of each row from src to dst slots (all layers): commits an accepted tree
        path, which was verified at scattered slots, to consecutive ones. Needs src >= dst pairwise
        in increasing order, which a topologically ordered tree guarantees."""
        for layer in self.model.layers:
            attn = layer.self_attn
            for cache in (attn.k_cache, attn.v_cache):
                cache[rows, :, dst_slots] = cache[rows, :, src_slots]

    def _kernel_stack(self, x: Tensor, b: int, q: int, mask: Tensor) -> tuple[tuple[list[Tensor], ...], tuple | None] | None:
        """(The per-layer tensors of cpu_kernels.decoder_layers, `_kernel_tail`), or None unless every layer would
        take the kernel route at every op in DecoderLayer.forward (the same checks, so both paths
        compute the same bits): bf16 on a CPU, no gradient, packs fresh, no biases or q/k norms,
        few enough rows for the GEMV and tokens for the attention kernel. Or, for an fp32 decode or
        verify forward on an AVX2 CPU, those of cpu_f32.decoder_layers (`cpu_f32.decoder_layers_apply`;
        the per-module path then differs from it in its last bits, so every decode and verify forward
        takes it: the AR steps and the verify forwards that replace them compute alike).

        The per-layer checks (~30 layers × a dozen tensors) cost a good part of a millisecond of
        Python per forward, so their outcome is kept with a snapshot of everything it read (see
        `_stack_snapshot`) and reused while the snapshot holds (within `kernel_stack_pinned`, without
        checking it). x: the forward's input [b, q, dim] in fp32; in bf16 the embedding table, which the
        one-call forward reads in its place (same dtype, device and gradient flag). mask None: the chain
        mask, which the one-call forward makes itself."""
        if x.dtype == torch.float32:
            if not cpu_f32.decoder_layers_apply(self.args, x, mask):
                return None
        elif ((mask is not None and mask.dtype != torch.bool) or not cpu_kernels.applies(x)
              or not cpu_kernels.decoder_layers_apply(self.args, b * q, q)):
            return None
        if torch.is_grad_enabled():  # requires_grad flags are not in the snapshot: check afresh
            lists = self._build_kernel_stack()
            return None if lists is None else (lists, self._kernel_tail())
        cached = self._stack_cache
        if cached is not None and (self._stack_pinned or cached[0].holds()):
            return cached[1]
        lists = self._build_kernel_stack()
        outcome = None if lists is None else (lists, self._kernel_tail())
        self._stack_cache = (self._stack_snapshot(), outcome)
        return outcome

    def chain_in_one_call(self, tokens: Tensor, cache_lengths: Tensor, taps: tuple[int, ...] = (),
                          logits: bool = True) -> tuple[Tensor | None, Tensor | None, Tensor] | None:
        """core.forward_new_tokens' forward (`tokens` [b, q] continuing each row's cache at slot
        cache_lengths[r], the chain mask) where the bf16 one-call route takes it, with the positions,
        slots and mask made inside the kernel; None elsewhere (the caller then runs `forward`)."""
        return self._one_call_forward(tokens, cache_lengths, None, None, taps, logits)

    def _one_call_forward(self, tokens: Tensor, positions: Tensor, slots: Tensor | None, mask: Tensor | None,
                          taps: tuple[int, ...], logits: bool) -> tuple[Tensor | None, Tensor | None, Tensor] | None:
        """`forward` through cpu_kernels.decoder_forward (bf16 on a CPU, a decode or verify forward:
        embedding to logits in one call), or None where that route does not apply. No mask: a chain,
        `positions` then the rows' cache lengths [b] (chain_in_one_call)."""
        embed = self.model.embed_tokens.weight
        if not FUSED_LAYERS or embed.dtype != torch.bfloat16:
            return None
        stack = self._kernel_stack(embed, *tokens.shape, mask)
        if stack is None or stack[1] is None:
            return None
        a = self.args
        (_, norm, head), (cos_table, sin_table) = stack[1], self.rope_tables(embed.dtype)
        out, tapped, hidden = cpu_kernels.decoder_forward(
            tokens, embed, cos_table, sin_table, positions, stack[0], slots, mask, norm, head if logits else None,
            a.vocab_size, a.norm_eps, a.n_heads, a.n_kv_heads, a.head_dim, a.intermediate_size,
            sorted(t for t in set(taps) if 0 <= t < a.n_layers))
        if logits and head is None:
            out = self.lm_head(hidden)
        return out, (torch.cat(tapped, dim=-1) if taps else None), hidden

    def _kernel_tail(self) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """What cpu_kernels.decoder_forward reads besides the layers, or None where it does not apply
        (fp32, or a final norm off the kernel route): (the embedding table, the final norm's weight,
        the LM head's GEMV pack, None when stale or absent: the head then runs as a module)."""
        embed, norm = self.model.embed_tokens.weight, self.model.norm.weight
        if (embed.dtype != torch.bfloat16 or not cpu_kernels.applies(embed, norm) or not norm.is_contiguous()
                or not embed.is_contiguous()):
            return None
        head = fresh_pack(self.lm_head.weight, self.lm_head.gemm_pack)
        usable = head is not None and head.gemv is not None and self.lm_head.bias is None
        return embed, norm, (head.gemv if usable else None)

    def _build_kernel_stack(self) -> tuple[list[Tensor], ...] | None:
        if self.lm_head.weight.dtype == torch.float32:
            return self._build_f32_stack()
        lists = tuple([] for _ in range(8))
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not (attn._packed() and mlp._packed()):
                return None
            packs = (fresh_pack(attn.qkv_weight, attn.qkv_gemm_pack), fresh_pack(attn.o_proj.weight, attn.o_proj.gemm_pack),
                     fresh_pack(mlp.gate_up_weight, mlp.gate_up_gemm_pack),
                     fresh_pack(mlp.down_proj.weight, mlp.down_proj.gemm_pack))
            if any(p is None or p.gemv is None for p in packs) or attn.qkv_bias is not None:
                return None
            if not cpu_kernels.applies(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                       attn.k_cache, attn.v_cache):
                return None
            for out, t in zip(lists, (layer.input_layernorm.weight, packs[0].gemv, packs[1].gemv,
                                      layer.post_attention_layernorm.weight, packs[2].gemv, packs[3].gemv,
                                      attn.k_cache, attn.v_cache)):
                out.append(t)
        return lists

    def _build_f32_stack(self) -> tuple[list[Tensor], ...] | None:
        """cpu_f32.decoder_layers' lists: the weights as they are (packed q|k|v and gate|up, contiguous
        float32, no gradient needed) and the float32 caches."""
        lists = tuple([] for _ in range(8))
        grad = torch.is_grad_enabled()
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not (attn._packed() and mlp._packed()) or attn.qkv_bias is not None:
                return None
            tensors = (layer.input_layernorm.weight, attn.qkv_weight, attn.o_proj.weight,
                       layer.post_attention_layernorm.weight, mlp.gate_up_weight, mlp.down_proj.weight,
                       attn.k_cache, attn.v_cache)
            if any(t is None or t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
                   or (grad and t.requires_grad) for t in tensors):
                return None
            for out, t in zip(lists, tensors):
                out.append(t)
        return lists

    def _stack_snapshot(self) -> "Snapshot":
        """Everything `_build_kernel_stack` reads: each parameter (replaced → another object; written in
        place, also through a view such as q_proj.weight of qkv_weight → another version; `.data =` →
        another storage), the packed weights and their packs, and the caches (setup_cache replaces
        them; their contents change every forward, so identity only)."""
        slots = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for module, names in ((attn, ("qkv_weight", "qkv_bias", "qkv_gemm_pack", "k_cache", "v_cache")),
                                  (mlp, ("gate_up_weight", "gate_up_gemm_pack")),
                                  (attn.o_proj, ("gemm_pack",)), (mlp.down_proj, ("gemm_pack",))):
                slots += [(module.__dict__, name, name not in ("k_cache", "v_cache")) for name in names]
            for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                           mlp.down_proj, layer.input_layernorm, layer.post_attention_layernorm):
                slots += [(module._parameters, name, True) for name in module._parameters]
        slots.append((self.lm_head.__dict__, "gemm_pack", True))  # _kernel_tail's
        for module in (self.model.embed_tokens, self.model.norm, self.lm_head):
            slots += [(module._parameters, name, True) for name in module._parameters]
        return Snapshot(slots)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        slots: Tensor,
        mask: Tensor,
        taps: tuple[int, ...] = (),
        logits: bool = True,
    ) -> tuple[Tensor | None, Tensor | None, Tensor]:
        """Run `q` new tokens per row.

        tokens, positions, slots: [b, q] token ids, rope positions, KV-cache slots to write.
        mask: [b, q, kv_len] bool; True where a query may attend to a cache slot.
        taps: decoder layers whose raw outputs to return (EAGLE/DSpark features), concatenated.
        Returns (logits [b, q, V] or None, taps [b, q, len(taps)*dim] or None, final normed hidden).
        """
        one_call = self._one_call_forward(tokens, positions, slots, mask, taps, logits)
        if one_call is not None:
            return one_call
        a = self.args
        tap_list = sorted(t for t in set(taps) if 0 <= t < a.n_layers)
        x = self.model.embed_tokens(tokens)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        tapped = []
        stack = self._kernel_stack(x, *tokens.shape, mask) if FUSED_LAYERS else None
        if stack is not None and x.dtype == torch.float32:  # fp32, an AVX2 CPU, decode or verify: one call
            x, tapped = cpu_f32.decoder_layers(x, *stack[0], cos, sin, slots, mask, a.norm_eps, a.n_heads,
                                               a.n_kv_heads, a.head_dim, tap_list)
        elif stack is not None:  # bf16 on a CPU whose one-call forward does not apply: every layer in one call
            x, tapped = cpu_kernels.decoder_layers(x, *stack[0], cos, sin, slots, mask, a.norm_eps, a.n_heads,
                                                   a.n_kv_heads, a.head_dim, a.intermediate_size, tap_list)
        else:
            folded_mask = fold_mask(mask, a.n_heads // a.n_kv_heads) if FOLD_GQA_HEADS else None
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin, slots, mask, folded_mask)
                if i in taps:
                    tapped.append(x)
        hidden = self.model.norm(x)
        out = self.lm_head(hidden) if logits else None
        return out, (torch.cat(tapped, dim=-1) if taps else None), hidden


def rope_inv_freq(args: ModelArgs) -> Tensor:
    hd = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    s = args.rope_scaling
    if s:  # llama3 frequency-dependent scaling (Llama 3.1 report / transformers' _compute_llama3_parameters)
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_ctx = s["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    return inv_freq.float()


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    angles = positions[..., None].float() * inv_freq  # [b, q, hd/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype)[:, :, None], angles.sin().to(dtype)[:, :, None]  # [b, q, 1, hd]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # transformers' rotate_half convention (first half / second half), which its checkpoints use.
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def seeded_normal(like: Tensor, std: float, generator: torch.Generator | None) -> Tensor:
    """N(0, std) values of `like`'s shape drawn on the CPU from `generator` (a CPU generator: the
    seeded initialisations then give the same weights whatever device the module lives on),
    moved to `like`'s device and dtype."""
    values = torch.empty(like.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
    return values.to(like.device, like.dtype)
