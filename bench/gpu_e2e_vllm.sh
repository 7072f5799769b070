#!/usr/bin/env bash
# End-to-end on a CUDA machine with vLLM 0.33: the tiny world served with EAGLE-3 twice, on
# Model Runner V2 (`hstrace record --runner v2`) and on the V1 runner (hstrace's default there:
# VLLM_USE_V2_MODEL_RUNNER=0), the same prompts; each trace replayed against the training
# dumps; then the two compared (verdicts, per-request acceptance, tokens out).
#
#   bash bench/gpu_e2e_vllm.sh [WORKDIR]   (default: a fresh temp dir; kept, path printed)
#
# Env: PYTHON (the vLLM env's python with hstrace installed; default python3), SAMPLES (8),
# MAX_NEW_TOKENS (32), PORT (18500). Exit 2 when there is no CUDA or no vLLM 0.33; 1 when a
# step fails or the runners disagree on what they served.
# NOT RUN by hstrace's authors: the machine this was written on has no GPU (README: Known
# limits). Its V2 taps are row-tested on stand-in tensors only (tests/test_vllm_taps_v2.py).
set -euo pipefail

PYTHON="${PYTHON:-python3}"
SAMPLES="${SAMPLES:-8}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-32}"
PORT="${PORT:-18500}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

die() { echo "gpu_e2e_vllm: error: $1" >&2; exit "${2:-1}"; }

# ---- preconditions: fail at once, before building anything -----------------------------------
command -v "$PYTHON" >/dev/null 2>&1 || die "no $PYTHON on PATH (set PYTHON=...)" 2
command -v nvidia-smi >/dev/null 2>&1 || die "no nvidia-smi: this script needs a CUDA GPU" 2
"$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null \
  || die "torch in $PYTHON sees no CUDA device" 2
VLLM_VERSION="$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null)" \
  || die "vLLM is not installed for $PYTHON" 2
[[ "$VLLM_VERSION" == 0.33.* ]] || die "needs vLLM 0.33 (Model Runner V2); $PYTHON has $VLLM_VERSION" 2
"$PYTHON" -c "from hstrace.engines.vllm.versions import SUPPORT; SUPPORT.check_supported_version('$VLLM_VERSION')" \
  || die "vLLM $VLLM_VERSION has no hstrace patch table" 2
[[ -f "$REPO/traces/tiny-world/build.py" ]] || die "traces/tiny-world/build.py is missing" 2
WORK="${1:-$(mktemp -d -t hstrace-gpu-e2e-vllm-XXXXXX)}"
mkdir -p "$WORK"
echo "gpu_e2e_vllm: vllm $VLLM_VERSION, work dir $WORK" >&2

# ---- 1. the tiny world ------------------------------------------------------------------------
TW="$WORK/tiny-world"
if [[ ! -f "$TW/MANIFEST.json" ]]; then
  "$PYTHON" "$REPO/traces/tiny-world/build.py" --out "$TW" >&2 || die "tiny world build failed"
fi
TARGET="$TW/target"
DRAFTER="$TW/drafter-speculators"   # vLLM's EAGLE-3 layout (top-level aux ids)
TRAINING="$TW/training-speculators"
for d in "$TARGET" "$DRAFTER" "$TRAINING"; do [[ -d "$d" ]] || die "tiny world lacks $d"; done

SPEC="{\"method\": \"eagle3\", \"model\": \"$DRAFTER\", \"num_speculative_tokens\": 3}"
# --enforce-eager: the drafter's Python forward runs each step (a replayed CUDA graph would
# bypass the draft taps); prefix caching off so every prompt runs its full prefill
SERVER_CMD="$PYTHON -m vllm.entrypoints.openai.api_server --model $TARGET \
--speculative-config '$SPEC' --host 127.0.0.1 --port $PORT --max-model-len 512 \
--dtype float32 --enforce-eager --no-enable-prefix-caching --gpu-memory-utilization 0.3"

# ---- 2. record on V2 and on V1, the same prompts; replay each --------------------------------
declare -A RC
for runner in v2 v1; do
  unset VLLM_USE_V2_MODEL_RUNNER
  "$PYTHON" -m hstrace record --engine vllm --runner "$runner" --server-cmd "$SERVER_CMD" \
    --prompts-from "$TRAINING" --samples "$SAMPLES" --max-new-tokens "$MAX_NEW_TOKENS" \
    --out "$WORK/$runner.zarr" || die "record on $runner failed"
  set +e
  "$PYTHON" -m hstrace replay "$WORK/$runner.zarr" --against "$TRAINING" --drafter "$DRAFTER" \
    --target "$TARGET" --json > "$WORK/replay-$runner.json"
  RC[$runner]=$?
  set -e
  [[ ${RC[$runner]} -le 1 ]] || die "hstrace replay of the $runner trace failed (exit ${RC[$runner]})"
done

# ---- 3. compare -------------------------------------------------------------------------------
"$PYTHON" - "$WORK" <<'PY'
import json, sys
from pathlib import Path
from hstrace.trace import open_trace

work = Path(sys.argv[1])
out = {}
for runner in ("v2", "v1"):
    doc = json.loads((work / f"replay-{runner}.json").read_text())
    meta = open_trace(work / f"{runner}.zarr").meta
    out[runner] = {
        "runner_recorded": (meta.get("static") or {}).get("vllm_runner", {}).get("runner"),
        "engine_runner": doc["inputs"].get("engine_runner"),
        "verdict": doc["verdict"]["code"],
        "coverage": doc.get("coverage"),
        "metrics": {k: doc["metrics"].get(k) for k in ("accept_len", "mean_accept_len") if k in doc["metrics"]},
    }
(work / "compare.json").write_text(json.dumps(out, indent=1, default=str))
print(json.dumps(out, indent=1, default=str))
bad = [r for r in ("v2", "v1") if out[r]["runner_recorded"] != r]
if bad:
    sys.exit(f"the trace of {bad} does not record the runner it was asked for")
if out["v2"]["verdict"] != out["v1"]["verdict"]:
    sys.exit(f"verdicts differ: V2 {out['v2']['verdict']}, V1 {out['v1']['verdict']}")
print("gpu_e2e_vllm: V2 and V1 give the same verdict", file=sys.stderr)
PY
echo "gpu_e2e_vllm: done; replays (exit v2 ${RC[v2]}, v1 ${RC[v1]}) and compare.json in $WORK" >&2
