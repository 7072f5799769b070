#!/usr/bin/env bash
# The Python source of one vLLM release, read, never imported: downloads the wheel --no-deps
# into ~/.cache/hstrace/wheel-src/vllm-VERSION/ (the CUDA wheel is ~336 MB; no GPU needed) and
# unzips only vllm/**/*.py. Cached with a ready-stamp. Prints the source root (the directory
# holding vllm/) on its last line, for `python -m hstrace.engines.vllm.srccheck ROOT VERSION`.
set -euo pipefail
if [[ $# -ne 1 || ! "$1" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "usage: $0 VERSION   (e.g. 0.33.0)" >&2
  exit 2
fi
VERSION="$1"
DIR="${HSTRACE_WHEEL_SRC:-$HOME/.cache/hstrace/wheel-src}/vllm-$VERSION"
PY="${PYTHON:-python3}"
STAMP="$DIR/.hstrace-src-ready-v1"
if [[ ! -f "$STAMP" ]]; then
  mkdir -p "$DIR/dl"
  if ! ls "$DIR"/dl/vllm-"$VERSION"-*.whl >/dev/null 2>&1; then
    echo "downloading vllm==$VERSION --no-deps into $DIR/dl (a few hundred MB)" >&2
    "$PY" -m pip download -q --no-deps --only-binary=:all: "vllm==$VERSION" -d "$DIR/dl" >&2
  fi
  rm -rf "$DIR/src"
  "$PY" - "$DIR" <<'PYEOF'
import sys, zipfile, pathlib
d = pathlib.Path(sys.argv[1])
wheel = sorted((d / "dl").glob("vllm-*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")]
    for n in names:
        z.extract(n, d / "src")
print(f"{len(names)} .py files from {wheel.name}", file=sys.stderr)
PYEOF
  touch "$STAMP"
fi
echo "$DIR/src"
