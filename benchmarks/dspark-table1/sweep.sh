#!/usr/bin/env bash
# DSpark Table 1 on a GPU (docs/formats.md, "Reproducing DSpark Table 1"): target Qwen/Qwen3-4B,
# DeepSeek's released DSpark and DFlash drafters, DeepSpec's nine eval sets, T = 1, γ = 7,
# batch size 1, τ per round in the records (`specbench report` tabulates it per workload).
# Usage: benchmarks/dspark-table1/sweep.sh [OUT] [extra sweep arguments, e.g. --limit 8]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-results/sweeps/dspark-table1}"
shift || true
workloads=""
for w in gsm8k math500 aime25 humaneval mbpp livecodebench mt-bench alpaca arena-hard-v2; do
    workloads="${workloads:+$workloads,}$here/workloads/$w.toml"
done
python -m specbench sweep \
    --target "${TARGET:-Qwen/Qwen3-4B}" --device "${DEVICE:-cuda}" \
    --policies "ar,$here/policies/dspark.toml,$here/policies/dflash.toml" \
    --workloads "$workloads" --temperatures 1 --batch-sizes 1 --seed 980406 \
    --out "$out" "$@"
