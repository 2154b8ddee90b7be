"""Command line: `python -m specbench {run,sweep,list,report} ...`.

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
import os
import re
import statistics
import sys
import tomllib
from pathlib import Path

from specbench.errors import UserError

DEFAULT_TARGET = "smollm2-135m"
RUN_DEFAULT_LIMIT = 8  # requests a `run` takes without --limit / --all
SWEEP_RECORDS = "records.jsonl"
SWEEP_SETTINGS = "sweep.json"


# ---------------------------------------------------------------------------------------------
# argparse plumbing: errors become UserError (one line), values are validated by their types


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # default: usage + message, exit 2 → we want one line
        raise UserError(message)


def checked_type(convert, valid, expected: str, must: str):
    """An argparse `type`: convert (ValueError → "expected …"), then check (False → "must …");
    both become argparse's one-line usage error. Shared by every command's numeric options."""

    def parse(s: str):
        try:
            v = convert(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {s!r}") from None
        if not valid(v):
            raise argparse.ArgumentTypeError(f"{must}, got {s!r}")
        return v

    return parse


_positive_int = checked_type(int, lambda v: v > 0, "a positive integer", "must be a positive integer")
_nonneg_int = checked_type(int, lambda v: v >= 0, "an integer ≥ 0", "must be ≥ 0")
_temperature = checked_type(float, lambda v: math.isfinite(v) and v >= 0, "a number ≥ 0",
                            "temperature must be a finite number ≥ 0")
_top_p = checked_type(float, lambda v: 0 < v <= 1, "a number in (0, 1]", "top-p must be in (0, 1]")


def _list_of(item_type, what: str):
    def parse(s: str):
        parts = [p.strip() for p in s.split(",")]
        if not s.strip() or any(not p for p in parts):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {s!r}")
        out = [item_type(p) for p in parts]
        if len(set(map(str, out))) != len(out):
            raise argparse.ArgumentTypeError(f"duplicate entries in {s!r}")
        return out

    return parse


def _param(s: str) -> tuple[str, object]:
    key, sep, raw = s.partition("=")
    key = key.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {s!r}")
    return key, parse_scalar(raw.strip())


def parse_scalar(raw: str):
    """A TOML scalar (`4`, `0.5`, `true`, `"x"`); anything else is taken as a bare string."""
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    if isinstance(value, (dict, list)) or hasattr(value, "isoformat"):
        return raw
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="specbench", description="Benchmark speculative-decoding policies, losslessly, with error bars.")
    sub = p.add_subparsers(dest="command", metavar="{run,sweep,list,report,simulate,train,calibrate,profile,regress}", parser_class=_Parser)

    def common(sp, single: bool):
        sp.add_argument("--target", default=DEFAULT_TARGET, help=f"model alias, .gguf, HF directory or hub id (default {DEFAULT_TARGET})")
        sp.add_argument("--limit", type=_positive_int, help="use the first N requests of each workload")
        sp.add_argument("--max-new-tokens", type=_positive_int, help="generation limit (default: the workload's)")
        sp.add_argument("--top-p", type=_top_p, default=1.0)
        sp.add_argument("--seed", type=_nonneg_int, default=0)
        sp.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
        sp.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")

    r = sub.add_parser("run", help="one policy on one workload", description="Run one policy on one workload.")
    r.add_argument("--policy", required=True, help="policy name, baseline (hf, hf-assisted, hf-pld) or spec .toml")
    r.add_argument("--workload", required=True, help="workload name, spec .toml or .jsonl file")
    common(r, True)
    r.add_argument("--batch-size", type=_positive_int, default=1)
    r.add_argument("--all", action="store_true",
                   help=f"every request of the workload (default without --limit: the first {RUN_DEFAULT_LIMIT})")
    r.add_argument("--temperature", type=_temperature, default=0.0)
    r.add_argument("--out", help="results .jsonl (default results/run-<policy>-<workload>-<UTC time>.jsonl); "
                                 "an existing file is resumed")
    r.add_argument("--param", type=_param, action="append", default=[], metavar="NAME=VALUE",
                   help="policy parameter override, value parsed as a TOML scalar (repeatable)")

    s = sub.add_parser("sweep", help="policies × workloads × batch sizes × repeats, interleaved",
                       description="Sweep policies × workloads × batch sizes × temperatures × repeats.")
    s.add_argument("--policies", type=_list_of(str, "policy names"), required=True)
    s.add_argument("--workloads", type=_list_of(str, "workload names"), required=True)
    s.add_argument("--batch-sizes", type=_list_of(_positive_int, "positive integers"), default=[1])
    s.add_argument("--repeats", type=_positive_int, default=1)
    s.add_argument("--temperatures", type=_list_of(_temperature, "temperatures ≥ 0"), default=[0.0])
    s.add_argument("--out", required=True, help="results directory (records.jsonl + sweep.json); resumed if it exists")
    s.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="local: this process (default); ray: each cell a Ray task (pip install -e \".[ray]\")")
    s.add_argument("--ray-address", help="Ray cluster to attach to (default: RAY_ADDRESS, else start a local one; 'auto': a running local one)")
    common(s, False)

    sub.add_parser("list", help="policies, baselines, workloads and models", description="List what can be run.")

    rep = sub.add_parser("report", help="HTML + PDF report from results", description="Write the HTML and PDF report.")
    rep.add_argument("results", help="a results .jsonl file or a directory of them")
    rep.add_argument("--html", help="HTML output (default: report.html beside the results)")
    rep.add_argument("--pdf", help="PDF output (default: report.pdf beside the results)")

    cmp = sub.add_parser("compare", help="paired test of one policy against another (tokens/s or τ)",
                         description="Pair two policies' requests on the same prompts in every cell of the results "
                                     "and test the per-prompt log ratio (geometric-mean ratio with a 95% BCa CI, "
                                     "Wilcoxon signed-rank, Holm across cells).")
    cmp.add_argument("results", help="a results .jsonl file or a directory of them")
    cmp.add_argument("a", help="policy name (the numerator)")
    cmp.add_argument("b", help="policy name (the denominator)")
    cmp.add_argument("--metric", choices=["tokens_per_s", "tau"], default="tokens_per_s",
                     help="tokens_per_s (speed) or tau (tokens per verify round: drafter quality, no timing noise)")
    cmp.add_argument("--by-category", action="store_true", help="one cell per workload category too")
    cmp.add_argument("--csv", help="also write the table as csv")

    from specbench import regress, simulate
    from specbench.train import cli as train_cli

    train_cli.add_parser(sub)
    regress.add_parser(sub)
    simulate.add_parser(sub)

    cal = sub.add_parser("calibrate", help="fit DSpark's STS temperatures on held-out rollouts",
                         description="Fit Sequential Temperature Scaling for a DSpark drafter and store it beside the drafter.")
    cal.add_argument("--drafter", default="drafters/smollm2-135m/dspark")
    cal.add_argument("--data", required=True, help="the drafter's training data directory (its validation split is used)")
    cal.add_argument("--target", default=DEFAULT_TARGET)
    cal.add_argument("--prompts", type=_positive_int, default=24)
    cal.add_argument("--temperatures", type=_list_of(_temperature, "temperatures ≥ 0"), default=[0.0, 1.0],
                     help="sampling temperatures to fit at, one STS fit each (default 0,1)")
    cal.add_argument("--max-new-tokens", type=_positive_int, default=384)
    cal.add_argument("--batch-size", type=_positive_int, default=8)
    cal.add_argument("--device", default="cpu")
    cal.set_defaults(func=cmd_calibrate)

    prof = sub.add_parser("profile", help="measure the target's verify cost on this device",
                          description="Measure target forward time vs batch size and verify length; store the cost profile.")
    prof.add_argument("--target", default=DEFAULT_TARGET)
    prof.add_argument("--device", default="cpu")
    prof.add_argument("--context", type=_positive_int, default=256)
    prof.add_argument("--batches", type=_list_of(_positive_int, "positive integers"), default=[1, 2, 4, 8, 16])
    prof.add_argument("--qs", type=_list_of(_positive_int, "positive integers"), default=[1, 2, 4, 8])
    prof.add_argument("--out", required=True, help="profile .json to write")
    prof.set_defaults(func=cmd_profile)
    return p


def cmd_calibrate(args) -> int:
    from specbench.calibrate import calibrate
    from specbench.loading import load_model
    from specbench.train.data import TrainingData

    device = check_device(args.device)
    target = load_model(args.target, device=device)
    data = TrainingData(args.data, target)
    result = calibrate(target, args.drafter, data, n_prompts=args.prompts, temperatures=tuple(args.temperatures),
                       max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    for fit in result["fits"]:
        print(f"T = {fit['sampling_temperature']:g}: STS temperatures {[round(t, 2) for t in fit['temperatures']]}  "
              f"({fit['rollouts']} rounds from {result['prompts']} held-out prompts)")
        for row in fit["per_position"]:
            print(f"  position {row['position']}: n={row['n']}  ECE {row['ece_before']:.3f} -> {row['ece_after']:.3f}  AUC {row['auc']:.3f}")
    print(f"written: {result['path']}")
    return 0


def cmd_profile(args) -> int:
    from specbench import profile
    from specbench.loading import load_model

    device = check_device(args.device)
    check_writable(Path(args.out), "file")
    target = load_model(args.target, device=device)
    data = profile.measure_profile(target, context=args.context, batches=args.batches, qs=args.qs, engine_costs=True)
    profile.save(data, args.out)
    for e in data["entries"]:
        print(f"b={e['batch']:<4} q={e['q']:<3} {e['median_ms']:8.2f} ms")
    print(f"written: {args.out}")
    return 0


# ---------------------------------------------------------------------------------------------
# Validation (before any output file exists or any model loads)


def check_writable(path: Path, what: str) -> None:
    """`path` can be created (or, if it exists, written) without touching anything now."""
    if path.exists():
        if what == "directory" and not path.is_dir():
            raise UserError(f"output directory {path} exists and is not a directory")
        if what == "file" and path.is_dir():
            raise UserError(f"output file {path} is a directory")
        target = path if path.is_dir() else path.parent
        if not os.access(target, os.W_OK | os.X_OK) or (path.is_file() and not os.access(path, os.W_OK)):
            raise UserError(f"output {what} {path} is not writable")
        return
    anc = path.parent
    while not anc.exists():
        if anc == anc.parent:
            break
        anc = anc.parent
    if not anc.is_dir():
        raise UserError(f"cannot create output {what} {path}: {anc} is not a directory")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise UserError(f"cannot create output {what} {path}: {anc} is not writable")


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
    from specbench import baselines
    from specbench.registry import import_object, list_policies, read_spec

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
    from specbench.workloads import load_workload

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


def _load_target_and_engines(target_spec, device, policies_with_overrides):
    from specbench.loading import load_model
    from specbench.runner import make_engine

    target = load_model(target_spec, device=device)
    engines = [make_engine(name, target, ov) for name, ov in policies_with_overrides]
    return target, engines


def cmd_run(args) -> int:
    from specbench.runner import read_records, run_sweep

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
    check_writable(out, "file")
    if out.exists():
        read_records(out, repair=False)  # a malformed file fails now, not after the model loads

    from specbench.envinfo import environment

    target, engines = _load_target_and_engines(args.target, device, [(args.policy, overrides)])
    result = run_sweep(
        target, engines, [workload], out, batch_sizes=[args.batch_size], temperatures=[args.temperature],
        repeats=1, top_p=args.top_p, seed=args.seed, max_new_tokens=args.max_new_tokens, device=device,
        env=environment(device), progress=not args.no_progress,
    )
    keys = set(result.keys)
    recs = [r for r in read_records(out) if r["key"] in keys]
    print(run_summary(recs, engines[0].name, workload.name, args.batch_size, args.temperature, result))
    return 0


def run_summary(recs: list[dict], policy: str, workload: str, batch_size: int, temperature: float, result) -> str:
    """Short summary of a `run` (definitions as in specbench.stats)."""
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
    return "\n".join([
        f"specbench run: {policy} on {workload}, batch size {batch_size}, temperature {temperature:g}",
        f"  requests      {len(recs)}{resumed}",
        f"  tau (mean)    {tau}",
        f"  acceptance    {acc}",
        f"  per-user      {med} (median)",
        f"  throughput    {thr}",
        f"  results       {result.path}",
    ])


def sweep_settings(args, policy_names, workloads, device) -> dict:
    return {
        "policies": list(args.policies), "policy_names": policy_names,
        "workloads": list(args.workloads), "batch_sizes": list(args.batch_sizes), "repeats": args.repeats,
        "temperatures": [float(t) for t in args.temperatures], "top_p": args.top_p, "seed": args.seed,
        "limit": args.limit, "max_new_tokens": args.max_new_tokens, "target": args.target, "device": device,
    }


def _settings_diff(old: dict, new: dict) -> str:
    diffs = [f"{k}: {json.dumps(old.get(k))} vs {json.dumps(new.get(k))}" for k in sorted(set(old) | set(new))
             if old.get(k) != new.get(k)]
    return "; ".join(diffs)


def cmd_sweep(args) -> int:
    from specbench.runner import fsync_dir, read_records, run_sweep

    if args.ray_address and args.executor != "ray":
        raise UserError("--ray-address needs --executor ray")
    if args.executor == "ray":
        from specbench import ray_executor

        ray_executor.import_ray()
        device = ray_executor.ray_device(args.device)  # the cells' device, not necessarily this machine's
    else:
        device = check_device(args.device)
    names = [check_policy(p, {}, args.batch_sizes) for p in args.policies]
    if len(set(names)) != len(names):
        raise UserError(f"policy names must be distinct, got {', '.join(names)}")
    workloads = load_workloads(args.workloads, args.limit)
    out = Path(args.out)
    check_writable(out, "directory")
    settings = sweep_settings(args, names, workloads, device)
    settings_file, records_file = out / SWEEP_SETTINGS, out / SWEEP_RECORDS
    if settings_file.exists():
        try:
            old = json.loads(settings_file.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{settings_file}: unreadable sweep settings ({e})") from None
        if old != settings:
            raise UserError(f"{out} holds a sweep with different settings ({_settings_diff(old, settings)}); "
                            "use another --out or the same settings to resume")
    elif records_file.exists():
        raise UserError(f"{records_file} exists but {settings_file} does not; use another --out")
    if records_file.exists():
        read_records(records_file, repair=False)

    from specbench.envinfo import environment

    if args.executor == "local":
        target, engines = _load_target_and_engines(args.target, device, [(p, {}) for p in args.policies])
    if not settings_file.exists():
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".{SWEEP_SETTINGS}.tmp"
        tmp.write_text(json.dumps(settings, indent=2) + "\n")
        os.replace(tmp, settings_file)
        fsync_dir(out)
    if args.executor == "ray":
        from functools import partial

        from specbench.loading import load_model

        result = ray_executor.run_sweep_ray(
            partial(load_model, args.target, device=device), f"{args.target}|{device}", [(p, {}) for p in args.policies],
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

    from specbench.stats import load_results, summarize

    df = load_results(records_file)
    s = summarize(df)
    cols = [c for c in ("workload", "batch_size", "temperature", "policy", "n", "speedup", "speedup_ci_low",
                        "speedup_ci_high", "p_holm", "tau", "acceptance_rate", "tps_median", "throughput", "note")
            if c in s.columns]
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.max_colwidth", 40):
        return s[cols].to_string(index=False, float_format=lambda x: f"{x:.3g}")


def cmd_list(args) -> int:
    from specbench import baselines
    from specbench.loading import ALIASES, default_cache_dir
    from specbench.registry import builtin_specs, entry_point_builders, list_policies, read_spec
    from specbench.workloads import WORKLOADS_DIR, list_workloads

    print("policies:")
    specs, eps = builtin_specs(), entry_point_builders()
    for name in list_policies():
        try:
            params = read_spec(name).get("params", {})
        except UserError as e:
            params = {"error": str(e)}
        where = "entry point" if name in eps and name not in specs else f"policies/{name}.toml"
        desc = ", ".join(f"{k}={v}" for k, v in params.items()) or "-"
        print(f"  {name:<18} {desc}   ({where})")
    print("baselines (peer implementations, run like policies):")
    for name, desc in baselines.BASELINES.items():
        print(f"  {name:<18} {desc}")
    print("workloads:")
    for name in list_workloads():
        try:
            spec = tomllib.loads((WORKLOADS_DIR / f"{name}.toml").read_text())
            desc = spec.get("description", "")
        except (OSError, tomllib.TOMLDecodeError):
            desc = "(unreadable spec)"
        print(f"  {name:<18} {desc}")
    print("  (or any Spec-Bench / DeepSpec .jsonl file, or a workload .toml spec)")
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
            check_writable(Path(p), "file")
    from specbench import report

    report.write_report(results, html_path=html, pdf_path=pdf)
    for p in (html, pdf):
        if p is not None:
            print(f"wrote {p}")
    return 0


def cmd_compare(args) -> int:
    from specbench import stats

    results = Path(args.results)
    if not results.exists():
        raise UserError(f"results path not found: {results}")
    if args.csv:
        check_writable(Path(args.csv), "file")
    table = stats.compare_policies(stats.load_results(results), args.a, args.b, metric=args.metric,
                                   by_category=args.by_category)
    if table.empty:
        raise UserError(f"{args.a} and {args.b} share no prompts in any cell of {results}")
    cols = [c for c in ("workload", "category", "batch_size", "temperature") if c in table.columns]
    what = "tokens/s" if args.metric == "tokens_per_s" else "τ"
    print(f"{args.a} vs {args.b}: geometric-mean ratio of per-prompt {what} [95% CI], Wilcoxon p, Holm across {len(table)} cells")
    for _, r in table.iterrows():
        cell = "  ".join(f"{c}={r[c]:g}" if isinstance(r[c], float) else f"{c}={r[c]}" for c in cols)
        verdict = ("higher" if r["ratio"] > 1 else "lower") if r["significant"] else "no significant difference"
        print(f"  {cell}  n={int(r['n'])}  {r['ratio']:.3f} [{r['ratio_ci_low']:.3f}, {r['ratio_ci_high']:.3f}]"
              f"  p={r['p']:.2g}  p_holm={r['p_holm']:.2g}  {verdict}")
    if args.csv:
        from specbench.report import _atomic_write  # the report's whole-file-or-nothing writer

        _atomic_write(Path(args.csv), table.to_csv(index=False).encode("utf-8"))
        print(f"wrote {args.csv}")
    return 0


COMMANDS = {"run": cmd_run, "sweep": cmd_sweep, "list": cmd_list, "report": cmd_report, "compare": cmd_compare}


def _regress_main(args) -> int:
    from specbench import regress

    return regress.main(args)


COMMANDS["regress"] = _regress_main


def main(argv=None) -> int:
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help / --version
            return int(e.code or 0)
        if not args.command:
            raise UserError("choose a command: run, sweep, list, report, simulate, train, calibrate, profile, regress (see specbench --help)")
        if args.command in COMMANDS:
            return COMMANDS[args.command](args)
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
