"""The SGLang adapter: runs the user's server command with hstrace's hooks and drives it.

The launcher side only (this process never imports SGLang): create the trace, start the
server with `HSTRACE_RECORD` and a generated `sitecustomize` on PYTHONPATH, wait for health,
send the prompts, collect SGLang's own per-request spec metrics, shut the server down, and say
in the trace how it ended.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hstrace.engines.base import Engine, Prompt, RecordOptions, RecordResult
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


def server_address(argv: Sequence[str]) -> tuple[str, int]:
    def value(flag: str) -> str | None:
        for i, a in enumerate(argv):
            if a == flag and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
        return None

    host = value("--host") or "127.0.0.1"
    port = int(value("--port") or 30000)
    return ("127.0.0.1" if host in ("0.0.0.0", "::") else host), port


def last_error_lines(log: str, n: int = 8) -> str:
    lines = [ln for ln in log.splitlines() if ln.strip()]
    keys = ("Error", "error", "Traceback", "Exception", "hstrace:")
    hits = [i for i, ln in enumerate(lines) if any(k in ln for k in keys)]
    tail = lines[hits[-1] - n + 1 : hits[-1] + 1] if hits else lines[-n:]
    return " | ".join(ln.strip() for ln in tail)


class SGLangEngine(Engine):
    name = "sglang"
    label = "SGLang"  # the engine's name in messages
    # what check_supported asks the server's Python (subclasses: another engine's probe)
    version_probe = "import importlib.metadata as m; print(m.version('sglang'))"

    def _check_version(self, text: str) -> None:
        from hstrace.engines.sglang_versions import check_supported_version

        check_supported_version(text)

    def check_supported(self) -> str:
        """Version of the engine the server command will run. The server's own Python decides;
        we ask it when the command starts with a Python interpreter, else the hooks refuse
        inside the server before it takes traffic."""
        argv = self._argv()
        python = argv[0] if "python" in Path(argv[0]).name else sys.executable
        try:
            probe = subprocess.run(
                [python, "-c", self.version_probe], capture_output=True, text=True, timeout=120
            )
        except OSError as exc:
            raise EngineError(f"cannot run {python} (from --server-cmd): {exc.strerror}") from exc
        if probe.returncode != 0:
            raise EngineError(
                f"{self.label} is not installed for {python} (needed by --server-cmd)"
            )
        self.version = probe.stdout.strip()
        self._check_version(self.version)
        return self.version

    def _argv(self) -> list[str]:
        if not self.config.server_cmd:
            raise EngineError(f"the {self.name} engine needs --server-cmd")
        argv = shlex.split(self.config.server_cmd)
        if not argv:
            raise EngineError("--server-cmd is empty")
        return argv

    def record(self, prompts: Sequence[Prompt], out: Path, options: RecordOptions) -> RecordResult:
        from hstrace.hooks.bootstrap import ENV, write_sitecustomize
        from hstrace.trace import create_trace

        argv = self._argv()
        version = getattr(self, "version", None) or self.check_supported()
        create_trace(
            out,
            engine={"name": self.name, "version": version},
            command_line=argv,
            static=self._launch_static(version),
        )
        work = Path(tempfile.mkdtemp(prefix="hstrace-record-"))
        status = work / "status.jsonl"
        self._status_path = status  # the hooks' side channel, for subclasses' shutdown
        env = dict(os.environ)
        # extra["baseline"]: the same launch and client without hooks (bench/gpu_e2e.sh's
        # side-by-side overhead measurement); the trace then holds only the run outcome.
        baseline = bool(self.config.extra.get("baseline"))
        if not baseline:
            write_sitecustomize(str(work))
        env[ENV] = (
            ""
            if baseline
            else json.dumps(
                {
                    "out": str(Path(out).resolve()),
                    "streams": sorted(options.streams),
                    "on_full": options.on_full,
                    "status": str(status),
                    "engine": self.name,  # bootstrap installs only this engine's hooks
                    **self._hook_options(),
                }
            )
        )
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(work), env.get("PYTHONPATH", "")) if p)
        log_path = work / "server.log"
        host, port = self._address(argv)
        base = f"http://{host}:{port}"
        result = RecordResult(
            out=Path(out),
            engine=self.name,
            engine_version=version,
            prompts_sent=0,
            prompts_completed=0,
            ok=False,
        )
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            try:
                error = self._wait_healthy(proc, base, options.startup_timeout_s)
                if error is None:
                    started = time.perf_counter()
                    error = self._send(proc, base, prompts, options, result)
                    result.send_wall_s = time.perf_counter() - started
            finally:
                self._shutdown(proc)
        log_text = log_path.read_text(errors="replace")
        if error is None and proc.returncode not in (0, -signal.SIGTERM, -signal.SIGINT):
            error = f"server exited with {proc.returncode}"
        if error is not None:
            result.error = f"{error}: {last_error_lines(log_text)}"
        result.ok = error is None
        self._finish_trace(out, result, status)
        return result

    def _launch_static(self, version: str) -> dict[str, Any]:
        static: dict[str, Any] = {
            "engine_version": version,
            "sglang_version": version,
            "server_cmd": self.config.server_cmd,
        }
        # The server inherits this environment: a simulated-acceptance switch set here
        # (SGLANG_SIMULATE_ACC_LEN / _METHOD) makes every accept number fake, and replay must
        # see it even when it is not on the command line.
        simulate = {k: v for k, v in os.environ.items() if k.startswith("SGLANG_SIMULATE_")}
        if simulate:
            static["env"] = simulate
        return static

    def _address(self, argv: Sequence[str]) -> tuple[str, int]:
        return server_address(argv)

    def _hook_options(self) -> dict[str, Any]:
        """Extra HSTRACE_RECORD keys for this engine's hooks (hooks_common.Recorder)."""
        return {}

    def _wait_healthy(self, proc: subprocess.Popen, base: str, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return f"the server exited (code {proc.returncode}) before it became healthy"
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return None
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        return f"the server was not healthy after {timeout_s:.0f} s"

    def _send(
        self,
        proc: subprocess.Popen,
        base: str,
        prompts: Sequence[Prompt],
        options: RecordOptions,
        result: RecordResult,
    ) -> str | None:
        """Send the prompts (greedy), `options.concurrency` at a time (1: one after the other;
        more: SGLang batches the requests in flight together)."""
        from concurrent.futures import ThreadPoolExecutor

        from rich.progress import Progress

        def one(i: int, prompt: Prompt) -> dict[str, Any] | str:
            rid = f"hstrace-{i}"
            body: dict[str, Any] = {
                "rid": rid,
                "sampling_params": {"max_new_tokens": options.max_new_tokens, "temperature": 0.0},
            }
            if prompt.input_ids is not None:
                body["input_ids"] = list(prompt.input_ids)
            else:
                body["text"] = prompt.text
            req = urllib.request.Request(
                base + "/generate",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(req, timeout=600) as r:
                    reply = json.loads(r.read())
            except (urllib.error.URLError, OSError) as exc:
                if proc.poll() is not None:
                    return f"the server died while serving prompt {i} (code {proc.returncode})"
                return f"prompt {i} failed: {exc}"
            meta = reply.get("meta_info", {}) if isinstance(reply, dict) else {}
            return {
                "rid": rid,
                "source_id": prompt.source_id,
                **{k: meta[k] for k in SPEC_METRIC_KEYS if k in meta},
            }

        width = max(1, int(getattr(options, "concurrency", 1)))
        with Progress(disable=not options.show_progress, transient=True) as progress:
            task = progress.add_task("recording", total=len(prompts))
            with ThreadPoolExecutor(width) as pool:
                for start in range(0, len(prompts), width):
                    wave = list(enumerate(prompts))[start : start + width]
                    result.prompts_sent += len(wave)
                    for got in pool.map(lambda item: one(*item), wave):
                        if isinstance(got, str):
                            return got
                        result.request_metrics.append(got)
                        result.prompts_completed += 1
                        progress.advance(task)
        return None

    # SIGTERM to SGLang's main process alone is its graceful stop: the tokenizer manager sends
    # every scheduler a ShutdownReq, they leave their event loop and exit normally, so the
    # trace writers close cleanly (atexit). A signal to the whole group instead kills the
    # schedulers mid-loop (their parent-death SIGKILL): the trace keeps only committed steps.
    stop_group_at_once = False

    def _shutdown(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            if self.stop_group_at_once:
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        # make sure no scheduler child lingers
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _finish_trace(self, out: Path, result: RecordResult, status: Path | None = None) -> None:
        """Say in the trace how the run ended (the ranks' writers close their own groups), and
        merge the static facts SGLang's main process left in the status file (it has no writer)."""
        import zarr

        root = zarr.open_group(str(out), mode="r+")
        meta = dict(root.attrs.get("hstrace", {}))
        static = dict(meta.get("static") or {})
        for line in status.read_text().splitlines() if status and status.exists() else []:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            for key, value in (entry.get("static") or {}).items():
                static.setdefault(key, value)  # what the scheduler recorded itself comes first
        meta["static"] = static
        meta["record"] = {
            "ok": result.ok,
            "error": result.error,
            "prompts_sent": result.prompts_sent,
            "prompts_completed": result.prompts_completed,
            "request_metrics": result.request_metrics,
            "send_wall_s": result.send_wall_s,
            "hooks": not self.config.extra.get("baseline"),
        }
        root.attrs["hstrace"] = meta
