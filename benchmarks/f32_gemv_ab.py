"""The fp32 GEMV (specbench/engine/cpu_f32.py) on and off, whole target steps interleaved in one
process (not a test: numbers go to docs/performance.md). The real target in float32, b = 1,
context 256: for each pass and each side, one forward (`forward_new_tokens` + `greedy_ids`) at every
q, then the paired ratio per pass. The machine's speed drifts within seconds on shared CPUs, so the
two sides alternate call by call and the summary is the median of per-pass ratios.

    python benchmarks/f32_gemv_ab.py [--passes 40] [--qs 1,2,4,8] [--batch 1] [--against OLD.cpp]

--against: the other side is not F.linear but another version of the kernel's source, built here
under another name, e.g. `git show 86b879a:specbench/engine/cpu_f32.cpp > /tmp/old.cpp` (session 18's
blocked kernel against session 19's one-pass one).
--layers: "on" runs every decoder layer in one call (cpu_f32.decoder_layers), "off" the per-module
path (torch's ops around the GEMV), the GEMV on both sides.
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
from specbench.engine import model as model_module  # noqa: E402
from specbench.engine.loading import load_model  # noqa: E402
from specbench.engine.sampling import greedy_ids  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--passes", type=int, default=40)
parser.add_argument("--qs", default="1,2,4,8")
parser.add_argument("--batch", type=int, default=1)
parser.add_argument("--against", help="a previous cpu_f32.cpp to compare with, instead of F.linear")
parser.add_argument("--layers", action="store_true",
                    help="compare the one-call layers with the per-module path instead (the GEMV on both sides)")
args = parser.parse_args()
if args.layers and args.against:
    sys.exit("f32_gemv_ab: --layers or --against, not both")
qs = [int(q) for q in args.qs.split(",")]
if not cpu_f32.available():
    sys.exit("f32_gemv_ab: the fp32 GEMV is not available on this machine (AVX2 + FMA and g++ needed)")
target = load_model("smollm2-135m", dtype=torch.float32)
current_op = torch.ops.specbench_cpu_f32.gemv_f32
other_op = None
if args.against:
    source = Path("/tmp/specbench_gemv_against.cpp")
    source.write_text(Path(args.against).read_text().replace("specbench_cpu_f32", "specbench_gemv_against"))
    if not cpu_kernels.build("specbench_gemv_against", source, cpu_f32.FLAGS, "the kernel compared with"):
        sys.exit("f32_gemv_ab: could not build --against")
    other_op = torch.ops.specbench_gemv_against.gemv_f32


def use(side: str) -> None:
    """on: this checkout's kernel; off: F.linear, or the --against kernel in the kernel's place (or,
    --layers: the one-call layers on / off)."""
    if args.layers:
        model_module.FUSED_LAYERS = side == "on"
    elif other_op is None:
        cpu_kernels.ENABLED = side == "on"
    else:
        torch.ops.specbench_cpu_f32.gemv_f32 = current_op if side == "on" else other_op
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
        use(side)
        for q in qs:
            steps[q]()
    for _ in range(args.passes):
        for side in ("on", "off"):
            use(side)
            for q in qs:
                times[(side, q)].append(timed(steps[q]))
    use("on")
print(f"fp32, b = {b}, context 256, {args.passes} interleaved passes, {torch.get_num_threads()} threads")
off_name = "per-module layers" if args.layers else "F.linear" if other_op is None else args.against
print(f"q  | {'one-call layers' if args.layers else 'GEMV'} on: median ms | off ({off_name}) | "
      "on/off per pass, median [quartiles] | T(q)/T(1) on | off")
for q in qs:
    on, off = times[("on", q)], times[("off", q)]
    ratios = sorted(a / c for a, c in zip(on, off))
    quart = statistics.quantiles(ratios, n=4)
    r_on = statistics.median(a / c for a, c in zip(on, times[("on", qs[0])]))
    r_off = statistics.median(a / c for a, c in zip(off, times[("off", qs[0])]))
    print(f"{q:<2} | {statistics.median(on):8.2f} | {statistics.median(off):8.2f} | "
          f"{statistics.median(ratios):.3f} [{quart[0]:.3f}, {quart[2]:.3f}] | {r_on:.2f} | {r_off:.2f}")
