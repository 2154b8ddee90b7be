"""The suite against vLLM in one sweep, on an idle machine (issue #15, "Must show" 1 and 2).

    python benchmarks/vllm_side_by_side.py [--out results/sweeps/vllm-side-by-side] [--limit 16]
        [--max-new-tokens 128] [--batch-sizes 1,8,16] [--policies ar,pld,dspark,vllm,vllm-ngram]
        [--tables-only]

1. ``python -m specbench sweep`` of the policies on code and chat at the batch sizes, greedy,
   into ``--out`` (resumable: run it again after an interruption). vLLM's engines run in vLLM's
   own Python (``scripts/setup_vllm.sh``; ``SPECBENCH_VLLM_PYTHON``) in the dtype of the suite's
   target, so both sides decode the same token-id prompts in the same dtype.
2. ``python -m specbench report`` of it (HTML + PDF beside the records).
3. ``side-by-side.md`` in ``--out``: for each (workload, batch size), suite ``ar`` vs ``vllm`` and
   ``pld`` vs ``vllm-ngram``: median per-user tokens/s of each, their paired per-prompt ratio
   (geometric mean, 95% BCa CI, from ``specbench.analysis.stats.compare_policies``), and each side's
   throughput (all tokens / batch wall time); plus vLLM's τ and acceptance from its own counters.

Nothing here is a measurement until it runs on an otherwise idle machine: on a loaded box both
engines are slowed unevenly (vLLM binds its compute to fixed cores; the suite's torch does not).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAIRS = (("ar", "vllm"), ("pld", "vllm-ngram"))


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def fmt(x, spec=".1f") -> str:
    return "–" if x is None or x != x else format(x, spec)


def side_by_side(out: Path) -> str:
    sys.path.insert(0, str(REPO))
    from specbench.analysis import stats
    from specbench.bench.envinfo import environment_table

    df = stats.load_results(out)
    summary = stats.summarize(df)
    have = set(df["policy"])
    lines = [f"Records: `{out}` ({len(df)} requests). Per-user tokens/s: median over prompts; ratio: geometric mean "
             "of per-prompt suite / vLLM with its 95% BCa CI (> 1: the suite is faster); throughput: all tokens over "
             "the batches' wall time.", ""]
    for suite, peer in PAIRS:
        if not {suite, peer} <= have:
            continue
        cmp = stats.compare_policies(df, suite, peer)
        lines += [f"### `{suite}` vs `{peer}`", "",
                  f"| workload | b | n | {suite} tok/s | {peer} tok/s | ratio [95% CI] | {suite} throughput | "
                  f"{peer} throughput | throughput ratio | {peer} τ | {peer} acceptance |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for _, c in cmp.iterrows():
            cell = (summary["workload"] == c["workload"]) & (summary["batch_size"] == c["batch_size"]) & (
                summary["temperature"] == c["temperature"])
            s = summary[cell & (summary["policy"] == suite)].iloc[0]
            v = summary[cell & (summary["policy"] == peer)].iloc[0]
            thr_ratio = s["throughput"] / v["throughput"] if v["throughput"] > 0 else float("nan")
            lines.append(
                f"| {c['workload']} | {int(c['batch_size'])} | {int(c['n'])} | {fmt(s['tps_median'])} | "
                f"{fmt(v['tps_median'])} | {fmt(c['ratio'], '.2f')}× [{fmt(c['ratio_ci_low'], '.2f')}, "
                f"{fmt(c['ratio_ci_high'], '.2f')}] | {fmt(s['throughput'])} | {fmt(v['throughput'])} | "
                f"{fmt(thr_ratio, '.2f')}× | {fmt(v.get('tau'), '.2f')} | {fmt(v.get('acceptance_rate'), '.2f')} |")
        lines.append("")
    env = environment_table(df)
    lines += ["### Environment", ""] + [f"- {r['field']}: {r['value']}" for _, r in env.iterrows()] + [""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/sweeps/vllm-side-by-side")
    p.add_argument("--policies", default="ar,pld,dspark,vllm,vllm-ngram")
    p.add_argument("--workloads", default="code,chat")
    p.add_argument("--batch-sizes", default="1,8,16")
    p.add_argument("--limit", type=int, default=16, help="requests per workload (16: one full batch at b = 16)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tables-only", action="store_true", help="only write side-by-side.md from existing records")
    args = p.parse_args()
    out = Path(args.out)
    py = sys.executable
    if os.environ.get("OMP_NUM_THREADS"):
        print(f"note: OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} limits the suite's torch threads; "
              "unset it to give the suite every core (vLLM picks its own threads)", file=sys.stderr)
    if not args.tables_only:
        run([py, "-m", "specbench", "sweep", "--policies", args.policies, "--workloads", args.workloads,
             "--batch-sizes", args.batch_sizes, "--limit", str(args.limit), "--max-new-tokens",
             str(args.max_new_tokens), "--out", str(out)])
        run([py, "-m", "specbench", "report", str(out)])
    table = side_by_side(out)
    (out / "side-by-side.md").write_text(table + "\n")
    print(table)
    print(f"wrote {out / 'side-by-side.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
