"""The SGLang adapter: the shared server launcher (hstrace.engines.server) with SGLang's client.

What differs from vLLM: `/generate` with the token ids as `input_ids` (or `text`), SGLang's own
per-request spec metrics from `meta_info`, the `SGLANG_SIMULATE_*` switches recorded from the
environment, and the stop (SIGTERM to the main process alone: see `ServerEngine._shutdown`).
This process never imports SGLang.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, ClassVar

from hstrace.engines.base import Prompt, RecordOptions, RecordResult
from hstrace.engines.server import ServerEngine, ServeUntil, post_json
from hstrace.engines.sglang.versions import SUPPORT
from hstrace.errors import EngineError

SPEC_METRIC_KEYS = (
    "completion_tokens",
    "prompt_tokens",
    "spec_verify_ct",
    "spec_accept_length",
    "spec_accept_rate",
    "spec_num_correct_drafts",
    "spec_num_proposed_drafts",
    "cached_tokens",  # prompt tokens served from the radix cache (cf. requests.n_cached)
)


# `Prompt.sampling_for` names -> SGLang's native `sampling_params` names where they differ
NATIVE_NAMES = {
    "max_tokens": "max_new_tokens",
    "seed": "sampling_seed",
    "min_tokens": "min_new_tokens",
}


class SGLangEngine(ServerEngine):
    name = "sglang"
    support = SUPPORT
    default_port = 30000
    # SGLANG_SIMULATE_ACC_LEN / _METHOD: every accept number of such a run is simulated
    env_prefixes = ("SGLANG_SIMULATE_",)
    # SIGTERM to SGLang's main process alone is its graceful stop: the tokenizer manager sends
    # every scheduler a ShutdownReq, they leave their event loop and exit normally, so the
    # trace writers close cleanly (atexit). A signal to the whole group instead kills the
    # schedulers mid-loop (their parent-death SIGKILL): the trace keeps only committed steps.
    stop_group_at_once: ClassVar[bool] = False
    # finished requests (`record --serve --requests N`): exported only with --enable-metrics
    finished_counter: ClassVar[str | None] = "sglang:num_requests_total"

    def serve(self, out: Path, options: RecordOptions, until: ServeUntil) -> RecordResult:
        if until.requests is not None and "--enable-metrics" not in self._argv():
            raise EngineError(
                "--requests counts SGLang's finished requests from its /metrics: add "
                "--enable-metrics to --server-cmd, or use --duration"
            )
        return super().serve(out, options, until)

    def _send_one(
        self, proc: subprocess.Popen, base: str, i: int, prompt: Prompt, options: RecordOptions
    ) -> dict[str, Any] | str:
        rid = f"hstrace-{i}"
        sampling = prompt.sampling_for(options.max_new_tokens)
        if prompt.messages is not None:  # the OpenAI chat API: SGLang applies the template
            body = {
                "model": "default",
                "messages": [{"role": r, "content": c} for r, c in prompt.messages],
                "rid": rid,
                **sampling,
            }
            reply = post_json(proc, base + "/v1/chat/completions", body, i, {})
            if isinstance(reply, str):
                return reply
            return {"rid": rid, "source_id": prompt.source_id, "usage": reply.get("usage")}
        # the native API's names (SGLang SamplingParams)
        native = {NATIVE_NAMES.get(k, k): v for k, v in sampling.items()}
        body = {"rid": rid, "sampling_params": native}
        if prompt.input_ids is not None:
            body["input_ids"] = list(prompt.input_ids)
        else:
            body["text"] = prompt.text
        reply = post_json(proc, base + "/generate", body, i, {})
        if isinstance(reply, str):
            return reply
        meta = reply.get("meta_info", {})
        return {
            "rid": rid,
            "source_id": prompt.source_id,
            "output_ids": reply.get("output_ids"),  # greedy parity (`record --parity`)
            **{k: meta[k] for k in SPEC_METRIC_KEYS if k in meta},
        }
