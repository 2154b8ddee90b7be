"""fp32 GEMV for decode and verify forwards on a CPU with AVX2 + FMA (cpu_f32.cpp).

On a CPU without bf16 matrix units `--dtype auto` picks float32, and there torch's GEMM read the
weights at 8-9 GB/s for 2 to 8 rows against 14 GB/s for one row (2-core AVX2 AMD EPYC), so a verify
over 8 tokens cost 1.9x a decode step and speculative decoding could not pay (docs/performance.md
"Session 18"). This kernel reads each weight row once per call and gives every row the same bits
whatever the number of rows beside it, so a verify forward's projections compute each row as the
AR step it replaces (fp32 attention still runs on torch's SDPA, whose rounding may depend on the
number of queries; the bf16 kernels, cpu_kernels.py, cover attention too). Its bits are not F.linear's.

Built once per machine and torch with torch's C++ extension loader, like the bf16 kernels; used for
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
    return cpu_has_avx2_fma() and cpu_kernels.build("specbench_cpu_f32", SOURCE, FLAGS, "the fp32 CPU GEMV")


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
