"""Command line: `python -m specbench <command> ...`. Every command's parser names the function
that runs it (`set_defaults(func=...)`): run, sweep, list, report, compare, calibrate and profile
here; train, regress and simulate in their own modules of this package. Argument types and
output checks are in specbench/cli/args.py.

Every input problem is reported as ONE line, `specbench: error: <message>`, on stderr with exit
status 2, before any output file is created or any model is loaded. Ctrl-C exits with 130; the
records already written stay (rerun the same command to resume).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import inspect
import json
import math
import re
import statistics
import sys
import tomllib
from pathlib import Path

from specbench import atomic
from specbench.cli import args as arg
from specbench.errors import UserError

DEFAULT_TARGET = "smollm2-135m"
RUN_DEFAULT_LIMIT = 8  # requests a `run` takes without --limit / --all
SWEEP_RECORDS = "records.jsonl"
SWEEP_SETTINGS = "sweep.json"


COMMAND_NAMES = ("run", "sweep", "compare", "report", "list", "simulate", "train", "corpus", "calibrate", "profile", "regress", "export")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specbench")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = arg.Parser(prog="specbench", description="Benchmark speculative-decoding policies, losslessly, with error bars.")
    p.add_argument("--version", action="version", version=f"specbench {_version()}")
    sub = p.add_subparsers(dest="command", metavar="{" + ",".join(COMMAND_NAMES) + "}", parser_class=arg.Parser)

    def common(sp, single: bool):
        sp.add_argument("--target", default=DEFAULT_TARGET, help=f"model alias, .gguf, HF directory or hub id (default {DEFAULT_TARGET})")
        sp.add_argument("--limit", type=arg.positive_int, help="use the first N requests of each workload"
                        + (f" (default {RUN_DEFAULT_LIMIT}; --all for every one)" if single else " (default: all)"))
        sp.add_argument("--max-new-tokens", type=arg.positive_int,
                        help="generation limit per request, below the target's context (default: the workload's)")
        sp.add_argument("--top-p", type=arg.top_p, default=1.0,
                        help="nucleus sampling: keep the smallest token set with this much probability, in (0, 1] "
                             "(default 1: off; unused at temperature 0)")
        sp.add_argument("--seed", type=arg.nonneg_int, default=0,
                        help="sampling seed; every policy gets the same per-batch seeds from it (default 0)")
        sp.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
        arg.add_dtype_argument(sp)
        sp.add_argument("--no-cuda-graphs", action="store_true",
                        help="on CUDA, run the target's forwards eagerly (default: CUDA graphs per decode/verify shape)")
        sp.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")

    r = sub.add_parser("run", help="one policy on one workload", description="Run one policy on one workload.")
    r.add_argument("--policy", required=True, help="policy name, baseline (hf, hf-assisted, hf-pld) or spec .toml")
    r.add_argument("--workload", required=True, help="workload name, spec .toml or .jsonl file")
    common(r, True)
    r.set_defaults(func=cmd_run)
    r.add_argument("--batch-size", type=arg.positive_int, default=1, help="requests decoded together (default 1)")
    r.add_argument("--all", action="store_true",
                   help=f"every request of the workload (default without --limit: the first {RUN_DEFAULT_LIMIT})")
    r.add_argument("--temperature", type=arg.temperature, default=0.0,
                   help="sampling temperature, ≥ 0 (default 0: greedy, token-identical to ar)")
    r.add_argument("--out", help="results .jsonl (default results/run-<policy>-<workload>-<UTC time>.jsonl); "
                                 "an existing file is resumed")
    r.add_argument("--param", type=arg.param, action="append", default=[], metavar="NAME=VALUE",
                   help="policy parameter override, value parsed as a TOML scalar (repeatable)")
    r.add_argument("--no-ar", action="store_true",
                   help="do not also decode the same requests with ar (by default a run of any other policy "
                        "does, interleaved, and prints the paired speedup over ar)")

    s = sub.add_parser("sweep", help="policies × workloads × batch sizes × repeats, interleaved",
                       description="Sweep policies × workloads × batch sizes × temperatures × repeats.")
    s.add_argument("--policies", type=arg.list_of(str, "policy names"), required=True,
                   help="comma-separated policy names or spec .toml files, e.g. ar,pld,dspark (include ar: "
                        "speedups are paired against it)")
    s.add_argument("--workloads", type=arg.list_of(str, "workload names"), required=True,
                   help="comma-separated workload names, spec .toml or .jsonl files, e.g. code,chat")
    s.add_argument("--batch-sizes", type=arg.list_of(arg.positive_int, "positive integers"), default=[1],
                   help="comma-separated batch sizes, e.g. 1,4,16 (default 1)")
    s.add_argument("--repeats", type=arg.positive_int, default=1, help="times each request is decoded (default 1)")
    s.add_argument("--temperatures", type=arg.list_of(arg.temperature, "temperatures ≥ 0"), default=[0.0],
                   help="comma-separated sampling temperatures, e.g. 0,1 (default 0: greedy)")
    s.add_argument("--out", required=True, help="results directory (records.jsonl + sweep.json); resumed if it exists")
    s.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="local: this process (default); ray: each cell a Ray task (pip install -e \".[ray]\")")
    s.add_argument("--ray-address", help="Ray cluster to attach to (default: RAY_ADDRESS, else start a local one; 'auto': a running local one)")
    common(s, False)
    s.set_defaults(func=cmd_sweep)

    sub.add_parser("list", help="policies, baselines, workloads and models",
                   description="List what can be run.").set_defaults(func=cmd_list)

    rep = sub.add_parser("report", help="HTML + PDF report from results", description="Write the HTML and PDF report.")
    rep.add_argument("results", help="a results .jsonl file or a directory of them")
    rep.add_argument("--html", help="HTML output (default: report.html beside the results)")
    rep.add_argument("--pdf", help="PDF output (default: report.pdf beside the results)")
    rep.set_defaults(func=cmd_report)

    cmp = sub.add_parser("compare", help="paired test of one policy against another (tokens/s or τ)",
                         description="Pair two policies' requests on the same prompts in every cell of the results "
                                     "and test the per-prompt log ratio (geometric-mean ratio with a 95% BCa CI, "
                                     "Wilcoxon signed-rank, Holm across cells).")
    cmp.add_argument("results", help="a results .jsonl file or a directory of them")
    cmp.add_argument("a", help="policy name (the numerator)")
    cmp.add_argument("b", help="policy name (the denominator)")
    cmp.add_argument("--metric", choices=["tokens_per_s", "tau"], default="tokens_per_s",
                     help="tokens_per_s (speed, the default) or tau (tokens per verify round: drafter quality, no timing noise)")
    cmp.add_argument("--by-category", action="store_true", help="one cell per workload category too")
    cmp.add_argument("--csv", help="also write the table as csv")
    cmp.set_defaults(func=cmd_compare)

    from specbench.cli import regress as regress_cli
    from specbench.cli import simulate as simulate_cli
    from specbench.cli import train as train_cli
    from specbench.drafters.formats import export as formats_export

    train_cli.add_parser(sub)
    train_cli.add_corpus_parser(sub)
    regress_cli.add_parser(sub)
    simulate_cli.add_parser(sub)
    formats_export.add_parser(sub)

    cal = sub.add_parser("calibrate", help="fit DSpark's STS temperatures on held-out rollouts",
                         description="Fit Sequential Temperature Scaling for a DSpark drafter and store it beside the drafter.")
    cal.add_argument("--drafter", default="drafters/smollm2-135m/dspark",
                     help="DSpark drafter directory; the fit is written beside it (default %(default)s)")
    cal.add_argument("--data", required=True, help="the drafter's training data directory (its validation split is used)")
    cal.add_argument("--target", default=DEFAULT_TARGET, help=f"the drafter's target model (default {DEFAULT_TARGET})")
    cal.add_argument("--prompts", type=arg.positive_int, default=24,
                     help="held-out prompts to roll out (default %(default)s)")
    cal.add_argument("--temperatures", type=arg.list_of(arg.temperature, "temperatures ≥ 0"), default=[0.0, 1.0],
                     help="comma-separated sampling temperatures to fit at, one STS fit each (default 0,1)")
    cal.add_argument("--max-new-tokens", type=arg.positive_int, default=384,
                     help="tokens per rollout (default %(default)s)")
    cal.add_argument("--batch-size", type=arg.positive_int, default=8, help="rollouts decoded together (default %(default)s)")
    cal.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    arg.add_dtype_argument(cal)
    cal.set_defaults(func=cmd_calibrate)

    prof = sub.add_parser("profile", help="measure the target's verify cost on this device",
                          description="Measure target forward time vs batch size and verify length; store the cost profile.")
    prof.add_argument("--target", default=DEFAULT_TARGET, help=f"model to measure (default {DEFAULT_TARGET})")
    prof.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    prof.add_argument("--context", type=arg.positive_int, default=256,
                      help="tokens already in the KV cache when a step is timed (default %(default)s)")
    prof.add_argument("--batches", type=arg.list_of(arg.positive_int, "positive integers"), default=[1, 2, 4, 8, 16],
                      help="comma-separated batch sizes to time (default 1,2,4,8,16)")
    prof.add_argument("--qs", type=arg.list_of(arg.positive_int, "positive integers"), default=[1, 2, 4, 8],
                      help="comma-separated verify lengths q (tokens per row per forward) to time (default 1,2,4,8)")
    arg.add_dtype_argument(prof)
    prof.add_argument("--policy", default=None,
                      help="also store the drafting round's cost this DSpark / DFlash policy schedules from (name or spec .toml; "
                           "scheduler algorithm1 or capacity; with profile = \"auto\" timed here, with the drafter as the "
                           "policy loads it): a spec with profile = OUT then schedules from these costs on any machine, "
                           "so its greedy decisions are reproducible")
    prof.add_argument("--out", required=True, help="profile .json to write")
    prof.set_defaults(func=cmd_profile)
    return p


def cmd_calibrate(args) -> int:
    from specbench.engine.loading import load_model
    from specbench.policies.calibration import calibrate
    from specbench.policies.registry import build_dspark
    from specbench.train.data import TrainingData

    device = check_device(args.device)
    target = load_model(args.target, device=device, dtype=args.dtype)
    data = TrainingData(args.data, target)
    policy = build_dspark(target, drafter=args.drafter, scheduler="fixed", calibrated=False)
    result = calibrate(target, policy, args.drafter, data, n_prompts=args.prompts,
                       temperatures=tuple(args.temperatures), max_new_tokens=args.max_new_tokens,
                       batch_size=args.batch_size)
    for fit in result["fits"]:
        print(f"T = {fit['sampling_temperature']:g}: STS temperatures {[round(t, 2) for t in fit['temperatures']]}  "
              f"({fit['rollouts']} rounds from {result['prompts']} held-out prompts)")
        for row in fit["per_position"]:
            print(f"  position {row['position']}: n={row['n']}  ECE {row['ece_before']:.3f} -> {row['ece_after']:.3f}  AUC {row['auc']:.3f}")
    print(f"written: {result['path']}")
    return 0


def cmd_profile(args) -> int:
    from specbench.costs import profile
    from specbench.engine.loading import load_model

    from specbench.policies import registry

    device = check_device(args.device)
    arg.check_writable(Path(args.out), "file")
    spec = registry.read_spec(args.policy) if args.policy else None
    if spec is not None and (not spec["builder"].endswith(":build_dspark")
                             or spec["params"].get("scheduler", "algorithm1") not in ("algorithm1", "capacity")):
        raise UserError(f"policy {spec['name']!r} schedules from no drafter cost: --policy takes a DSpark / DFlash "
                        "spec whose scheduler is algorithm1 or capacity")
    target = load_model(args.target, device=device, dtype=args.dtype)
    draft = None
    if spec is not None:
        # The drafting round's cost the policy schedules from: with profile = "auto" (policies/dspark.toml) timed
        # now (or found in the cache) with the drafter as the policy loads it; with a profile file, that file's.
        costs = getattr(registry.build_policy(args.policy, target), "cost_profile", None)
        if not costs or "draft" not in costs:
            raise UserError(f"policy {spec['name']!r}: its cost profile has no drafting-round cost (a `draft` table)")
        draft = {"draft": costs["draft"],
                 "draft_policy": {"name": spec["name"], "params": {k: v for k, v in spec["params"].items() if k != "profile"}}}
    data = profile.measure_profile(target, context=args.context, batches=args.batches, qs=args.qs, engine_costs=True)
    data.update(draft or {})
    profile.save(data, args.out)
    for e in data["entries"]:
        print(f"b={e['batch']:<4} q={e['q']:<3} {e['median_ms']:8.2f} ms")
    for e in data.get("draft", []):
        print(f"b={e['batch']:<4} drafting round {e['median_ms']:8.2f} ms")
    print(f"written: {args.out}")
    return 0


# ---------------------------------------------------------------------------------------------
# Validation (before any output file exists or any model loads)


def check_context(target_spec: str, max_new_tokens: int | None, workloads) -> None:
    """Refuse a generation limit the target's context cannot hold, before its weights load (the
    KV cache is sized prompt + limit, so 100 000 tokens on an 8192-token model is gigabytes of
    memory for positions the model was never trained on)."""
    from specbench.engine.loading import context_length

    limits = [max_new_tokens] if max_new_tokens else [w.max_new_tokens for w in workloads]
    ctx = context_length(target_spec)
    if ctx is not None and max(limits) >= ctx:
        flag = "--max-new-tokens" if max_new_tokens else "the workload's max_new_tokens"
        raise UserError(f"{flag} {max(limits)} does not fit {target_spec}'s context of {ctx} tokens "
                        f"(prompt + generated tokens must fit; use at most {ctx - 1})")


def check_device(device: str) -> str:
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise UserError(f"unknown device {device!r} (use cpu, cuda, cuda:N, mps)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {device!r}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device {device!r}: MPS is not available on this machine")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"unsupported device {device!r} (use cpu, cuda, cuda:N, mps)")
    return str(dev)


def check_policy(name: str, overrides: dict, batch_sizes) -> str:
    """Validate a policy / baseline name and its parameter overrides; returns its record name."""
    from specbench.bench import baselines
    from specbench.policies.registry import import_object, list_policies, read_spec

    if name in baselines.BASELINES:
        baselines.check_params(name, overrides)
        baselines.check_ready(name)
        for b in batch_sizes:
            baselines.check_batch_size(name, b)
        return name
    try:
        spec = read_spec(name)
    except UserError as e:
        if name.endswith(".toml") or name in list_policies():
            raise
        valid = ", ".join(list_policies() + list(baselines.BASELINES))
        raise UserError(f"unknown policy {name!r} (valid: {valid}, or a path to a .toml spec)") from None
    if overrides:
        builder = import_object(spec["builder"])
        try:
            sig = inspect.signature(builder)
        except (TypeError, ValueError):
            return spec["name"]
        ps = list(sig.parameters.values())[1:]  # the first is the target
        if not any(p.kind is p.VAR_KEYWORD for p in ps):
            names = [p.name for p in ps]
            for k in overrides:
                if k not in names:
                    raise UserError(f"policy {spec['name']!r} has no parameter {k!r} (parameters: {', '.join(names) or 'none'})")
    return spec["name"]


def load_workloads(names, limit):
    from specbench.bench.workloads import load_workload

    out = []
    for n in names:
        w = load_workload(n, limit)
        if not w.requests:
            raise UserError(f"workload {n!r} has no requests")
        out.append(w)
    if len({w.name for w in out}) != len(out):
        raise UserError(f"workload names must be distinct, got {', '.join(w.name for w in out)}")
    return out


def _slug(name: str) -> str:
    stem = Path(name).name
    for suf in (".toml", ".jsonl.gz", ".jsonl", ".json"):
        if stem.endswith(suf):
            stem = stem[: -len(suf)]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem) or "x"


# ---------------------------------------------------------------------------------------------
# Commands


def _load_target_and_engines(target_spec, device, dtype, policies_with_overrides, cuda_graphs=True):
    from specbench.bench.runner import make_engine
    from specbench.engine.loading import load_model

    target = load_model(target_spec, device=device, dtype=dtype)
    if cuda_graphs and target.model.device.type == "cuda":
        from specbench.engine.cuda_graphs import enable_cuda_graphs

        enable_cuda_graphs(target.model)
    engines = [make_engine(name, target, ov) for name, ov in policies_with_overrides]
    return target, engines


def cmd_run(args) -> int:
    from specbench.bench.runner import read_records, run_sweep

    overrides = dict(args.param)
    device = check_device(args.device)
    pname = check_policy(args.policy, overrides, [args.batch_size])
    if args.all and args.limit:
        raise UserError("--all and --limit contradict each other; give one")
    # A `run` is the quick look (a few minutes on a laptop CPU); sweeps take every request.
    limit = None if args.all else (args.limit or RUN_DEFAULT_LIMIT)
    (workload,) = load_workloads([args.workload], limit)
    if args.out:
        out = Path(args.out)
    else:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        out = Path("results") / f"run-{_slug(pname)}-{_slug(workload.name)}-{stamp}.jsonl"
    arg.check_writable(out, "file")
    if out.exists():
        read_records(out, repair=False)  # a malformed file fails now, not after the model loads
    check_context(args.target, args.max_new_tokens, [workload])

    from specbench.bench.envinfo import environment

    # The suite's question is "faster than plain decoding?": unless told not to, the same requests
    # are decoded with ar too (interleaved with the policy by the runner, so drift hits both alike;
    # ar records already in --out are reused by resume).
    with_ar = pname != "ar" and not args.no_ar
    wanted = [(args.policy, overrides)] + ([("ar", {})] if with_ar else [])
    target, engines = _load_target_and_engines(args.target, device, args.dtype, wanted,
                                               cuda_graphs=not args.no_cuda_graphs)
    result = run_sweep(
        target, engines, [workload], out, batch_sizes=[args.batch_size], temperatures=[args.temperature],
        repeats=1, top_p=args.top_p, seed=args.seed, max_new_tokens=args.max_new_tokens, device=device,
        env=environment(device), progress=not args.no_progress,
    )
    keys = set(result.keys)
    recs = [r for r in read_records(out) if r["key"] in keys]
    mine = [r for r in recs if r["policy"] == engines[0].name]
    print(run_summary(mine, engines[0].name, workload.name, args.batch_size, args.temperature, result))
    if with_ar:
        print(versus_ar(recs, engines[0].name))
    return 0


def versus_ar(recs: list[dict], policy: str) -> str:
    """The paired per-user speedup of `policy` over ar on the same requests, τ of both, and one
    plain line saying whether speculation paid here and, if not, what the policy did instead."""
    import pandas as pd

    from specbench.analysis import stats

    df = pd.DataFrame([{**r, "category": r.get("category") or r["workload"]} for r in recs])
    df["prompt_id"] = df["prompt_id"].astype(str)
    cmp = stats.compare_policies(df, policy, "ar")
    taus = {name: statistics.fmean(r["tau"] for r in recs if r["policy"] == name
                                   and isinstance(r.get("tau"), (int, float)) and math.isfinite(r["tau"]))
            for name in (policy, "ar")}
    if cmp.empty:
        return "  vs ar         no paired requests"
    row = cmp.iloc[0]
    ratio, lo, hi, n = float(row["ratio"]), float(row["ratio_ci_low"]), float(row["ratio_ci_high"]), int(row["n"])
    ci = f"[{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) and math.isfinite(hi) else "[no CI]"
    lines = [f"  vs ar         {ratio:.2f}x per-user tokens/s {ci} (95% CI, n = {n} paired requests); "
             f"tau {taus[policy]:.2f} vs {taus['ar']:.2f}"]
    if int(df["batch_size"].max()) > 1:  # under load the batch, not the request, is the unit: its rows share one wall time
        t, t_lo, t_hi, n_b = stats.paired_throughput(df[df["policy"] == policy], df[df["policy"] == "ar"])
        if n_b:
            t_ci = f"[{t_lo:.2f}, {t_hi:.2f}]" if math.isfinite(t_lo) and math.isfinite(t_hi) else "[no CI]"
            lines.append(f"  throughput    {t:.2f}x ar's {t_ci} (95% CI, n = {n_b} paired batches"
                         + ("; too few to decide: --limit N or --all" if n_b < 6 else "") + ")")
    if math.isfinite(lo) and lo > 1:
        verdict = f"{policy} paid here: faster than ar, the whole interval above 1"
    elif math.isfinite(hi) and hi < 1:
        verdict = f"{policy} did not pay here: slower than ar, the whole interval below 1"
    else:
        verdict = (f"{policy} vs ar is not decided at n = {n}: the interval includes 1"
                   + (" (more requests: --limit N or --all)" if n < 32 else ""))
    # A gated round is one where a policy with a draft gate drew no drafts at all (empty
    # confidence list, nothing verified); see docs/records.md for the trace fields.
    rounds = []
    for r in recs:
        if r["policy"] != policy:
            continue
        trace, gate = r.get("trace") or {}, bool((r.get("policy_params") or {}).get("draft_gate"))
        verify = trace.get("verify_len", [])
        conf = trace.get("confidence") or [None] * len(verify)
        rounds += [(v, gate and c == []) for v, c in zip(verify, conf)]
    why = []
    if rounds:
        no_draft = sum(1 for v, _ in rounds if v == 0) / len(rounds)
        gated = sum(1 for v, skipped in rounds if v == 0 and skipped) / len(rounds)
        if gated > 0:
            # The gate skips only the rounds where the cost profile, at the acceptance measured so far,
            # says a draft would cost more than it saves; that can happen in a run that paid overall.
            why.append(f"the draft gate skipped {gated:.0%} of rounds, those where this device's cost profile said "
                       "drafting would not pay at the acceptance seen so far")
        if no_draft - gated > 0.005:
            why.append(f"the scheduler verified no draft in {'another ' if gated else ''}{no_draft - gated:.0%} of rounds")
    if not why and taus[policy] < 1.5 and not (math.isfinite(lo) and lo > 1):
        why.append(f"tau {taus[policy]:.2f}: too few drafts accepted to pay for drafting and verifying")
    lines.append(f"  verdict       {verdict}" + (f"; {'; '.join(why)}" if why else ""))
    return "\n".join(lines)


def run_summary(recs: list[dict], policy: str, workload: str, batch_size: int, temperature: float, result) -> str:
    """Short summary of a `run` (definitions as in specbench.analysis.stats)."""
    def num(v):
        return v is not None and isinstance(v, (int, float)) and math.isfinite(v)

    taus = [r["tau"] for r in recs if num(r.get("tau"))]
    drafted = sum(r["drafted"] for r in recs if num(r.get("drafted")))
    accepted = sum(r["accepted"] for r in recs if num(r.get("accepted")))
    tps = [r["tokens_per_s"] for r in recs if num(r.get("tokens_per_s"))]
    batches = {r["batch_id"]: (r["batch_generated_tokens"], r["batch_wall_s"]) for r in recs}
    wall = sum(w for _, w in batches.values())
    tau = f"{statistics.fmean(taus):.2f}" if taus else "n/a"
    acc = f"{accepted / drafted:.3f}" if drafted else "n/a (nothing drafted)"
    med = f"{statistics.median(tps):.1f} tok/s" if tps else "n/a"
    thr = f"{sum(t for t, _ in batches.values()) / wall:.1f} tok/s" if wall > 0 else "n/a"
    resumed = f" ({result.skipped} already in the file)" if result.skipped else ""
    lines = [
        f"specbench run: {policy} on {workload}, batch size {batch_size}, temperature {temperature:g}"
        + (f", {recs[0]['dtype']}" if recs and recs[0].get("dtype") else ""),
        f"  requests      {len(recs)}{resumed}",
        f"  tau (mean)    {tau}",
        f"  acceptance    {acc}",
        f"  per-user      {med} (median)",
        f"  throughput    {thr}",
        f"  results       {result.path}",
    ]
    return "\n".join(lines + [f"  note          {n}" for n in run_notes(recs, batch_size)])


def run_notes(recs: list[dict], batch_size: int) -> list[str]:
    """What the numbers above do not say: stalled requests, rounds the draft gate skipped
    (definitions in specbench.analysis.stats)."""
    import pandas as pd

    from specbench.analysis import stats

    if not recs:
        return []
    df = pd.DataFrame(recs)
    for c in ("workload", "batch_size", "temperature", "policy"):
        if c not in df:
            df[c] = None
    notes = [stats.stall_note(stats.stalled_requests(df), prompts=df.get("prompt_id"))]
    rounds, skipped, lookup_only = stats.round_kinds(df)
    notes.append(stats.gate_note(df, rounds, skipped, batch_size))
    notes.append(stats.lookup_note(rounds, lookup_only))
    return [n for n in notes if n]


def sweep_settings(args, policy_names, workloads, device) -> dict:
    return {
        "policies": list(args.policies), "policy_names": policy_names,
        "workloads": list(args.workloads), "batch_sizes": list(args.batch_sizes), "repeats": args.repeats,
        "temperatures": [float(t) for t in args.temperatures], "top_p": args.top_p, "seed": args.seed,
        "limit": args.limit, "max_new_tokens": args.max_new_tokens, "target": args.target, "device": device,
        "dtype": args.dtype, **({"cuda_graphs": False} if args.no_cuda_graphs else {}),
    }


def _settings_diff(old: dict, new: dict) -> str:
    diffs = [f"{k}: {json.dumps(old.get(k))} vs {json.dumps(new.get(k))}" for k in sorted(set(old) | set(new))
             if old.get(k) != new.get(k)]
    return "; ".join(diffs)


def cmd_sweep(args) -> int:
    from specbench.bench.runner import read_records, run_sweep

    if args.ray_address and args.executor != "ray":
        raise UserError("--ray-address needs --executor ray")
    if args.executor == "ray":
        from specbench.bench import ray_executor
        ray_executor.import_ray()
        device = ray_executor.ray_device(args.device)  # the cells' device, not necessarily this machine's
    else:
        device = check_device(args.device)
    names = [check_policy(p, {}, args.batch_sizes) for p in args.policies]
    if len(set(names)) != len(names):
        raise UserError(f"policy names must be distinct, got {', '.join(names)}")
    workloads = load_workloads(args.workloads, args.limit)
    out = Path(args.out)
    arg.check_writable(out, "directory")
    settings = sweep_settings(args, names, workloads, device)
    settings_file, records_file = out / SWEEP_SETTINGS, out / SWEEP_RECORDS
    if settings_file.exists():
        try:
            old = json.loads(settings_file.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{settings_file}: unreadable sweep settings ({e})") from None
        old.setdefault("dtype", "float32")  # sweeps from before --dtype ran in fp32
        if old != settings:
            raise UserError(f"{out} holds a sweep with different settings ({_settings_diff(old, settings)}); "
                            "use another --out or the same settings to resume")
    elif records_file.exists():
        raise UserError(f"{records_file} exists but {settings_file} does not; use another --out")
    if records_file.exists():
        read_records(records_file, repair=False)
    if args.executor == "local":  # a Ray cluster's model need not exist here
        check_context(args.target, args.max_new_tokens, workloads)

    from specbench.bench.envinfo import environment

    if args.executor == "local":
        target, engines = _load_target_and_engines(args.target, device, args.dtype, [(p, {}) for p in args.policies],
                                                   cuda_graphs=not args.no_cuda_graphs)
    if not settings_file.exists():
        atomic.write_json(settings_file, settings, indent=2)
    if args.executor == "ray":
        from functools import partial

        from specbench.engine.loading import load_model

        result = ray_executor.run_sweep_ray(
            partial(load_model, args.target, device=device, dtype=args.dtype), f"{args.target}|{device}|{args.dtype}", [(p, {}) for p in args.policies],
            workloads, records_file, batch_sizes=args.batch_sizes, temperatures=args.temperatures,
            repeats=args.repeats, top_p=args.top_p, seed=args.seed, max_new_tokens=args.max_new_tokens, device=device,
            env_fn=environment, address=args.ray_address, progress=not args.no_progress,
        )
    else:
        result = run_sweep(
            target, engines, workloads, records_file, batch_sizes=args.batch_sizes, temperatures=args.temperatures,
            repeats=args.repeats, top_p=args.top_p, seed=args.seed, max_new_tokens=args.max_new_tokens, device=device,
            env=environment(device), progress=not args.no_progress,
        )
    print(f"specbench sweep: {result.written} new record(s), {result.skipped} already present -> {records_file}")
    print(sweep_summary(records_file))
    return 0


def sweep_summary(records_file: Path) -> str:
    import pandas as pd

    from specbench.analysis.stats import load_results, summarize

    df = load_results(records_file)
    s = summarize(df)
    cols = [c for c in ("workload", "batch_size", "temperature", "policy", "n", "speedup", "speedup_ci_low",
                        "speedup_ci_high", "p_holm", "tau", "acceptance_rate", "tps_median", "throughput",
                        "throughput_ratio", "throughput_ratio_ci_low", "throughput_ratio_ci_high", "n_batch_pairs")
            if c in s.columns]
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        table = s[cols].to_string(index=False, float_format=lambda x: f"{x:.3g}")
    # Notes in full below the table (too few prompts to test, stalled timings, the draft gate): a
    # truncated column would hide exactly what says how far to trust a row.
    notes = [f"  {r['workload']} b={r['batch_size']} T={r['temperature']:g} {r['policy']}: {r['note']}"
             for _, r in s.iterrows() if r["note"] and r["note"] != "baseline"]
    return table + ("\nnotes:\n" + "\n".join(notes) if notes else "")


def cmd_list(args) -> int:
    from specbench.bench import baselines
    from specbench.engine.loading import ALIASES, default_cache_dir
    from specbench.policies.registry import builtin_specs, entry_point_builders, list_policies, read_spec
    from specbench import resources
    from specbench.bench.workloads import builtin_workloads
    from specbench.drafters.checkpoints import CONFIG_NAME

    print("specs and drafters from: " + ", ".join(str(r) for r in resources.roots()))
    print("policies:")
    specs, eps = builtin_specs(), entry_point_builders()
    for name in list_policies():
        try:
            params = read_spec(name).get("params", {})
        except UserError as e:
            params = {"error": str(e)}
        where = "entry point" if name in eps and name not in specs else f"policies/{specs[name].name}"
        desc = ", ".join(f"{k}={v}" for k, v in params.items()) or "-"
        print(f"  {name:<18} {desc}   ({where})")
    print("baselines (peer implementations, run like policies):")
    for name, desc in baselines.BASELINES.items():
        print(f"  {name:<18} {desc}")
    print("workloads:")
    for name, path in builtin_workloads().items():
        try:
            spec = tomllib.loads(path.read_text())
            desc = spec.get("description", "")
        except (OSError, tomllib.TOMLDecodeError):
            desc = "(unreadable spec)"
        print(f"  {name:<18} {desc}")
    print("  (or any Spec-Bench / DeepSpec .jsonl file, or a workload .toml spec)")
    print("drafters (shipped checkpoints):")
    shipped = {}
    for folder in resources.folders("drafters"):
        for config in sorted(folder.glob(f"*/*/{CONFIG_NAME}")):
            shipped.setdefault(str(config.parent.relative_to(folder.parent)), config.parent)
    for name, path in sorted(shipped.items()):
        try:
            kind = json.loads((path / CONFIG_NAME).read_text()).get("kind", "?")
        except (OSError, json.JSONDecodeError, AttributeError):
            kind = f"(unreadable {CONFIG_NAME})"
        print(f"  {name:<36} {kind}")
    print("models:")
    cache = default_cache_dir() / "models"
    for alias in ALIASES:
        state = "cached" if (cache / alias / "manifest.json").is_file() else "converted on first use"
        print(f"  {alias:<18} alias ({state}){'  [default]' if alias == DEFAULT_TARGET else ''}")
    if cache.is_dir():
        for d in sorted(cache.iterdir()):
            if d.is_dir() and d.name not in ALIASES and not d.name.startswith(".") and (d / "config.json").is_file():
                print(f"  {d.name:<18} cached conversion: {d}")
    print("  (or a .gguf file, a local HF directory, or a hub id org/name)")
    return 0


def cmd_report(args) -> int:
    results = Path(args.results)
    if not results.exists():
        raise UserError(f"results path not found: {results}")
    html, pdf = args.html, args.pdf
    if html is None and pdf is None:
        base = results if results.is_dir() else results.parent
        stem = "report" if results.is_dir() else results.name.removesuffix(".jsonl")
        html, pdf = str(base / f"{stem}.html"), str(base / f"{stem}.pdf")
    for p in (html, pdf):
        if p is not None:
            arg.check_writable(Path(p), "file")
    from specbench.analysis import report
    report.write_report(results, html_path=html, pdf_path=pdf)
    for p in (html, pdf):
        if p is not None:
            print(f"wrote {p}")
    return 0


def cmd_compare(args) -> int:
    from specbench.analysis import stats
    results = Path(args.results)
    if not results.exists():
        raise UserError(f"results path not found: {results}")
    if args.csv:
        arg.check_writable(Path(args.csv), "file")
    df = stats.load_results(results)
    srcs = stats.sources(df)
    # Records of different sweeps (or run directories) are never paired with each other: the
    # source is part of the cell, and the output groups the cells by it.
    by = (["source"] if len(srcs) > 1 else []) + ["workload"] + (["category"] if args.by_category else []) + \
        ["batch_size", "temperature"]
    table = stats.compare_policies(df, args.a, args.b, metric=args.metric, by=by)
    if table.empty:
        raise UserError(f"{args.a} and {args.b} share no prompts in any cell of {results}"
                        + (f" (records of different sweeps are not paired: {len(srcs)} here)" if len(srcs) > 1 else ""))
    cols = [c for c in ("workload", "category", "batch_size", "temperature") if c in table.columns]
    what = "tokens/s" if args.metric == "tokens_per_s" else "τ"
    print(f"{args.a} vs {args.b}: geometric-mean ratio of per-prompt {what} [95% CI], Wilcoxon p, Holm across {len(table)} cells")
    if len(srcs) > 1:
        print(f"{results} holds {len(srcs)} sweeps or run directories; each is compared on its own, never pooled:")
    source = None
    for _, r in table.iterrows():
        if len(srcs) > 1 and r["source"] != source:
            source = r["source"]
            print(f"{source}:")
        cell = "  ".join(f"{c}={r[c]:g}" if isinstance(r[c], float) else f"{c}={r[c]}" for c in cols)
        if r["significant"]:
            verdict = "higher" if r["ratio"] > 1 else "lower"
        elif r["too_few"]:  # the test could not have rejected at this n: not evidence of no difference
            verdict = f"too few prompts to test ({int(r['n_needed'])} needed)"
        else:
            verdict = "no significant difference"
        print(f"  {cell}  n={int(r['n'])}  {r['ratio']:.3f} [{r['ratio_ci_low']:.3f}, {r['ratio_ci_high']:.3f}]"
              f"  p={r['p']:.2g}  p_holm={r['p_holm']:.2g}  {verdict}")
    if args.csv:
        atomic.write_text(Path(args.csv), table.to_csv(index=False))
        print(f"wrote {args.csv}")
    return 0


def main(argv=None) -> int:
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help / --version
            return int(e.code or 0)
        if not args.command:
            raise UserError(f"choose a command: {', '.join(COMMAND_NAMES)} (see specbench --help)")
        return args.func(args)
    except UserError as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"specbench: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specbench: interrupted; records already written stay (rerun the same command to resume)", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1
