"""Step-time benchmark of the decode core's target forward (not a test: numbers go to
docs/performance.md and results/perf/).

Measures, for one model shape on one device:
  * the AR step (q = 1) and the verify step (q = 8 and others) at chosen batch sizes and context;
  * on CUDA: with CUDA graphs (the core's graphed path);
  * beside every step time its memory floor = (weight bytes + the rows' cached K/V) / bandwidth
    measured in the same run (specbench/profile.py streaming_bandwidth: a device copy on CUDA, a
    sum over 1 GiB on a CPU), and the fraction of that floor reached;
  * the verify-cost ratio T(q)/T(1) with the folded-GQA attention and with the plain path
    (KV repeated per query head), plus the max relative difference between their outputs;
  * transformers.generate on the same weights at b = 1 (tokens/s), for the "×HF" comparison.

Usage:
  python benchmarks/step_bench.py --shape smollm2-135m --real-weights --device cpu --dtype auto --out results/perf/cpu.json
  python benchmarks/step_bench.py --shape smollm2-135m --real-weights --dtype auto --paired-floor 40   # phase-matched floor
  python benchmarks/step_bench.py --shape llama-8b --device cuda --dtype bfloat16 --batches 1,256 --out results/perf/h200.json
  python benchmarks/step_bench.py --shape tiny --device cpu   # seconds: checks the script itself
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import specbench.engine.model as model_module  # noqa: E402
from specbench.engine.core import synchronize  # noqa: E402
from specbench.engine.cuda_graphs import enable_cuda_graphs  # noqa: E402
from specbench.engine import huge_pages  # noqa: E402
from specbench.engine.model import ModelArgs, Transformer  # noqa: E402
from specbench.engine.dtypes import DTYPES, cast_model, dtype_name, measure_cpu_dtypes  # noqa: E402
from specbench.costs.profile import floor_ms, streaming_bandwidth, time_forward, weight_bytes  # noqa: E402

SHAPES = {
    # Llama-3.1-8B (config.json of meta-llama/Llama-3.1-8B)
    "llama-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
                     rope_theta=500000.0, norm_eps=1e-5,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # SmolLM2-135M (the embedded default target)
    "smollm2-135m": dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536,
                         rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True),
    "tiny": dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128),
}


def random_model(shape: str, device: str, dtype: torch.dtype) -> Transformer:
    args = ModelArgs(**SHAPES[shape])
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.inv_freq = model_module.rope_inv_freq(args).to(device)
    return model.eval().requires_grad_(False)


def hf_generate_tokens_per_s(model: Transformer, device: str, dtype, new_tokens: int, context: int) -> float:
    """transformers.generate on the same weights, b = 1, greedy, fixed output length."""
    import transformers

    a = model.args
    config = transformers.LlamaConfig(
        vocab_size=a.vocab_size, hidden_size=a.dim, num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads, intermediate_size=a.intermediate_size, rope_theta=a.rope_theta,
        rope_scaling=a.rope_scaling, rms_norm_eps=a.norm_eps, tie_word_embeddings=a.tie_embeddings,
        max_position_embeddings=max(8192, context + new_tokens + 8))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    hf.load_state_dict(model.state_dict(), strict=False)
    hf.eval()
    prompt = torch.randint(0, a.vocab_size, (1, context), device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    hf.generate(prompt, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    synchronize(torch.device(device))
    start = time.perf_counter()
    hf.generate(prompt, **kwargs)
    synchronize(torch.device(device))
    return new_tokens / (time.perf_counter() - start)


def core_generate_tokens_per_s(model: Transformer, new_tokens: int, context: int) -> float:
    """Our whole AR decode loop (sampling, commit, bookkeeping included) at b = 1, greedy."""
    from specbench.engine.core import SamplingConfig, generate
    from specbench.engine.policy import Policy

    prompt = torch.randint(0, model.args.vocab_size, (context,)).tolist()
    generate(model, Policy(), [prompt], SamplingConfig(max_new_tokens=4))  # warm-up / graph capture
    result = generate(model, Policy(), [prompt], SamplingConfig(max_new_tokens=new_tokens)).requests[0]
    return result.tokens_per_s


def fold_exactness(model: Transformer, batch: int, q: int, context: int) -> float:
    """Max relative difference of logits between the folded and the plain attention path."""
    from specbench.engine.core import forward_new_tokens

    tokens = torch.randint(0, model.args.vocab_size, (batch, q), device=model.device)
    cache = torch.full((batch,), context, dtype=torch.long, device=model.device)
    graphed = getattr(model, "graphed", None)
    model.graphed = None
    try:
        model_module.FOLD_GQA_HEADS = True
        folded = forward_new_tokens(model, tokens, cache)[0].float()
        model_module.FOLD_GQA_HEADS = False
        plain = forward_new_tokens(model, tokens, cache)[0].float()
    finally:
        model_module.FOLD_GQA_HEADS = True
        model.graphed = graphed
    return float((folded - plain).abs().max() / plain.abs().max())


def paired_floor(model: Transformer, context: int, pairs: int, qs=(1, 8), n_bytes: int = 2**30) -> dict:
    """On a CPU, `pairs` passes of [a sum over `n_bytes` (the read rate now), then one b = 1 forward at
    each q]: each step is set against the floor of the read rate measured just before it. A CPU's read
    rate can switch between levels within seconds (29-31 or 51-59 GB/s on the 2-core EPYC,
    docs/performance.md "Session 13"), so a floor from the best of a few sums set against a median of
    steps taken later may compare two machine states; these pairs compare like with like."""
    buf = huge_pages.read_probe(n_bytes // 4, torch.device("cpu")).uniform_()
    buf.sum()
    fractions, rates, steps = [], [], {q: [] for q in qs}
    for q in qs:
        time_forward(model, 1, q, context, iters=0, warmup=2)
    for _ in range(pairs):
        start = time.perf_counter()
        buf.sum()
        rate = n_bytes / (time.perf_counter() - start)
        rates.append(rate)
        for q in qs:
            (t,) = time_forward(model, 1, q, context, iters=1, warmup=0)
            steps[q].append(t)
        fractions.append(floor_ms(model, 1, context, rate) / (1e3 * steps[qs[0]][-1]))
    med = statistics.median
    return {"pairs": pairs, "floor_fraction_median": med(fractions),
            "floor_fraction_quartiles": statistics.quantiles(fractions, n=4)[::2] if pairs > 1 else fractions * 2,
            "read_rate_gb_s_min_median_max": [min(rates) / 1e9, med(rates) / 1e9, max(rates) / 1e9],
            "step_ms_median": {str(q): 1e3 * med(v) for q, v in steps.items()},
            "ratio_to_q1_median": {str(q): med([a / b for a, b in zip(v, steps[qs[0]])]) for q, v in steps.items()}}


def op_profile(model: Transformer, batch: int, q: int, context: int, top: int = 15) -> dict:
    """Where one eager forward's device time goes (torch.profiler, graphs off so each kernel shows):
    the `top` ops by self device time (self CPU time on a CPU), with their share of the total. Set
    against the step's floor this says which op loses the bandwidth, which a graphed step's one
    number cannot."""
    from torch.profiler import ProfilerActivity, profile

    cuda = model.device.type == "cuda"
    graphed = getattr(model, "graphed", None)
    model.graphed = None
    try:
        time_forward(model, batch, q, context, iters=0, warmup=2)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            time_forward(model, batch, q, context, iters=5, warmup=0)
    finally:
        model.graphed = graphed
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    total = sum(getattr(e, key) for e in events)
    rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]
    return {"batch": batch, "q": q, "time": key, "forwards": 5, "total_ms_per_forward": total / 5e3,
            "ops": [{"name": e.key, "calls_per_forward": e.count / 5, "ms_per_forward": getattr(e, key) / 5e3,
                     "share": getattr(e, key) / total} for e in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--real-weights", action="store_true", help="smollm2-135m: load the real default model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["auto", *DTYPES],
                    help="auto: bfloat16 on CUDA, on a CPU the faster of float32 / bfloat16 measured now")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--qs", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--plain-too", action="store_true", help="also time the plain (unfolded) attention path")
    ap.add_argument("--hf-tokens", type=int, default=0, help="also time transformers.generate for this many tokens at b=1")
    ap.add_argument("--paired-floor", type=int, default=0, metavar="N",
                    help="CPU: also N passes of [1 GiB sum, b = 1 steps at q = 1 and 8], each step against the floor "
                         "of the read rate measured just before it")
    ap.add_argument("--op-profile", action="store_true",
                    help="also the top ops of one eager forward at b = 1, q = 1 and 8, by self device time")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    auto = args.dtype == "auto"
    dtype = torch.float32 if auto else DTYPES[args.dtype]
    if auto and args.device.startswith("cuda"):
        dtype, auto = torch.bfloat16, False
    if args.real_weights:
        from specbench.engine.loading import load_model

        model = load_model("smollm2-135m", device=args.device, dtype=dtype).model
    else:
        model = random_model(args.shape, args.device, dtype)
    dtype_choice = None
    if auto:  # the same measurement `--dtype auto` makes for the suite's commands (specbench/dtypes.py)
        dtype_choice = measure_cpu_dtypes(model)
        dtype = DTYPES[dtype_choice["chosen"]]
        cast_model(model, dtype)
    cuda = args.device.startswith("cuda")
    if cuda and not args.no_graphs:
        enable_cuda_graphs(model)

    batches = [int(x) for x in args.batches.split(",")]
    qs = [int(x) for x in args.qs.split(",")]
    result = {
        "shape": args.shape, "real_weights": args.real_weights, "device": args.device, "dtype": dtype_name(dtype),
        "dtype_choice": dtype_choice,
        "context": args.context, "cuda_graphs": cuda and not args.no_graphs,
        "device_name": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "weight_bytes": weight_bytes(model), "steps": [],
    }
    bandwidth = streaming_bandwidth(args.device)
    result.update(bandwidth_gb_s=bandwidth / 1e9,
                  bandwidth_method="copy (read + write)" if cuda else "sum over 1 GiB (read)")
    for fold in ([True, False] if args.plain_too else [True]):
        model_module.FOLD_GQA_HEADS = fold
        if cuda and not args.no_graphs:
            model.graphed.graphs.clear()  # graphs bake in the attention path
        for b in batches:
            for q in qs:
                times = time_forward(model, b, q, args.context, iters=args.iters)
                ms = 1e3 * statistics.median(times)
                floor = floor_ms(model, b, args.context, bandwidth)
                result["steps"].append({"attention": "folded" if fold else "plain", "batch": b, "q": q,
                                        "median_ms": ms, "min_ms": 1e3 * min(times), "n": len(times),
                                        "floor_ms": floor, "floor_fraction": floor / ms,
                                        "floor_fraction_best": floor / (1e3 * min(times))})
                print(f"{'folded' if fold else 'plain ':6} b={b:<4} q={q:<3} {ms:9.2f} ms (min {1e3 * min(times):.2f})"
                      f"   floor {floor:7.2f} ms: {100 * floor / ms:5.1f}% of it", flush=True)
    model_module.FOLD_GQA_HEADS = True
    result["fold_max_rel_diff"] = fold_exactness(model, batches[-1], max(qs), args.context)
    ar = next((s for s in result["steps"] if s["batch"] == 1 and s["q"] == 1 and s["attention"] == "folded"), None)
    if ar is not None:
        result.update(floor_ms_b1=ar["floor_ms"], roofline_fraction_b1=ar["floor_fraction"])
    if args.paired_floor and not cuda:
        result["paired_floor"] = paired_floor(model, args.context, args.paired_floor)
        pf = result["paired_floor"]
        print(f"paired floor: {100 * pf['floor_fraction_median']:.1f}% of the floor at b=1 q=1 (median of {pf['pairs']} "
              f"pairs; read rate {pf['read_rate_gb_s_min_median_max'][0]:.1f}-{pf['read_rate_gb_s_min_median_max'][2]:.1f} "
              f"GB/s); T(8)/T(1) {pf['ratio_to_q1_median']['8']:.3f}", flush=True)
    if args.hf_tokens:
        ours_tps = core_generate_tokens_per_s(model, args.hf_tokens, args.context)
        model.graphed = None
        hf_tps = hf_generate_tokens_per_s(model, args.device, dtype, args.hf_tokens, args.context)
        result.update(hf_generate_tokens_per_s=hf_tps, core_generate_tokens_per_s_b1=ours_tps,
                      speedup_vs_hf_generate=ours_tps / hf_tps)
    if args.op_profile:
        result["op_profile"] = [op_profile(model, 1, q, args.context) for q in (1, 8)]
        for prof in result["op_profile"]:
            print(f"ops of one eager forward, b=1 q={prof['q']}: {prof['total_ms_per_forward']:.2f} ms "
                  f"({prof['time']})", flush=True)
            for op in prof["ops"]:
                print(f"  {op['ms_per_forward']:8.3f} ms {100 * op['share']:5.1f}%  x{op['calls_per_forward']:<5g} "
                      f"{op['name'][:90]}", flush=True)
    for s in result["steps"]:
        base = next(t for t in result["steps"] if t["attention"] == s["attention"] and t["batch"] == s["batch"] and t["q"] == 1)
        s["ratio_to_q1"] = s["median_ms"] / base["median_ms"]
    summary = {k: v for k, v in result.items() if k != "steps"}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
