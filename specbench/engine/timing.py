"""Timing one target forward, and naming the device a timing was taken on (shared by the cost
profile, the dtype choice and the step benchmark)."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from specbench.engine.core import forward_new_tokens, synchronize
from specbench.engine.model import Transformer, round_to_bucket


@torch.inference_mode()
def time_forward(model: Transformer, batch: int, q: int, context: int, iters: int = 10, warmup: int = 2) -> list[float]:
    """Seconds per forward of q new tokens per row for `batch` rows that each hold `context` cached tokens."""
    device = model.device
    model.setup_cache(batch, round_to_bucket(context + q + 1))
    tokens = torch.randint(0, model.args.vocab_size, (batch, q), device=device)
    cache_lengths = torch.full((batch,), context, dtype=torch.long, device=device)
    times = []
    pinned = getattr(model, "kernel_stack_pinned", None)  # as core.generate decodes
    with pinned() if pinned is not None else contextlib.nullcontext():
        for i in range(warmup + iters):
            synchronize(device)
            start = time.perf_counter()
            forward_new_tokens(model, tokens, cache_lengths)
            synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    return times


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" x{torch.get_num_threads()} threads"
    except OSError:
        pass
    import platform

    return (platform.processor() or platform.machine()) + f" x{torch.get_num_threads()} threads"
