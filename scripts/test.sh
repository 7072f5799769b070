#!/usr/bin/env bash
# The test command (README, .ci/run): installs hstrace with its test extras and runs the suite.
# Torch is pinned to the CPU wheel so a fresh machine does not pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -c scripts/constraints-cpu.txt -e '.[test]'
# speculators (numerical cross-check of the reference drafter) without its CUDA/vLLM-side deps.
python3 -m pip install -q --no-deps -r scripts/requirements-crosscheck-nodeps.txt
python3 -m pytest -q "$@"
