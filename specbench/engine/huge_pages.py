"""CPU tensors laid out in one mapping backed by 2 MB pages (Linux transparent huge pages).

Why: a decode step streams the target's ~120 packed weight matrices once each, and with 4 KB pages
every 4 KB of that stream is a new page to translate (in a VM a two-level walk), and the hardware
prefetchers stop at each 4 KB boundary. On the 2-core AMD EPYC (interleaved A/B, cold, same process;
docs/performance.md "Session 29") the GEMVs over every pack ran 8% faster at one row and 5% at eight
in 2 MB pages, the whole step 2-5% at b <= 16, and DSpark's drafting round 6-12%. The bits are
unchanged: the kernels read the same values from other addresses.

Where the kernel refuses huge pages (`transparent_hugepage` set to `never`, or not Linux) the copies
still work, in ordinary pages: `huge_page_copies` is then only a copy. `SPECBENCH_HUGE_PAGES=0` leaves
the packs where they were made (A/B runs).
"""
from __future__ import annotations

import math
import mmap
import os

import torch
from torch import Tensor

ENABLED = os.environ.get("SPECBENCH_HUGE_PAGES", "1") != "0"
HUGE_PAGE = 2 << 20
ALIGN = 64  # each copy starts on a cache line, as torch's own allocations do


def huge_page_copies(tensors: list[Tensor]) -> list[Tensor]:
    """Contiguous copies of `tensors` (CPU), laid out one after another in one anonymous mapping
    advised MADV_HUGEPAGE and aligned to 2 MB. Same values, shapes and dtypes; gradients are not tracked."""
    copies = huge_page_empty([(tuple(t.shape), t.dtype) for t in tensors])
    with torch.no_grad():
        for copy, t in zip(copies, tensors):
            copy.copy_(t)
    return copies


def huge_page_zeros(numel: int, dtype: torch.dtype) -> Tensor:
    """A zero-filled 1-D CPU tensor in 2 MB pages (the read-rate probes: a floor measured on 4 KB pages
    would be slower than the packs it is set against)."""
    return huge_page_empty([((numel,), dtype)])[0]


def read_probe(numel: int, device: torch.device) -> Tensor:
    """A float32 buffer of ones for a read-rate probe, in the pages a step's weights use on `device`: 2 MB
    pages on a CPU (unless ENABLED is off), else an ordinary tensor there."""
    if device.type == "cpu" and ENABLED:
        return huge_page_zeros(numel, torch.float32).fill_(1.0)
    return torch.ones(numel, dtype=torch.float32, device=device)


def cache_zeros(layout: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> list[Tensor]:
    """Zero-filled tensors of the given (shape, dtype)s on `device`, for KV caches: on a CPU (unless
    ENABLED is off) in one 2 MB-page mapping (`huge_page_empty`; one mapping, so that small caches do
    not each take a 2 MB page), elsewhere a `torch.zeros` each. Normal tensors, even in inference mode."""
    if torch.device(device).type == "cpu" and ENABLED:
        return huge_page_empty(layout)
    with torch.inference_mode(False):
        return [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in layout]


def huge_page_empty(layout: list[tuple[tuple[int, ...], torch.dtype]]) -> list[Tensor]:
    """Zero-filled contiguous CPU tensors of the given (shape, dtype)s, one after another (each on a
    cache line) in one anonymous mapping, the first on a 2 MB boundary, the mapping advised MADV_HUGEPAGE.
    Each is a tensor of its own (torch.frombuffer on the mapping, which it keeps alive), not a view of a
    common base: autograd then tracks an in-place write into one (a KV cache written by a forward that
    needs gradients) without touching the others. Normal tensors, even when made in inference mode."""
    if not layout:
        return []
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in layout]
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // ALIGN) * ALIGN
    length = -(-end // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # one spare huge page to align the start
    mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with torch.inference_mode(False):
        start = -torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    advise = getattr(mapping, "madvise", None)
    if advise is not None and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            advise(mmap.MADV_HUGEPAGE, start, length - start)  # before the first write, so faults take 2 MB pages
        except OSError:
            pass  # THP off in this kernel: ordinary pages, same values
    out = []
    with torch.inference_mode(False):
        for (shape, dtype), offset, size in zip(layout, offsets, sizes):
            if size == 0:
                out.append(torch.zeros(shape, dtype=dtype))
                continue
            flat = torch.frombuffer(mapping, dtype=torch.uint8, count=size, offset=start + offset)
            out.append(flat.view(dtype).view(shape))
    return out
