"""The prepared GPU check (issue #15 item 4): one script for a lent H200, tried first on a CPU at
toy size (`--toy`). Writes everything under --out (on the device machine: $OUT).

  1. identity   greedy identity of every policy the core runs, with CUDA graphs on (the path `run`
                and `sweep` take on CUDA): ar, pld, fixed-k (the target drafting for itself, and a
                4-layer truncation), eagle (tree and chain), dspark (Algorithm 1) and dflash, at
                b = 1 and b = 8, each against AR's own output in the same mode; plus AR eager vs AR
                graphed. Random weights of the default target's shape (SmolLM2-135M) in bf16, with
                a sharpened output layer (argmax near-ties would make any two kernels disagree),
                randomly initialised drafters: no checkpoint or GGUF has to travel.
  2. step_bench benchmarks/step_bench.py --shape llama-8b (b = 1 and 256, q = 1, 2, 8, context
                1024, bf16, graphs, transformers.generate at b = 1 for the "x HF" ratio), and the top
                ops of one eager forward by device time (--op-profile: where the step loses the
                bandwidth; the first H200 run, session 19, reached 51.6% of the floor at b = 1).
  3. profile    the cost profile of the llama-8b shape (random weights) with engine costs,
                as `specbench profile` writes it, then `specbench simulate` on the committed CPU
                load sweep's traces (results/sweeps/load-cpu) against it.

Usage (device machine):  python benchmarks/gpu_check.py --out "$OUT"
Dry run (CPU, seconds):  python benchmarks/gpu_check.py --toy --out results/gpu_check/cpu-dry-run
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from step_bench import random_model  # noqa: E402

from specbench.engine.core import SamplingConfig, generate  # noqa: E402
from specbench.engine.cuda_graphs import enable_cuda_graphs  # noqa: E402
from specbench.engine.dtypes import dtype_name  # noqa: E402
from specbench.engine.policy import Policy  # noqa: E402


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prompts_for(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """Random prompts, every other one with a repeated span (so prompt lookup finds n-grams)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(0, vocab, (int(torch.randint(8, 40, (1,), generator=g)),), generator=g).tolist()
        out.append(p * 3 if i % 2 else p)
    return out


def build_policies(model, toy: bool) -> dict:
    from specbench.drafters.dspark import DSparkArgs, build_drafter
    from specbench.drafters.eagle import EagleArgs, build_head
    from specbench.engine.model import ModelArgs, Transformer, rope_inv_freq
    from specbench.policies.dspark import DSpark
    from specbench.policies.eagle import Eagle
    from specbench.policies.fixed_k import FixedK
    from specbench.policies.pld import PromptLookup

    a = model.args
    taps = [1, a.n_layers // 2, a.n_layers - 2] if a.n_layers >= 4 else [0, 1]
    generator = torch.Generator(device="cpu").manual_seed(0)

    def fp32_rope(m):
        m.inv_freq = rope_inv_freq(getattr(m.args, "model_args", m.args)).to(model.device)
        return m.eval().requires_grad_(False)

    head = build_head(EagleArgs.for_target(a, taps), model, dtype=torch.float32)
    head.init_weights(generator, std=0.05)
    head = fp32_rope(head.to(model.lm_head.weight.dtype))
    drafters = {}
    for variant in ("dspark", "dflash"):
        args = DSparkArgs.for_target(a, tap_layers=taps, variant=variant, n_layers=1, block_size=4,
                                     markov_rank=8 if variant == "dspark" else 0)
        d = build_drafter(args, model, dtype=torch.float32)
        d.init_weights(generator)
        drafters[variant] = fp32_rope(d.to(model.lm_head.weight.dtype))
    n_trunc = min(4, a.n_layers)
    trunc_args = ModelArgs(**{**a.to_dict(), "n_layers": n_trunc})
    with torch.device("meta"):
        trunc = Transformer(trunc_args)
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < n_trunc}
    trunc.load_state_dict(state, assign=True, strict=True)
    trunc = fp32_rope(trunc)
    cost = lambda rows, q: 0.005 + 0.0001 * rows * q  # noqa: E731  (a GPU-like flat verify cost)
    return {
        "ar": Policy(),
        "pld": PromptLookup(k=4, max_ngram=3),
        "fixed-k(self)": FixedK(model, k=4),
        "fixed-k(truncate:4)": FixedK(trunc, k=4),
        "eagle(tree)": Eagle(head, "tree", depth=4, top_k=3, total_tokens=16),
        "eagle(chain)": Eagle(head, "chain", depth=4),
        "dspark(algorithm1)": DSpark(drafters["dspark"], scheduler="algorithm1", step_seconds=cost,
                                     sts_temperatures=[1.0] * 4),
        "dflash": DSpark(drafters["dflash"], scheduler="fixed"),
    }


