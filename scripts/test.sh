#!/usr/bin/env bash
# The test command (README, .ci/run): installs hstrace with its test extras and runs the suite.
# Torch is pinned to the CPU wheel so a fresh machine does not pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -c scripts/constraints-cpu.txt -e '.[test]'
python3 -m pytest -q "$@"
