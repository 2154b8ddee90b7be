"""`python -m specbench simulate`: per-user tokens/s and throughput at any concurrency, replaying
recorded traces on a cost profile (specbench/analysis/simulate.py does the replay)."""
from __future__ import annotations

import json

import argparse
import sys
from pathlib import Path

from specbench.analysis import simulate
from specbench.cli import args as arg
from specbench.errors import UserError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate", help="per-user tokens/s and throughput vs concurrency, replaying recorded traces on a cost profile",
        description="Replay the per-round traces of real runs against a cost profile (any device) to estimate "
                    "per-user tokens/s and throughput at each concurrency; DSpark re-schedules on the replayed confidences.")
    p.add_argument("--trace", required=True, help="results directory or .jsonl whose records carry traces, e.g. results/sweeps/NAME/")
    p.add_argument("--profile", required=True, help="cost profile json from `specbench profile` (any device)")
    p.add_argument("--concurrency", type=arg.list_of(arg.positive_int, "positive integers"), default=[1, 4, 16, 64, 256],
                   help="comma-separated numbers of requests in flight (default 1,4,16,64,256)")
    p.add_argument("--mode", choices=(*simulate.MODES, "both"), default="continuous",
                   help="continuous batching (default), static batches as the core runs them, or both")
    p.add_argument("--requests", type=arg.positive_int, help="requests per cell (default: continuous max(8·c, recorded), "
                                                              "static the recorded ones, at least c)")
    p.add_argument("--source-batch-size", type=arg.positive_int,
                   help="replay the records of this batch size (default: the smallest recorded)")
    p.add_argument("--seed", type=arg.nonneg_int, default=0, help="seed of the acceptance draws (default 0)")
    p.add_argument("--out", help="output directory (default: simulation/ beside the traces)")
    p.set_defaults(func=main)
    return p


def main(args) -> int:
    trace = Path(args.trace)
    if not trace.exists():
        raise UserError(f"trace path not found: {trace}")
    out = Path(args.out) if args.out else (trace if trace.is_dir() else trace.parent) / "simulation"
    arg.check_writable(out, "directory")
    modes = simulate.MODES if args.mode == "both" else (args.mode,)
    recs, untraced = simulate.load_traces(trace)
    costs = simulate.load_costs(args.profile)
    rows = simulate.simulate_records(recs, costs, args.concurrency, modes, requests=args.requests,
                                     source_batch_size=args.source_batch_size, seed=args.seed)
    try:  # the dtype the profile was measured in (the traces' acceptance is replayed against its costs)
        profile_dtype = json.loads(Path(args.profile).read_text()).get("dtype")
    except (OSError, ValueError):
        profile_dtype = None
    settings = {"trace": str(trace), "profile": str(args.profile), "device_name": costs.device_name,
                "profile_dtype": profile_dtype,
                "concurrency": list(args.concurrency), "modes": list(modes), "requests": args.requests,
                "source_batch_size": args.source_batch_size, "seed": args.seed}
    path = simulate.write_outputs(rows, out, settings)
    print(simulate.format_table(rows))
    missing = sorted({name for r in rows for name in ("overheads", "prefill", "draft_cost") if not r[f"{name}_modeled"]})
    if missing:
        print(f"note: not in this profile, left out of the cost: {', '.join(missing)}", file=sys.stderr)
    if untraced:
        print(f"note: no per-round traces, not simulated: {', '.join(untraced)}", file=sys.stderr)
    print(f"written: {path}")
    return 0
