"""Cost profile of the target on this device: the wall time of one target forward as a function
of the batch size b and the tokens verified per row q (total verify tokens B = b·q), at a fixed
context length. Policies (DSpark's scheduler) and the simulator read the stored profile; the
performance doc quotes it.

Timing: the median over `iters` forwards after `warmup` untimed ones, each bracketed by a device
synchronize (CUDA work is asynchronous; reading the clock without it times the launch, not the work).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from specbench.core import forward_new_tokens, round_up, synchronize, KV_BUCKET
from specbench.model import Transformer


@torch.inference_mode()
def time_forward(model: Transformer, batch: int, q: int, context: int, iters: int = 10, warmup: int = 2) -> list[float]:
    """Seconds per forward of q new tokens per row for `batch` rows that each hold `context` cached tokens."""
    device = model.device
    model.setup_cache(batch, round_up(context + q + 1, KV_BUCKET))
    tokens = torch.randint(0, model.args.vocab_size, (batch, q), device=device)
    cache_lengths = torch.full((batch,), context, dtype=torch.long, device=device)
    times = []
    for i in range(warmup + iters):
        synchronize(device)
        start = time.perf_counter()
        forward_new_tokens(model, tokens, cache_lengths)
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def profile(model: Transformer, batches: list[int], qs: list[int], context: int, iters: int = 10, progress=None) -> dict:
    entries = []
    for b in batches:
        for q in qs:
            times = time_forward(model, b, q, context, iters=iters)
            entries.append({
                "batch": b, "q": q, "verify_tokens": b * q,
                "median_ms": 1e3 * statistics.median(times),
                "p10_ms": 1e3 * sorted(times)[len(times) // 10],
                "p90_ms": 1e3 * sorted(times)[(9 * len(times)) // 10],
                "n": len(times),
            })
            if progress is not None:
                progress.update(1)
    return {"context": context, "entries": entries}


def steps_per_second(profile_data: dict, batch: int) -> dict[int, float]:
    """SPS(B) for a batch of `batch` rows: B = total verify tokens → forwards per second, linearly
    interpolated between measured q values (DSpark Alg. 1 reads this table)."""
    rows = sorted((e["verify_tokens"], e["median_ms"]) for e in profile_data["entries"] if e["batch"] == batch)
    if not rows:
        raise ValueError(f"the profile has no entries for batch size {batch}")
    table = {}
    for total in range(batch, rows[-1][0] + 1):
        lower = max((r for r in rows if r[0] <= total), default=rows[0])
        upper = min((r for r in rows if r[0] >= total), default=rows[-1])
        if upper[0] == lower[0]:
            ms = lower[1]
        else:
            ms = lower[1] + (upper[1] - lower[1]) * (total - lower[0]) / (upper[0] - lower[0])
        table[total] = 1e3 / ms
    return table


def save(profile_data: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(profile_data, indent=1))
    tmp.replace(path)
