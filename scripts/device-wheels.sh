#!/usr/bin/env bash
# The wheels hstrace's trace store needs on the lent CUDA machine (its image has torch, numpy,
# click, rich, safetensors, packaging, pyyaml; not zarr and numcodecs), for its Python 3.12,
# saved to .whl/ (git-ignored) for `device run` with carry [".whl"]. Run here, once.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
v() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
for pkg in "zarr==$(v zarr)" "numcodecs==$(v numcodecs)" "google-crc32c==$(v google-crc32c)" "donfig==$(v donfig)"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$pkg"
done
ls -la .whl
