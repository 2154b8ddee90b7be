"""The fp32 GEMV (specbench/engine/cpu_f32.py) on and off, whole target steps interleaved in one
process (not a test: numbers go to docs/performance.md). The real target in float32, b = 1,
context 256: for each pass and each side, one forward (`forward_new_tokens` + `greedy_ids`) at every
q, then the paired ratio per pass. The machine's speed drifts within seconds on shared CPUs, so the
two sides alternate call by call and the summary is the median of per-pass ratios.

    python benchmarks/f32_gemv_ab.py [--passes 40] [--qs 1,2,4,8] [--batch 1]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specbench.engine import cpu_f32, cpu_kernels  # noqa: E402
from specbench.engine.core import forward_new_tokens  # noqa: E402
from specbench.engine.loading import load_model  # noqa: E402
from specbench.engine.sampling import greedy_ids  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--passes", type=int, default=40)
parser.add_argument("--qs", default="1,2,4,8")
parser.add_argument("--batch", type=int, default=1)
args = parser.parse_args()
qs = [int(q) for q in args.qs.split(",")]
if not cpu_f32.available():
    sys.exit("f32_gemv_ab: the fp32 GEMV is not available on this machine (AVX2 + FMA and g++ needed)")
target = load_model("smollm2-135m", dtype=torch.float32)
b = args.batch


def step(q: int):
    tokens, lengths = torch.randint(0, target.model.args.vocab_size, (b, q)), torch.full((b,), 256)
    return lambda: greedy_ids(forward_new_tokens(target.model, tokens, lengths)[0])


def timed(f) -> float:
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1e3


times = {(side, q): [] for side in ("on", "off") for q in qs}
with torch.inference_mode():
    target.model.setup_cache(b, 512)
    steps = {q: step(q) for q in qs}
    for side in ("on", "off"):  # warm-up
        cpu_kernels.ENABLED = side == "on"
        for q in qs:
            steps[q]()
    for _ in range(args.passes):
        for side in ("on", "off"):
            cpu_kernels.ENABLED = side == "on"
            for q in qs:
                times[(side, q)].append(timed(steps[q]))
    cpu_kernels.ENABLED = True
print(f"fp32, b = {b}, context 256, {args.passes} interleaved passes, {torch.get_num_threads()} threads")
print("q  | GEMV on: median ms | off (F.linear) | on/off per pass, median [quartiles] | T(q)/T(1) on | off")
for q in qs:
    on, off = times[("on", q)], times[("off", q)]
    ratios = sorted(a / c for a, c in zip(on, off))
    quart = statistics.quantiles(ratios, n=4)
    r_on = statistics.median(a / c for a, c in zip(on, times[("on", qs[0])]))
    r_off = statistics.median(a / c for a, c in zip(off, times[("off", qs[0])]))
    print(f"{q:<2} | {statistics.median(on):8.2f} | {statistics.median(off):8.2f} | "
          f"{statistics.median(ratios):.3f} [{quart[0]:.3f}, {quart[2]:.3f}] | {r_on:.2f} | {r_off:.2f}")
