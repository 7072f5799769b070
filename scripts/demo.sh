#!/usr/bin/env bash
# The README's first command: the main job, for real, on this machine.
#
#   bash scripts/demo.sh [--engine vllm|sglang] [--drafter eagle3|mtp]
#
# vllm (default): builds (once, cached) the vLLM CPU venv (scripts/vllm-venv.sh), serves the
# tiny world on vLLM with the speculators drafter exported the way a parameters-only export
# writes it: `d2t` and `t2d` are buffers, not parameters, so the export drops them. vLLM's
# Eagle3LlamaForCausalLM.load_weights then skips `draft_id_to_target_id` without a word and
# keeps it all zeros: draft id i is proposed as target id i (no vocab map). The demo records
# it with `hstrace record --server-cmd ...`, replays the trace against the training dumps and
# prints the verdict, the fix and what the fix is worth (expected accept length as served vs
# fixed). Exit code = replay's: 1 (a fault was found).
# Where vLLM CPU cannot run (not x86-64 Linux) it says so in one line and replays the bundled
# trace traces/examples/vocab-map-missing.zarr (the same fault, recorded on the reference
# engine) instead.
#
# sglang: the real SGLang 0.5.23 server on CPU (scripts/sglang-venv.sh, HSTRACE_SGLANG_CPU=1)
# with the speculators drafter converted to SGLang's layout: aux-layer-shift (demo_sglang).
#
# --drafter mtp (vLLM only): serves the MTP world (traces/mtp-world: a MiMo target with one MTP
# layer) with `"method": "mtp"`, records it and replays it against the tensors the head was
# trained on: no-wiring-fault, exit 0 (demo_vllm_mtp).
#
# Engines: each is a `demo_<name>` function below; add one to support another engine.
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=vllm
while [[ $# -gt 0 ]]; do
  case "$1" in
    --engine) ENGINE="${2:?--engine needs a name}"; shift 2 ;;
    --engine=*) ENGINE="${1#--engine=}"; shift ;;
    --drafter) DRAFTER="${2:?--drafter needs eagle3 or mtp}"; shift 2 ;;
    --drafter=*) DRAFTER="${1#--drafter=}"; shift ;;
    *) echo "hstrace demo: error: unknown argument $1 (usage: scripts/demo.sh [--engine vllm|sglang] [--drafter eagle3|mtp])" >&2; exit 2 ;;
  esac
done
case "${DRAFTER:=eagle3}" in
  eagle3) ;;
  mtp) [[ "$ENGINE" == vllm ]] || { echo "hstrace demo: error: --drafter mtp runs on vLLM only (SGLang's CPU path cannot serve the MTP world yet)" >&2; exit 2; }
       ENGINE=vllm_mtp ;;
  *) echo "hstrace demo: error: unknown drafter $DRAFTER (have: eagle3 mtp)" >&2; exit 2 ;;
esac
TRAINING=traces/tiny-world/training-speculators
SAMPLES="${HSTRACE_DEMO_SAMPLES:-8}"

bundled() {  # replay a committed example trace with whatever Python has hstrace
  local py="$1" example="$2"
  "$py" -m hstrace replay "traces/examples/$example" --against "$TRAINING"
}

demo_vllm() {
  if [[ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]]; then
    echo "vLLM's CPU build runs on x86-64 Linux only (this is $(uname -s) $(uname -m)): replaying the bundled trace traces/examples/vocab-map-missing.zarr instead" >&2
    python3 -m pip install -q -c scripts/constraints-cpu.txt -e '.[reference,training]' >&2
    bundled python3 vocab-map-missing.zarr
    return
  fi
  local py work out port drafter spec
  py="$(bash scripts/vllm-venv.sh | tail -1)"
  work="$(mktemp -d "${TMPDIR:-/tmp}/hstrace-demo.XXXXXX")"
  out="$work/demo.zarr" drafter="$work/drafter-speculators-params-only"
  port="${HSTRACE_DEMO_PORT:-18400}"
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" HF_HUB_OFFLINE=1
  export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$HOME/.cache/hstrace/vllm-cache}"
  # The user's export: the same config, the weights without the buffers d2t / t2d.
  cp -r traces/tiny-world/drafter-speculators "$drafter"
  "$py" -c "import sys; from safetensors.torch import load_file, save_file; f = sys.argv[1]; save_file({k: v for k, v in load_file(f).items() if k not in ('d2t', 't2d')}, f, metadata={'format': 'pt'})" \
    "$drafter/model.safetensors"
  spec="{\"method\": \"eagle3\", \"model\": \"$drafter\", \"num_speculative_tokens\": 3}"
  echo "serving the tiny world on vLLM (CPU) with the speculators drafter exported without d2t/t2d, recording $SAMPLES training samples into $out" >&2
  "$py" -m hstrace record \
    --server-cmd "$py -m vllm.entrypoints.openai.api_server --model traces/tiny-world/target --speculative-config '$spec' --host 127.0.0.1 --port $port --max-model-len 512 --dtype float32" \
    --prompts-from "$TRAINING" --samples "$SAMPLES" --out "$out"
  "$py" -m hstrace replay "$out" --against "$TRAINING"
}

