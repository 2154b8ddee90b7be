"""The suite's bf16 GEMV kernel (specbench/engine/gemv.py) against torch's routes, on the target's
own projection shapes and on whole target forwards (not a test: numbers go to docs/performance.md).

Three measurements, each interleaving kernel-on and kernel-off in one process so that both see the
same machine state:

1. Per projection shape and row count: the kernel against torch's route for it (`torch.mv` for one
   row, oneDNN's pre-packed GEMM for more), over enough distinct weight copies (≥ 400 MB) that no
   weight is in a cache when it is read, as in a decode step. Streaming rate in GB/s.
2. Whole forwards of the real target in bf16 (context 256 cached tokens), b × q grid: min over
   `--repeats` interleaved repeats of the mean of `--iters` forwards, with the memory floor
   (weights + cached K/V over the rate of a 1 GiB sum measured in the same run).
3. Shape invariance: the logits of a q = 8 forward against the same 8 tokens fed one at a time
   (the AR steps that verify replaces), bit for bit, with the kernel on and off.

Usage (an otherwise idle machine):
  python benchmarks/gemv_ab.py --out results/perf/cpu-smollm2-135m-gemv-ab.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from specbench.atomic import write_json
from specbench.bench.envinfo import device_name
from specbench.engine import cpu_kernels
from specbench.engine.core import forward_new_tokens
from specbench.engine.loading import load_model
from specbench.engine.model import Transformer, fresh_pack


def stream_rate_gb_s() -> float:
    big = torch.ones(2 ** 28, dtype=torch.float32)  # 1 GiB
    best = min(_timed(lambda: big.sum()) for _ in range(5))
    return big.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def projection_shapes(model: Transformer) -> list[tuple[str, int, int]]:
    a, m = model.model.layers[0].self_attn, model.model.layers[0].mlp
    return [("qkv", *a.qkv_weight.shape), ("o_proj", *a.o_proj.weight.shape),
            ("gate/up", *m.gate_proj.weight.shape), ("down", *m.down_proj.weight.shape),
            ("lm_head", *model.lm_head.weight.shape)]


@torch.inference_mode()
def per_shape(model: Transformer, rows: list[int], repeats: int) -> list[dict]:
    out = []
    for name, n, k in projection_shapes(model):
        copies = max(2, int(400e6 // (n * k * 2)))
        weights = [torch.randn(n, k).to(torch.bfloat16) for _ in range(copies)]
        packs = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
        kernel_packs = [cpu_kernels.pack(w) for w in weights]
        for m in rows:
            x = torch.randn(m, k).to(torch.bfloat16)
            alone = torch.cat([cpu_kernels.gemv(x[i:i + 1], kernel_packs[0], n) for i in range(m)])

            def kernel():
                for p in kernel_packs:
                    cpu_kernels.gemv(x, p, n)

            def torch_route():
                for w, p in zip(weights, packs):
                    if m == 1:
                        torch.mv(w, x[0])
                    else:
                        torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            kernel(), torch_route()
            tk = tt = float("inf")
            for _ in range(repeats):
                tk, tt = min(tk, _timed(kernel) / copies), min(tt, _timed(torch_route) / copies)
            row = {"projection": name, "n": n, "k": k, "rows": m, "kernel_us": round(tk * 1e6, 1),
                   "torch_us": round(tt * 1e6, 1), "kernel_gb_s": round(n * k * 2 / tk / 1e9, 1),
                   "torch_gb_s": round(n * k * 2 / tt / 1e9, 1),
                   "rows_alone_identical": bool(torch.equal(cpu_kernels.gemv(x, kernel_packs[0], n), alone))}
            print(f"{name:8s} {n:6d}x{k:<5d} rows {m:2d}: kernel {row['kernel_us']:8.1f} us "
                  f"({row['kernel_gb_s']:5.1f} GB/s)  torch {row['torch_us']:8.1f} us ({row['torch_gb_s']:5.1f} GB/s)",
                  flush=True)
            out.append(row)
    return out


@torch.inference_mode()
def forwards(model: Transformer, grid: list[tuple[int, int]], context: int, iters: int, repeats: int,
             rate: float) -> list[dict]:
    out = []
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = 2 * model.args.n_layers * model.args.n_kv_heads * model.args.head_dim * 2
    for b, q in grid:
        model.setup_cache(b, context + 64)
        lengths = torch.full((b,), context, dtype=torch.long)
        tokens = torch.randint(0, model.args.vocab_size, (b, q))
        best = {True: float("inf"), False: float("inf")}
        for _ in range(repeats):
            for on in (True, False):
                cpu_kernels.ENABLED = on
                forward_new_tokens(model, tokens, lengths)
                t0 = time.perf_counter()
                for _ in range(iters):
                    forward_new_tokens(model, tokens, lengths)
                best[on] = min(best[on], (time.perf_counter() - t0) / iters)
        cpu_kernels.ENABLED = True
        floor = (weight_bytes + b * context * kv_per_token) / (rate * 1e9)
        row = {"b": b, "q": q, "kernel_ms": round(best[True] * 1e3, 2), "torch_ms": round(best[False] * 1e3, 2),
               "floor_ms": round(floor * 1e3, 2), "kernel_floor_fraction": round(floor / best[True], 3),
               "torch_floor_fraction": round(floor / best[False], 3)}
        print(f"forward b={b:2d} q={q}: kernel {row['kernel_ms']:7.2f} ms  torch {row['torch_ms']:7.2f} ms  "
              f"floor {row['floor_ms']:6.2f} ms", flush=True)
        out.append(row)
    return out


@torch.inference_mode()
def shape_invariance(model: Transformer, context: int) -> dict:
    """Bitwise: logits of 8 tokens in one forward vs the same tokens one forward each."""
    torch.manual_seed(0)
    prefix = torch.randint(0, model.args.vocab_size, (1, context))
    new = torch.randint(0, model.args.vocab_size, (1, 8))
    out = {}
    for on in (True, False):
        cpu_kernels.ENABLED = on
        model.setup_cache(1, context + 64)
        forward_new_tokens(model, prefix, torch.zeros(1, dtype=torch.long))
        together = forward_new_tokens(model, new, torch.full((1,), context, dtype=torch.long))[0]
        model.setup_cache(1, context + 64)
        forward_new_tokens(model, prefix, torch.zeros(1, dtype=torch.long))
        one_by_one = torch.cat([forward_new_tokens(model, new[:, i:i + 1], torch.full((1,), context + i,
                                                                                          dtype=torch.long))[0]
                                for i in range(8)], dim=1)
        out["kernel" if on else "torch"] = {
            "identical": bool(torch.equal(together, one_by_one)),
            "max_abs_diff": float((together.float() - one_by_one.float()).abs().max()),
            "same_argmax": int((together.argmax(-1) == one_by_one.argmax(-1)).sum())}
    cpu_kernels.ENABLED = True
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", default="1x1,1x8,8x1,8x8,16x1")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not cpu_kernels.available():
        print("gemv_ab: the kernel is not available on this machine (see the line above)", file=sys.stderr)
        return 1
    model = load_model("smollm2-135m", dtype=torch.bfloat16).model
    assert fresh_pack(model.lm_head.weight, model.lm_head.gemm_pack) is not None, "expected oneDNN packs"
    rate = stream_rate_gb_s()
    print(f"{device_name('cpu')}, {torch.get_num_threads()} threads, 1 GiB sum at {rate:.1f} GB/s", flush=True)
    result = {"cpu": device_name("cpu"), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "dtype": "bfloat16", "context": args.context, "sum_gb_s": round(rate, 1),
              "max_rows": cpu_kernels.max_rows(), "amx": bool(cpu_kernels.max_rows() == cpu_kernels.MAX_ROWS_AMX),
              "rule": f"min over {args.repeats} interleaved repeats; forwards: mean of {args.iters}",
              "projections": per_shape(model, [int(r) for r in args.rows.split(",")], args.repeats),
              "forwards": forwards(model, [tuple(int(v) for v in c.split("x")) for c in args.grid.split(",")],
                                   args.context, args.iters, args.repeats, rate),
              "shape_invariance_q8_vs_q1": shape_invariance(model, args.context)}
    print(json.dumps(result["shape_invariance_q8_vs_q1"]))
    if args.out:  # whole file or nothing
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
