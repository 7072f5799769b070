#!/usr/bin/env bash
# Issue 14 item 6 on a lent CUDA machine, as one short run (~3-5 min; torch with CUDA there, no
# engine, no network). Here, once: `bash scripts/device-wheels.sh` (zarr/numcodecs wheels into
# .whl/). Then the device tool: run `bash bench/gpu_item6.sh "$OUT"` with carry [".whl"].
#   1. bench/gpu_path.py: the CUDA staging path's cost per step against a 10 ms step
#   2. bench/replay.py --kimi --device cuda: step-0 replay at a Kimi-K2.5-sized drafter
#      against the matmul bound
# Each part has its own timeout; a part that fails leaves its stderr in OUTDIR and the next
# part still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${1:-${OUT:-/tmp/hstrace-gpu-item6}}"
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/hstrace-site .whl/*.whl || { echo "gpu_item6: the wheels in .whl/ did not install"; exit 1; }
  export PYTHONPATH="/tmp/hstrace-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUTDIR/nvidia-smi.csv" 2>&1
python3 -c "import torch, zarr, numcodecs; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'zarr', zarr.__version__)" \
  2>&1 | tee "$OUTDIR/env.txt"
timeout 200 python3 bench/gpu_path.py --json --steps 300 --rounds 3 >"$OUTDIR/gpu_path.json" 2>"$OUTDIR/gpu_path.err"
echo "gpu_path exit $?"
timeout 200 python3 bench/replay.py --kimi --device cuda --tokens 4096 --reps 5 --json \
  >"$OUTDIR/replay_kimi.json" 2>"$OUTDIR/replay_kimi.err"
echo "replay --kimi exit $?"
for f in "$OUTDIR"/*.err; do [[ -s "$f" ]] && { echo "== $f"; tail -c 1500 "$f"; }; done
for f in "$OUTDIR"/*.json; do echo "== $f"; head -c 3000 "$f"; echo; done
