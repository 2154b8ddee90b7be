#!/usr/bin/env bash
# Prepare a lent GPU machine's two calls (developers' tool; docs/performance.md "Session 19" has the
# commands and what the first lease measured). A call carries at most 64 MiB: the tracked tree is
# larger (drafters, results), so the calls run from a branch `device-slim` that holds the code alone,
# and the default target's GGUF (98 MB) travels in two parts, one per call, joined on the machine.
#
#   scripts/device_prepare.sh          builds .gpu/{partA,partB,corpus}, .whl/ (gguf) and the branch
#   git checkout device-slim           before the calls (untracked benchmarks/ files: see below)
#   git checkout main                  after them
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
mkdir -p .gpu .whl

gguf=$(python - <<'EOF'
from specbench.engine.loading import _smollm2_gguf
print(_smollm2_gguf())
EOF
)
head -c 60000000 "$gguf" > .gpu/partA
tail -c +60000001 "$gguf" > .gpu/partB
cat .gpu/partA .gpu/partB | cmp - "$gguf"
rm -rf .gpu/corpus && mkdir -p .gpu/corpus && cp -r corpus/smollm2-135m corpus/smollm2-135m-code .gpu/corpus/
# the machine has no gguf package (transformers' GGUF reader needs it); pure Python
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d .whl "gguf==$(python -c 'import gguf, importlib.metadata as m; print(m.version("gguf"))')"

# device-slim: HEAD's tree without the large folders (a commit off main, never merged)
export GIT_INDEX_FILE=$(mktemp -u)
git read-tree HEAD
git rm -r -q --cached corpus drafters docs tests results
git add -f results/sweeps/load-cpu  # benchmarks/gpu_check.py simulates its traces
git branch -f device-slim "$(git commit-tree "$(git write-tree)" -p HEAD -m 'device-slim: what a device call carries')"
rm -f "$GIT_INDEX_FILE"
echo "ready: .gpu/partA $(stat -c %s .gpu/partA) B, .gpu/partB $(stat -c %s .gpu/partB) B, branch device-slim" \
     "($(git ls-tree -r -l device-slim | awk '{s += $4} END {print s}') B tracked)"
