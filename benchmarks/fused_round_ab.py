"""DSpark's one-call drafting round (dspark.FUSED_ROUND) measured where it counts: in decoding. The first N
requests of a workload, each decoded at b = 1 (greedy, the workload's token budget, bf16) by `ar`, by `dspark`
and by `dspark` with FUSED_ROUND off, one request after the other in alternating order, so that the machine's
read-rate phases (docs/performance.md "Session 13") hit the three alike. Prints per-token and per-round medians,
dspark's paired speedup over ar, and the paired per-round difference with a bootstrap 95% CI.

    python benchmarks/fused_round_ab.py --workload code --limit 24 --repeats 2    # idle machine; docs "Session 14"
"""
import argparse
import dataclasses
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's specbench
from specbench.bench.runner import make_engine, run_cell
from specbench.bench.workloads import load_workload
from specbench.drafters import dspark
from specbench.engine.loading import load_model

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--workload", default="code")
parser.add_argument("--limit", type=int, default=24)
parser.add_argument("--repeats", type=int, default=2)
args = parser.parse_args()

target = load_model("smollm2-135m", dtype=torch.bfloat16)
workload = load_workload(args.workload, limit=args.limit)
ar, ds = make_engine("ar", target), make_engine("dspark", target)
arms = {"ar": (ar, True), "one call": (ds, True), "two calls": (ds, False)}
for engine, fused in arms.values():  # one untimed request each: packs, profile and caches built outside the timings
    dspark.FUSED_ROUND = fused
    next(iter(run_cell(target, engine, dataclasses.replace(workload, requests=workload.requests[:1]), 1, warmup=False)))
per_token = {k: [] for k in arms}
per_round = {k: [] for k in arms}
for repeat in range(args.repeats):
    for i, request in enumerate(workload.requests):
        one = dataclasses.replace(workload, requests=[request])
        for name in (list(arms) if (i + repeat) % 2 == 0 else list(reversed(arms))):
            engine, fused = arms[name]
            dspark.FUSED_ROUND = fused
            rec = next(iter(run_cell(target, engine, one, 1, warmup=False)))
            per_token[name].append(1e3 * rec["decode_s"] / (rec["generated_tokens"] - 1))
            per_round[name].append(1e3 * rec["decode_s"] / rec["rounds"])
dspark.FUSED_ROUND = True

n = len(per_token["ar"])
for name in arms:
    print(f"{name:9s}: {statistics.median(per_token[name]):.2f} ms a token, {statistics.median(per_round[name]):.2f} ms a round")
for name in ("one call", "two calls"):
    ratios = [a / b for a, b in zip(per_token["ar"], per_token[name])]
    print(f"dspark ({name}) vs ar: median {statistics.median(ratios):.3f}, mean {statistics.mean(ratios):.3f}, n = {n}")
diff = [a - b for a, b in zip(per_round["two calls"], per_round["one call"])]
boot = sorted(statistics.mean(random.Random(i).choices(diff, k=n)) for i in range(2000))
print(f"round, two calls - one call: mean {statistics.mean(diff):.3f} ms [{boot[50]:.3f}, {boot[1949]:.3f}], "
      f"median {statistics.median(diff):.3f} ms, n = {n}")
