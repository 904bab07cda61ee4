#!/usr/bin/env bash
# The GPU lane (`make gpu-check`; docs/GPU.md). Without a visible NVIDIA GPU: one line, exit 0,
# nothing run. With one: a Python whose torch sees the GPU (the machine's own, reused through a
# venv with --system-site-packages, else a fresh venv with the package index's CUDA build of
# torch), hf_zero installed into it, then scripts/gpu_check.py runs every check and writes
# results/gpu-check/{gpu_check.json,summary.txt}. Exit status 1 if any check failed.
#
# Environment: GPU_VENV (default .venv-gpu), GPU_RESULTS (default results/gpu-check),
# GPU_CHECK_ARGS (e.g. --quick: skip the ~1B timing run). Wheels in .whl/ are installed first,
# for machines that cannot reach a package index.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${CUDA_VISIBLE_DEVICES-unset}" == "" || "${CUDA_VISIBLE_DEVICES-}" == "-1" ]]; then
    echo "gpu-check: no GPU visible (CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES-}'); nothing run."
    exit 0
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "gpu-check: no CUDA GPU on this machine (nvidia-smi finds none); nothing run."
    exit 0
fi

VENV="${GPU_VENV:-.venv-gpu}"
sees_gpu='import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'
if [[ ! -x "$VENV/bin/python" ]]; then
    if python3 -c "$sees_gpu" 2>/dev/null; then
        echo "gpu-check: reusing this machine's CUDA torch ($(python3 -c 'import torch; print(torch.__version__)'))"
        python3 -m venv --system-site-packages "$VENV"
    else
        python3 -m venv "$VENV"
    fi
fi
PY="$VENV/bin/python"
if ! "$PY" -c "$sees_gpu" 2>/dev/null; then
    echo "gpu-check: installing torch (the package index's default Linux wheel is a CUDA build)"
    "$PY" -m pip install -q torch
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps .whl/*.whl
fi
# hf_zero itself without touching the index; then whatever its dependencies still lack.
"$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null || "$PY" -m pip install -q --no-deps -e .
missing=$("$PY" - <<'PYEOF'
import importlib.util
need = {"transformers": "transformers", "accelerate": "accelerate", "peft": "peft",
        "datasets": "datasets", "safetensors": "safetensors", "yaml": "pyyaml", "pytest": "pytest",
        "bitsandbytes": "bitsandbytes"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [[ -n "$missing" ]]; then
    echo "gpu-check: installing $missing"
    "$PY" -m pip install -q $missing || {
        echo "gpu-check: could not install $missing (no package index here?): carry them as wheels in .whl/ (docs/GPU.md)"
        exit 2
    }
fi
touch "$VENV/.hf_zero-installed"  # the Makefile's stamp: `make train VENV=$VENV` installs nothing
exec "$PY" scripts/gpu_check.py --venv "$VENV" --out "${GPU_RESULTS:-results/gpu-check}" ${GPU_CHECK_ARGS:-}