demo_sglang() {
  # SGLang 0.5.23 on CPU: the real server with hstrace's CPU shim (HSTRACE_SGLANG_CPU=1, test and
  # demo only: hooks/sglang_cpu_shim.py stands in for CUDA/Triton-only kernels). It serves the
  # speculators drafter converted to SGLang's layout with its aux ids copied verbatim (SGLang
  # cannot read speculators' nested config): ids [2, 4, 5] mean "before layer k" there, SGLang
  # adds 1, so it captures layers one higher than training: aux-layer-shift, with SGLang's fix.
  if [[ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]]; then
    echo "the SGLang CPU demo runs on x86-64 Linux only (this is $(uname -s) $(uname -m)): replaying the bundled trace traces/examples/aux-layer-shift.zarr instead" >&2
    python3 -m pip install -q -c scripts/constraints-cpu.txt -e '.[reference,training]' >&2
    bundled python3 aux-layer-shift.zarr
    return
  fi
  local py work out port drafter
  py="$(bash scripts/sglang-venv.sh | tail -1)"
  work="$(mktemp -d "${TMPDIR:-/tmp}/hstrace-demo.XXXXXX")"
  out="$work/demo.zarr" drafter="$work/drafter-speculators-sglang-layout"
  port="${HSTRACE_DEMO_PORT:-18401}"
  "$py" -c "import sys; from hstrace.drafter import load_drafter, save_drafter; save_drafter(load_drafter(sys.argv[1])[0], sys.argv[2], dialect='specforge')" \
    traces/tiny-world/drafter-speculators "$drafter"
  export HSTRACE_SGLANG_CPU=1 HF_HUB_OFFLINE=1
  echo "serving the tiny world on SGLang (CPU) with the speculators drafter in SGLang's layout, recording $SAMPLES training samples into $out" >&2
  "$py" -m hstrace record \
    --server-cmd "$py -m sglang.launch_server --model-path traces/tiny-world/target --speculative-algorithm EAGLE3 --speculative-draft-model-path $drafter --speculative-eagle-topk 1 --speculative-num-steps 3 --speculative-num-draft-tokens 4 --device cpu --attention-backend torch_native --dtype bfloat16 --disable-cuda-graph --mem-fraction-static 0.15 --max-total-tokens 32768 --host 127.0.0.1 --port $port" \
    --prompts-from "$TRAINING" --samples "$SAMPLES" --out "$out"
  "$py" -m hstrace replay "$out" --against "$TRAINING" --target traces/tiny-world/target
}

demo_vllm_mtp() {
  if [[ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]]; then
    echo "hstrace demo: error: vLLM's CPU build runs on x86-64 Linux only (this is $(uname -s) $(uname -m)); the MTP demo has no bundled trace" >&2
    exit 2
  fi
  local py out port spec training=traces/mtp-world/training
  py="$(bash scripts/vllm-venv.sh | tail -1)"
  out="$(mktemp -d "${TMPDIR:-/tmp}/hstrace-demo.XXXXXX")/demo-mtp.zarr"
  port="${HSTRACE_DEMO_PORT:-18400}"
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" HF_HUB_OFFLINE=1
  export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$HOME/.cache/hstrace/vllm-cache}"
  spec='{"method": "mtp", "num_speculative_tokens": 2}'
  echo "serving the MTP world on vLLM (CPU) with its MTP head (method mtp), recording $SAMPLES training samples into $out" >&2
  "$py" -m hstrace record \
    --server-cmd "$py -m vllm.entrypoints.openai.api_server --model traces/mtp-world/target --speculative-config '$spec' --host 127.0.0.1 --port $port --max-model-len 512 --dtype float32 --enforce-eager" \
    --prompts-from "$training" --samples "$SAMPLES" --out "$out"
  "$py" -m hstrace replay "$out" --against "$training"
}

if ! declare -F "demo_$ENGINE" >/dev/null; then
  echo "hstrace demo: error: no demo for engine $ENGINE (have: $(declare -F | awk '/demo_/{sub("demo_","",$3); printf "%s ", $3}'))" >&2
  exit 2
fi
"demo_$ENGINE"