def check_identity(out: Path, device: str, toy: bool) -> dict:
    shape = "tiny" if toy else "smollm2-135m"
    dtype = torch.bfloat16
    model = random_model(shape, device, dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharpen (tied: the embedding too); see the module docstring
    prompts = prompts_for(model.args.vocab_size, 8)
    config = SamplingConfig(max_new_tokens=24 if toy else 48)
    result = {"shape": shape, "dtype": dtype_name(dtype), "device": device, "cases": []}

    def decode(policy, batch_size):
        outs, t0 = [], time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            outs += generate(model, policy, prompts[i:i + batch_size], config).requests
        return outs, time.perf_counter() - t0

    eager_ar, _ = decode(Policy(), 1)
    graphs = device.startswith("cuda")
    if graphs:
        enable_cuda_graphs(model)
    policies = build_policies(model, toy)
    for batch_size in (1, 8):
        reference, _ = decode(Policy(), batch_size)
        if batch_size == 1:
            result["ar_graphed_equals_eager"] = [r.output_ids for r in reference] == [r.output_ids for r in eager_ar]
        for name, policy in policies.items():
            try:
                got, seconds = decode(policy, batch_size)
                same = [r.output_ids for r in got] == [r.output_ids for r in reference]
                case = {"policy": name, "batch_size": batch_size, "identical_to_ar": same,
                        "tau": sum(r.generated_tokens - 1 for r in got) / max(1, sum(r.rounds for r in got)),
                        "accepted": sum(r.accepted for r in got), "drafted": sum(r.drafted for r in got),
                        "seconds": round(seconds, 3)}
            except Exception as e:  # noqa: BLE001 - one policy failing must not hide the others
                case = {"policy": name, "batch_size": batch_size, "identical_to_ar": False,
                        "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
            result["cases"].append(case)
            log(f"identity b={batch_size} {name}: {case.get('identical_to_ar')} {case.get('error', '')}")
    result["cuda_graphs"] = graphs
    result["all_identical"] = all(c["identical_to_ar"] for c in result["cases"])
    (out / "identity.json").write_text(json.dumps(result, indent=1))
    return result


def run_step_bench(out: Path, device: str, toy: bool) -> int:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "step_bench.py"), "--device", device, "--out",
           str(out / ("step_bench_tiny.json" if toy else "step_bench_llama8b.json"))]
    if toy:
        cmd += ["--shape", "tiny", "--dtype", "bfloat16", "--batches", "1,4", "--qs", "1,2,8", "--iters", "5",
                "--hf-tokens", "8", "--op-profile"]
    else:
        cmd += ["--shape", "llama-8b", "--dtype", "bfloat16", "--batches", "1,256", "--qs", "1,2,8",
                "--context", "1024", "--iters", "20", "--hf-tokens", "32", "--op-profile"]
    log("step_bench: " + " ".join(cmd[1:]))
    return subprocess.call(cmd, cwd=ROOT)


def run_profile_and_simulate(out: Path, device: str, toy: bool) -> int:
    from specbench.costs import profile
    from specbench.engine.loading import LoadedModel

    shape = "tiny" if toy else "llama-8b"
    model = random_model(shape, device, torch.bfloat16)
    if device.startswith("cuda"):
        enable_cuda_graphs(model)
    target = LoadedModel(model, None, f"{shape}-random", "random", "", f"random-{shape}-shape", [])
    batches, qs = ((1, 2), (1, 2, 4)) if toy else ((1, 4, 16, 64, 256), (1, 2, 4, 8))
    log(f"profile {shape}: batches {batches}, qs {qs}")
    data = profile.measure_profile(target, context=64 if toy else 1024, batches=batches, qs=qs, engine_costs=True)
    data["note"] = "random weights of the shape; measured by benchmarks/gpu_check.py"
    slug = "".join(c if c.isalnum() else "-" for c in data["device_name"].lower())[:40]
    path = out / "profiles" / f"{shape}-{slug}-bfloat16.json"
    profile.save(data, path)
    del model, target
    cmd = [sys.executable, "-m", "specbench", "simulate", "--trace", str(ROOT / "results" / "sweeps" / "load-cpu"),
           "--profile", str(path), "--concurrency", "1,4,16,64,256", "--out", str(out / "simulation")]
    log("simulate: " + " ".join(cmd[3:]))
    return subprocess.call(cmd, cwd=ROOT)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--toy", action="store_true", help="tiny shapes on the CPU: checks the script itself")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --toy)")
    ap.add_argument("--only", choices=["identity", "step_bench", "profile"], action="append")
    args = ap.parse_args()
    device = args.device or ("cpu" if args.toy else "cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"device": device, "toy": args.toy, "torch": torch.__version__,
               "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": {}}
    steps = args.only or ["identity", "step_bench", "profile"]
    for step in steps:
        t0 = time.perf_counter()
        try:
            if step == "identity":
                ok = check_identity(out, device, args.toy)["all_identical"]
            elif step == "step_bench":
                ok = run_step_bench(out, device, args.toy) == 0
            else:
                ok = run_profile_and_simulate(out, device, args.toy) == 0
        except Exception:  # noqa: BLE001 - record it and go on: device time is scarce
            (out / f"{step}.error.txt").write_text(traceback.format_exc())
            ok = False
        summary["steps"][step] = {"ok": ok, "seconds": round(time.perf_counter() - t0, 1)}
        log(f"{step}: {'ok' if ok else 'FAILED'} in {summary['steps'][step]['seconds']} s")
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0 if all(s["ok"] for s in summary["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
