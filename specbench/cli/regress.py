"""`python -m specbench regress`: the CI regression gate's command (specbench/analysis/regress.py
does the comparing; docs/regress.md has the rules). Exit status 0: no regression, 1: regression,
2: bad input."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specbench.analysis import regress, stats
from specbench.cli import args as arg
from specbench.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--baseline", required=True, help="baseline results (.jsonl or directory), e.g. results/baseline/NAME/")
    p.add_argument("--current", help="current results (.jsonl or directory), e.g. results/NAME/")
    p.add_argument("--max-slowdown", type=arg.fraction, default=0.05,
                   help="relative drop that counts as a regression (default 0.05)")
    p.add_argument("--tolerance", type=arg.nonneg_float, default=None,
                   help="wall-clock A/A tolerance (default: aa.json beside the baseline, else 0)")
    p.add_argument("--profile", help="cost profile json for speedup_cost (default: profile.json beside the baseline, "
                                     "else a committed/cached profile of the baseline's target)")
    p.add_argument("--resamples", type=arg.positive_int, default=stats.DEFAULT_RESAMPLES, help="bootstrap resamples (default 2000)")
    p.add_argument("--seed", type=int, default=stats.DEFAULT_SEED, help="bootstrap seed (default 0)")
    p.add_argument("--calibrate", nargs="+", metavar="RUN",
                   help="A/A calibration instead of a comparison: an even number of results paths of the same code "
                        "(A1 B1 A2 B2 ...), paired in order; writes aa.json beside --baseline")
    return p


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``regress`` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "regress", help="CI regression gate: compare results against a baseline",
        description="Compare results against a baseline: exit 1 if τ, acceptance, the wall-clock speedup vs ar "
                    "(bootstrap bound, A/A tolerance) or the cost-model speedup regressed; 0 otherwise.")
    p.set_defaults(func=main)
    return add_arguments(p)


def main(args) -> int:
    """Run the gate for parsed ``args``; 0: no regression, 1: regression. Raises UserError on bad input."""
    if args.calibrate:
        runs = list(args.calibrate)
        if len(runs) % 2:
            raise UserError(f"--calibrate takes an even number of runs (A1 B1 A2 B2 ...), got {len(runs)}")
        base = Path(args.baseline)
        if not base.exists():
            raise UserError(f"baseline results path not found: {base}")
        for r in runs:
            if not Path(r).exists():
                raise UserError(f"A/A run not found: {r}")
        target = (base if base.is_dir() else base.parent) / regress.AA_FILE
        data = regress.write_aa(target, list(zip(runs[::2], runs[1::2])))
        print(f"A/A: {data['n_pairs']} pairs, {data['n_values']} cell values; tolerance (95th percentile of "
              f"|log ratio|) = {data['tolerance']:.4f}; written to {target}")
        return 0
    if not args.current:
        raise UserError("regress needs --current (or --calibrate RUN ...)")
    rows, regressed = regress.compare(args.baseline, args.current, max_slowdown=args.max_slowdown,
                                      tolerance=args.tolerance, profile=args.profile, n_resamples=args.resamples,
                                      seed=args.seed)
    print(regress.format_table(rows))
    bad = [r for r in rows if r["verdict"] == regress.REGRESSED]
    if bad:
        print(f"\nREGRESSION: {len(bad)} metric(s) in {len({r['cell'] for r in bad})} cell(s) regressed")
        print(regress.format_table(bad))
        return 1
    print(f"\nno regression ({len(rows)} metrics in {len({r['cell'] for r in rows})} cells)")
    return 0


def cli_main(argv=None) -> int:
    """Standalone entry point (``python -m specbench.cli.regress ...``): exit status 0/1, 2 on bad input."""
    try:
        parser = add_arguments(arg.Parser(prog="specbench regress", description=main.__doc__))
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help
            return int(e.code or 0)
        return main(args)
    except UserError as e:
        print(f"specbench: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(cli_main())
