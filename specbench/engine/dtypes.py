"""The model dtype: `--dtype {auto,float32,bfloat16,float16}` for every command that loads a model.

Target and drafters run in one dtype, and so does the KV cache; sampling and verification never
do: logits are upcast and every probability, acceptance test and residual is fp32
(specbench/engine/sampling.py, specbench/engine/verify.py), so speculative decoding stays exact with respect to
the target's own (low-precision) forward.

`auto`: bf16 on CUDA. On a CPU it depends on the chip, so it is measured, not assumed: on an Intel
Xeon with AMX, bf16 makes verifying 8 tokens cost 0.95x a decode step against 1.83x in fp32
(docs/hardware.md §3, measured 2026-12-01); a CPU without bf16 matrix units emulates bf16 GEMMs and loses.
The first `auto` load of a target on a CPU times its decode step (q = 1) and verify step (q = 8)
at b = 1 in both dtypes and keeps the faster; the decision is cached per (target fingerprint,
CPU name and threads, torch version) under `<cache>/profiles/cpu-dtype.json`, so later loads
decide in no time.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from specbench.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHOICES = ("auto", *DTYPES)
AUTO_CPU_CANDIDATES = (torch.float32, torch.bfloat16)
AUTO_CONTEXT = 256  # cached tokens per row while timing: the cost profile's context
AUTO_QS = (1, 8)  # decode step and verify step; their sum is the score (both matter to a policy)


def dtype_name(dtype: torch.dtype | str) -> str:
    """`torch.bfloat16` / "torch.bfloat16" / "bfloat16" → "bfloat16" (the name records carry)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype | str:
    """A `--dtype` value → a torch dtype, or the string "auto" (decided once the model is loaded)."""
    if name == "auto":
        return "auto"
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r} (choose from {', '.join(CHOICES)})")
    return DTYPES[name]


def check_device_dtype(dtype: torch.dtype | str, device: torch.device | str) -> None:
    """float16 on a CPU is emulated (slow, and with fp16's range); refuse it with one line."""
    if torch.device(device).type == "cpu" and dtype == torch.float16:
        raise UserError("--dtype float16 is not supported on CPU (use bfloat16, float32 or auto)")


def auto_without_measuring(dtype: torch.dtype | str, device: torch.device | str) -> torch.dtype | str:
    """`dtype`, with "auto" resolved where no measurement is needed (CUDA: bf16, else fp16; other
    non-CPU devices: fp32); "auto" stays on a CPU (auto_dtype measures the loaded model)."""
    if dtype != "auto":
        return dtype
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return "auto" if kind == "cpu" else torch.float32


def cast_model(model, dtype: torch.dtype):
    """Our Transformer in `dtype`, in place; the rope frequencies stay fp32 (a bf16 inverse
    frequency times a position in the thousands is a wrong angle)."""
    from specbench.engine.model import rope_inv_freq

    if model.lm_head.weight.dtype != dtype:
        model.to(dtype)
        model.inv_freq = rope_inv_freq(model.args).to(model.device)
        if model.max_batch:  # a cache set up before the cast: reallocate it in the new dtype
            batch, seq = model.max_batch, model.max_seq
            model.max_batch = model.max_seq = 0
            model.setup_cache(batch, seq)
    return model


def auto_dtype(loaded, cache_dir: Path) -> tuple[torch.dtype, dict]:
    """The dtype `auto` picks for `loaded` (a loading.LoadedModel, still in fp32) on its device,
    and the measurement it was decided from ({} on CUDA, where bf16 is the rule)."""
    device = loaded.model.device
    if device.type != "cpu":
        return auto_without_measuring("auto", device), {}
    from specbench.engine.timing import device_name

    key = f"{loaded.fingerprint}|{device_name(device)}|torch {torch.__version__}"
    path = Path(cache_dir) / "profiles" / "cpu-dtype.json"
    known = _read_json(path)
    if key not in known:
        known[key] = measure_cpu_dtypes(loaded.model)
        _write_json(path, {**_read_json(path), key: known[key]})
    decision = known[key]
    return DTYPES[decision["chosen"]], decision


def measure_cpu_dtypes(model, iters: int = 8) -> dict:
    """Time the decode step (q = 1) and the verify step (q = 8) at b = 1 in each candidate dtype,
    interleaved (so drift on a shared machine hits both alike), minimum over `iters`; the dtype
    with the smallest sum wins. `model` is left in fp32."""
    from specbench.engine.timing import time_forward

    models = {dtype_name(d): (model if d == model.lm_head.weight.dtype else _copy_in(model, d))
              for d in AUTO_CPU_CANDIDATES}
    best: dict[str, dict[int, float]] = {name: {} for name in models}
    for _ in range(iters):
        for name, m in models.items():
            for q in AUTO_QS:
                (t,) = time_forward(m, 1, q, AUTO_CONTEXT, iters=1, warmup=1)
                best[name][q] = min(best[name].get(q, float("inf")), t)
    score = {name: sum(times.values()) for name, times in best.items()}
    chosen = min(score, key=score.get)
    return {
        "chosen": chosen,
        "step_ms": {name: {f"q{q}": round(1e3 * t, 3) for q, t in times.items()} for name, times in best.items()},
        "rule": f"min over {iters} interleaved tries of T(q=1) + T(q=8), b = 1, context {AUTO_CONTEXT}",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _copy_in(model, dtype: torch.dtype):
    import copy

    clone = copy.deepcopy(model)
    clone.max_batch = clone.max_seq = 0  # its own cache, in its own dtype
    clone.pack_weights()  # a copy holds plain tensors: neither the q/k/v views nor the GEMM packs
    return cast_model(clone, dtype)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{id(data)}")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
