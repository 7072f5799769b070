#!/usr/bin/env bash
# End-to-end on a CUDA machine with SGLang: tiny world -> EAGLE-3 serving -> hstrace record ->
# hstrace replay, and the recording overhead as tokens/s with and without hooks, side by side.
#
#   bash bench/gpu_e2e.sh [WORKDIR]        (default: a fresh temp dir; kept, path printed)
#
# Env: PYTHON (the SGLang env's python with hstrace installed; default python3), SAMPLES (16),
# MAX_NEW_TOKENS (64), ROUNDS (3: baseline/recorded runs alternate, so drift hits both),
# PORT (30310). Exit 2 when there is no CUDA or no supported SGLang; 1 when a step fails.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
SAMPLES="${SAMPLES:-16}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-64}"
ROUNDS="${ROUNDS:-3}"
PORT="${PORT:-30310}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-$(mktemp -d -t hstrace-gpu-e2e-XXXXXX)}"
mkdir -p "$WORK"

die() { echo "gpu_e2e: error: $1" >&2; exit "${2:-1}"; }

# ---- preconditions: fail clearly, before building anything ----------------------------------
command -v "$PYTHON" >/dev/null 2>&1 || die "no $PYTHON on PATH (set PYTHON=...)" 2
command -v nvidia-smi >/dev/null 2>&1 || die "no nvidia-smi: this benchmark needs a CUDA GPU" 2
"$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || die "torch in $PYTHON sees no CUDA device" 2
SGLANG_VERSION="$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null)" \
  || die "SGLang is not installed for $PYTHON" 2
"$PYTHON" -c "from hstrace.engines.sglang.versions import check_supported_version as c; c('$SGLANG_VERSION')" \
  || die "SGLang $SGLANG_VERSION has no hstrace patch table" 2
[[ -f "$REPO/traces/tiny-world/build.py" ]] || die "traces/tiny-world/build.py is missing" 2
echo "gpu_e2e: sglang $SGLANG_VERSION, work dir $WORK" >&2

# ---- 1. the tiny world (target, drafters, training dumps) -----------------------------------
TW="$WORK/tiny-world"
if [[ ! -f "$TW/MANIFEST.json" ]]; then
  "$PYTHON" "$REPO/traces/tiny-world/build.py" --out "$TW" >&2 || die "tiny world build failed"
fi
TARGET="$TW/target"
DRAFTER="$TW/drafter-specforge"   # SGLang's own EAGLE-3 layout (eagle_config aux ids)
TRAINING="$TW/training-specforge"
for d in "$TARGET" "$DRAFTER" "$TRAINING"; do [[ -d "$d" ]] || die "tiny world lacks $d"; done

SERVER_CMD="$PYTHON -m sglang.launch_server --model-path $TARGET --host 127.0.0.1 --port $PORT \
--dtype bfloat16 --skip-tokenizer-init --speculative-algorithm EAGLE3 \
--speculative-draft-model-path $DRAFTER --speculative-num-steps 3 --speculative-eagle-topk 1 \
--speculative-num-draft-tokens 4 --mem-fraction-static 0.3"

# ---- 2. record with training prompts, and the side-by-side baseline -------------------------
# Both arms go through the same launcher and client (hstrace.engines.sglang); the baseline arm
# starts the server without hooks. Only the prompt-sending phase is timed (no startup).
"$PYTHON" - "$WORK" "$TRAINING" "$SAMPLES" "$MAX_NEW_TOKENS" "$ROUNDS" "$SERVER_CMD" <<'PY' || die "serving failed"
import json, sys
from pathlib import Path
from hstrace.cli.record import load_prompts_from_training
from hstrace.engines import EngineConfig, RecordOptions, get_engine

work, training, samples, max_new, rounds, server_cmd = sys.argv[1:]
prompts = load_prompts_from_training(Path(training), int(samples))
opts = RecordOptions(max_new_tokens=int(max_new), show_progress=False)
rows = []
for r in range(int(rounds)):
    for arm in ("baseline", "recorded"):
        engine = get_engine("sglang", EngineConfig(server_cmd=server_cmd, extra={"baseline": arm == "baseline"}))
        engine.check_supported()
        out = Path(work) / f"{arm}-{r}.zarr"
        res = engine.record(prompts, out, opts)
        if not res.ok:
            sys.exit(f"{arm} round {r}: {res.error}")
        tokens = sum(m.get("completion_tokens", 0) for m in res.request_metrics)
        rows.append({"arm": arm, "round": r, "tokens": tokens, "wall_s": res.send_wall_s,
                     "tok_per_s": tokens / res.send_wall_s, "trace": str(out)})
        print(f"{arm:9s} round {r}: {tokens} tokens in {res.send_wall_s:.2f} s = "
              f"{tokens / res.send_wall_s:.1f} tok/s", file=sys.stderr)
(Path(work) / "overhead.json").write_text(json.dumps(rows, indent=1))
PY

# ---- 3. replay the first recorded trace against the training dumps ---------------------------
TRACE="$WORK/recorded-0.zarr"
set +e
"$PYTHON" -m hstrace replay "$TRACE" --against "$TRAINING" --drafter "$DRAFTER" --target "$TARGET" \
  --markdown "$WORK/replay.md"
REPLAY_RC=$?
set -e
[[ $REPLAY_RC -le 1 ]] || die "hstrace replay failed (exit $REPLAY_RC)"

# ---- 4. the overhead table -------------------------------------------------------------------
"$PYTHON" - "$WORK/overhead.json" <<'PY'
import json, statistics, sys
rows = json.load(open(sys.argv[1]))
med = {a: statistics.median(r["tok_per_s"] for r in rows if r["arm"] == a) for a in ("baseline", "recorded")}
print("| arm | tokens/s (median) | runs |\n| --- | --- | --- |")
for a in ("baseline", "recorded"):
    print(f"| {a} | {med[a]:.1f} | {sum(r['arm'] == a for r in rows)} |")
print(f"\nrecorded / baseline = {med['recorded'] / med['baseline']:.3f} "
      f"(overhead {100 * (1 - med['recorded'] / med['baseline']):.1f} %)")
PY
echo "gpu_e2e: replay exit $REPLAY_RC (0 = no fault, 1 = fault found), report $WORK/replay.md" >&2
