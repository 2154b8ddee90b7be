"""What a DSpark drafting round costs against the target's own step, per drafter shape (not a
test: numbers go to docs/performance.md and the drafter cards).

The sizing question (issue: "size each drafter and its draft length for what pays on this CPU")
has two halves: the acceptance a shape buys, which only training answers, and the time it costs
per round, which this script measures without training — a drafter's cost does not depend on its
weights. For each shape (draft layers, block size γ, draft vocabulary, Markov rank) it times one
`draft_block` (context already cached, as in decoding) at the chosen batch sizes, beside the
target's decode step (q = 1) and its verify forward over 1 + γ tokens, and prints the break-even
τ: the tokens a round must emit for drafting plus verifying to beat plain decoding,
τ* = (T_draft + T_verify) / T_step.

Usage (an otherwise idle machine; medians of --reps repetitions; the target's verify is timed once
per (batch, γ) and shared by the shapes with that γ):
  python benchmarks/drafter_cost.py --dtype auto --batches 1,16 --out results/perf/drafter-cost.json
  python benchmarks/drafter_cost.py --shape tiny   # seconds: checks the script itself
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specbench.bench.envinfo import device_name
from specbench.drafters.dspark import DSparkArgs, build_drafter
from specbench.engine.core import forward_new_tokens
from specbench.engine.loading import load_model
from specbench.engine.model import ModelArgs, Transformer

# (draft layers, γ, draft vocabulary, Markov rank)
SHAPES = [(1, 7, 8192, 32), (2, 7, 8192, 32), (3, 7, 8192, 32), (5, 7, 8192, 32),
          (2, 5, 8192, 32), (2, 7, 4096, 32), (2, 7, 16384, 32), (2, 7, 0, 32), (2, 7, 8192, 0)]


def median_ms(fn, reps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def target_ms(model: Transformer, batch: int, q: int, context: int, reps: int) -> float:
    model.setup_cache(batch, context + 64)
    lengths = torch.full((batch,), context, dtype=torch.long)
    tokens = torch.randint(0, model.args.vocab_size, (batch, q))
    return median_ms(lambda: forward_new_tokens(model, tokens, lengths), reps)


@torch.inference_mode()
def draft_ms(drafter, batch: int, context: int, reps: int) -> float:
    drafter.setup_cache(batch, context + 64)
    drafter.append_context(torch.randn(batch, context, len(drafter.args.tap_layers) * drafter.args.model_args.dim,
                                       dtype=drafter.dtype))
    anchors = torch.randint(0, drafter.args.model_args.vocab_size, (batch,))
    return median_ms(lambda: drafter.draft_block(anchors, None, 0.0, with_probs=False), reps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-135m", choices=["smollm2-135m", "tiny"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.shape == "tiny":
        margs = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128,
                          vocab_size=512)
        dtype = torch.float32
        model = Transformer(margs).eval()
        shapes, taps = [(1, 4, 128, 8), (2, 4, 0, 0)], [0, 1, 2]
    else:
        loaded = load_model(args.shape, dtype=args.dtype)
        model, dtype = loaded.model, loaded.model.lm_head.weight.dtype
        shapes, taps = SHAPES, [1, 14, 27]
    rows = []
    for b in batches:
        step = target_ms(model, b, 1, args.context, args.reps)
        verify_by_gamma = {g: target_ms(model, b, 1 + g, args.context, args.reps) for g in sorted({s[1] for s in shapes})}
        for layers, gamma, vocab, rank in shapes:
            dargs = DSparkArgs.for_target(model.args, tap_layers=taps, n_layers=layers, block_size=gamma,
                                          markov_rank=rank, draft_vocab=vocab)
            drafter = build_drafter(dargs, model).eval()
            draft = draft_ms(drafter, b, args.context, args.reps)
            verify = verify_by_gamma[gamma]
            rows.append({"batch": b, "layers": layers, "gamma": gamma, "draft_vocab": vocab or model.args.vocab_size,
                         "markov_rank": rank, "params_m": round(drafter.num_parameters() / 1e6, 2),
                         "draft_ms": round(draft, 3), "verify_ms": round(verify, 3), "step_ms": round(step, 3),
                         "breakeven_tau": round((draft + verify) / step, 3)})
            print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    result = {"device": device_name(torch.device("cpu")), "dtype": str(dtype).replace("torch.", ""),
              "threads": torch.get_num_threads(), "context": args.context, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
