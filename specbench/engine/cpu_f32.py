"""fp32 kernels for decode and verify forwards on a CPU with AVX2 + FMA (cpu_f32.cpp): the GEMV, and
every decoder layer in one call.

On a CPU without bf16 matrix units `--dtype auto` picks float32, and there torch's GEMM read the
weights at 8-9 GB/s for 2 to 8 rows against 14 GB/s for one row (2-core AVX2 AMD EPYC), so a verify
over 8 tokens cost 1.9x a decode step and speculative decoding could not pay (docs/performance.md
"Session 18"). This kernel reads each weight row once per call and gives every row the same bits
whatever the number of rows beside it, so a verify forward's projections compute each row as the
AR step it replaces. Its bits are not F.linear's.

Around the GEMV an fp32 step was still ~300 small torch calls (norms, rope, cache writes, SDPA, silu,
adds: ~14 of 36 ms on that EPYC, docs/performance.md "Session 19"); `decoder_layers` runs them all in
one call, with attention of its own whose bits, like the GEMV's, are a row's own (SDPA's rounding may
depend on the number of queries).

Built once per machine, torch and kernel source with torch's C++ extension loader, like the bf16 kernels; used for
float32 projections on a CPU with AVX2 + FMA, no gradient needed, in forwards of at most
`cpu_kernels.MAX_ATTEND_TOKENS` new tokens a row (decode and verify; prefill keeps F.linear), or of
at most MAX_FLAT_ROWS rows of a flat [rows, k] input. `SPECBENCH_CPU_KERNELS=0` turns it off too.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import Tensor

from specbench.engine import cpu_kernels

SOURCE = Path(__file__).with_name("cpu_f32.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"]
# A flat [rows, k] input (no token axis) takes the kernel up to this many rows: drafters' small
# projections; larger flat inputs are GEMMs torch does well.
MAX_FLAT_ROWS = 8


def cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma"} <= cpu_kernels.cpu_flags()


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True once the kernel is built and loaded; False (with one line on stderr) where it can't be."""
    return cpu_has_avx2_fma() and cpu_kernels.build("specbench_cpu_f32", SOURCE, FLAGS, "the fp32 CPU kernels")


def applies(x: Tensor, weight: Tensor) -> bool:
    """Whether the GEMV computes x · weightᵀ here: both float32 on a CPU, no gradient needed, a
    contiguous weight, and a decode / verify forward (≤ MAX_ATTEND_TOKENS tokens a row) or a flat
    input of ≤ MAX_FLAT_ROWS rows."""
    if not cpu_kernels.ENABLED or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if x.device.type != "cpu" or weight.device.type != "cpu" or weight.dim() != 2 or not weight.is_contiguous():
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    tokens = cpu_kernels.tokens_per_row(x)
    if tokens is None:
        if x.dim() != 2 or x.shape[0] > MAX_FLAT_ROWS:
            return False
    elif tokens > cpu_kernels.MAX_ATTEND_TOKENS:
        return False
    return available()


def gemv(x: Tensor, weight: Tensor) -> Tensor:
    """x · weightᵀ over x's last axis (any leading shape)."""
    rows = x.reshape(-1, x.shape[-1])
    return torch.ops.specbench_cpu_f32.gemv_f32(rows, weight).view(*x.shape[:-1], weight.shape[0])


def decoder_layers_apply(args, x: Tensor, mask: Tensor) -> bool:
    """Whether `decoder_layers` takes a forward of x [b, q, dim] through layers of shape `args` (a
    model.ModelArgs): float32 on a CPU with AVX2 + FMA, no gradient needed, a decode or verify forward
    (q ≤ MAX_ATTEND_TOKENS, as the GEMV), a bool mask, head size 64 or 128, widths multiples of 8, no
    bias or q/k norm (the kernel has neither). Weights, caches and their freshness are the caller's."""
    if (args.attention_bias or args.qk_norm or args.head_dim not in (64, 128) or args.n_heads % args.n_kv_heads
            or args.dim % 8 or args.intermediate_size % 8 or mask.dtype != torch.bool):
        return False
    if not cpu_kernels.ENABLED or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 3:
        return False
    if x.shape[1] > cpu_kernels.MAX_ATTEND_TOKENS or (torch.is_grad_enabled() and x.requires_grad):
        return False
    return available()


def decoder_layers(x: Tensor, input_norms, qkv, o, post_norms, gate_up, down, k_caches, v_caches, cos: Tensor,
                   sin: Tensor, slots: Tensor, mask: Tensor, eps: float, n_heads: int, n_kv_heads: int, head_dim: int,
                   taps: list[int]) -> tuple[Tensor, list[Tensor]]:
    """Every decoder layer of a decode or verify forward in one call (cpu_f32.cpp: decoder_layers_f32):
    model.DecoderLayer.forward's computation, each row (token) with bits of its own, so a verify forward
    gives every token the bits of the AR step it replaces. Lists hold one tensor per layer (norm weights,
    the packed q|k|v, o, gate|up and down weights, the caches). Returns the last layer's output and the
    outputs of the layers in `taps` (sorted)."""
    return torch.ops.specbench_cpu_f32.decoder_layers_f32(x, input_norms, qkv, o, post_norms, gate_up, down, k_caches,
                                                          v_caches, cos, sin, slots, mask, eps, n_heads, n_kv_heads,
                                                          head_dim, taps)


def attend(xq: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor) -> Tensor:
    """decoder_layers' attention alone (tests): xq [b, nh, q, hd], caches [B >= b, nkv, S, hd], mask
    [b, q, kv_len] bool → [b, q, nh·hd]."""
    return torch.ops.specbench_cpu_f32.attend_f32(xq, k_cache, v_cache, mask)
