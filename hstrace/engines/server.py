"""The launcher every HTTP-serving engine shares (SGLang, vLLM): `ServerEngine`.

The launcher side only (this process never imports an engine): ask the server's Python which
version it has, create the trace, start the user's server command with `HSTRACE_RECORD` and a
generated `sitecustomize` on PYTHONPATH, wait for health, send the prompts, shut the server
down, and say in the trace how it ended (merging what the hooks left in the status file).

A subclass says only what differs (class attributes and three small methods): its name and
`EngineSupport` (versions, distributions), its default port, its client (`_send_one`: one
prompt as that engine's HTTP API takes it), what else goes into the trace's `record`, and
whether its recording processes close their traces on a signal before the server stops.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from hstrace.engines.base import Engine, Prompt, RecordOptions, RecordResult
from hstrace.engines.support import EngineSupport, UntestedVersion
from hstrace.errors import EngineError


def server_address(argv: Sequence[str], default_port: int = 30000) -> tuple[str, int]:
    def value(flag: str) -> str | None:
        for i, a in enumerate(argv):
            if a == flag and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
        return None

    host = value("--host") or "127.0.0.1"
    port = int(value("--port") or default_port)
    return ("127.0.0.1" if host in ("0.0.0.0", "::") else host), port


def last_error_lines(log: str, n: int = 8) -> str:
    lines = [ln for ln in log.splitlines() if ln.strip()]
    keys = ("Error", "error", "Traceback", "Exception", "hstrace:")
    hits = [i for i, ln in enumerate(lines) if any(k in ln for k in keys)]
    tail = lines[hits[-1] - n + 1 : hits[-1] + 1] if hits else lines[-n:]
    return " | ".join(ln.strip() for ln in tail)


# What a server prints before each line: `(EngineCore pid=12) ` (vLLM's per-process prefix,
# possibly nested), then a log record's head: vLLM `ERROR 12-02 17:00:00 [core.py:1510] `,
# SGLang `[2026-12-02 17:00:00 TP0] `, or plain logging's `ERROR:name:`.
_PROCESS = re.compile(r"^(?:\([^()]*pid=\d+[^()]*\)\s?)+")
_RECORD = re.compile(
    r"^(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+"
    r"\[[^\]]*\]\s?|\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[^\]]*\]\s?|"
    r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):[\w.]*:)"
)
# `ValueError: ...`, `torch.OutOfMemoryError: ...`, `Exception: ...`: the last line of a
# traceback, which names what was raised.
_RAISED = re.compile(
    r"^((?:[A-Za-z_]\w*\.)*(?:[A-Z]\w*(?:Error|Exception|Exit|Interrupt)|Exception))(?::\s*(.*))?$"
)
# Lines that only point elsewhere ("see above"): the wrappers vLLM and SGLang raise after the
# real error (vLLM 0.32.0: engine/utils.py, executor/multiproc_executor.py, engine/core.py).
_WRAPPERS = (
    "see root cause above",
    "see stack trace for root cause",
    "see stack trace (above) for the root cause",
    "see the root cause above",
    "initialization failed due to an exception in a background process",
    "engine core initialization failed",
    "enginecore encountered an issue",
    "enginedeaderror",
)


def _record_text(line: str) -> str:
    """A server's log line without its process prefix and log-record head."""
    text = _PROCESS.sub("", line.rstrip())
    return _RECORD.sub("", text)


def root_cause(log: str) -> str | None:
    """The first real error a server printed: the first `Type: message` line that ends a
    traceback (or an `hstrace:` line of the hooks), skipping the frames and the wrappers that
    only say "see root cause above". None when the log names no error."""
    for line in log.splitlines():
        text = _record_text(line)
        if not text or text[0].isspace():  # a traceback's frame or source line
            continue
        if text.startswith("hstrace:"):
            return text.strip()
        m = _RAISED.match(text)
        if m is None or not m.group(2):
            continue
        if any(w in text.lower() for w in _WRAPPERS):
            continue
        return f"{m.group(1)}: {' '.join(m.group(2).split())}"[:1000]
    return None


def server_failure(error: str, log: str, log_path: Path) -> str:
    """Why the server run failed, in one line: `error`, the server's root cause (or its last
    lines, when it names none), and where its whole log is."""
    cause = root_cause(log)
    said = f"root cause: {cause}" if cause else f"the server's last lines: {last_error_lines(log)}"
    return f"{error}: {said} (the server's whole log: {log_path})"


def version_probe(distributions: Sequence[str]) -> str:
    """Python source that prints the first installed distribution's version (exit 3: none)."""
    return (
        "import importlib.metadata as m\n"
        f"for d in {tuple(distributions)!r}:\n"
        "    try:\n"
        "        print(m.version(d)); break\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
        "else:\n"
        "    raise SystemExit(3)\n"
    )


def post_json(
    proc: subprocess.Popen, url: str, body: dict[str, Any], i: int, headers: dict[str, str]
) -> dict[str, Any] | str:
    """POST one prompt; the reply, or the one-line reason it failed (the server died, HTTP
    error with the server's own words, connection error)."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
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
    return reply if isinstance(reply, dict) else {}


def status_entries(status: Path | None) -> list[dict[str, Any]]:
    """The status file the hooks append to (one JSON object a line; torn lines skipped)."""
    if status is None or not status.exists():
        return []
    out = []
    for line in status.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def close_traces(status: Path | None, out: Path | None, timeout_s: float = 60.0) -> list[int]:
    """Ask every recording process (those that announced it in the status file) to close its
    trace, and wait until each rank's commit record says clean_close. Returns the ranks that
    did not close in time (their committed prefix stays readable)."""
    if status is None or out is None:
        return []
    ranks: dict[int, int] = {}
    for entry in status_entries(status):
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


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float) -> str | None:
    """Poll `base`/health until it answers 200: None, or why not (the server exited, or the
    time ran out)."""
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


def stop_server(proc: subprocess.Popen, group_at_once: bool = False, wait_s: float = 90) -> None:
    """Stop a server started in its own session: SIGTERM to its main process (the engine's own
    graceful stop; `group_at_once`: SIGINT to the whole group), then, once it ended or after
    `wait_s`, SIGKILL to whatever of the group lingers."""
    if proc.poll() is None:
        if group_at_once:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait()


def count_metric(text: str, name: str) -> int | None:
    """A Prometheus counter's value summed over its label sets (`name{...} value` lines; the
    `_created` timestamps are other names); None when the text has no such line."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0].strip() != name:
            continue
        try:
            total += float(value)
        except ValueError:
            continue
        seen = True
    return int(total) if seen else None


@dataclass(frozen=True)
class ServeUntil:
    """When `record --serve` stops: after `requests` finished requests, `duration_s` seconds,
    or a signal (SIGINT / SIGTERM), whichever comes first. Pure: the loop asks `reason`."""

    requests: int | None = None
    duration_s: float | None = None
    poll_s: float = 0.5
    # after the N-th request finished: seconds left for its reply to reach the client
    grace_s: float = 1.0

    def reason(self, finished: int | None, elapsed_s: float, signals: Sequence[str]) -> str | None:
        """Why to stop now, or None to keep recording."""
        if signals:
            return f"{signals[0]} received"
        if self.requests is not None and finished is not None and finished >= self.requests:
            return f"{finished} requests finished (--requests {self.requests})"
        if self.duration_s is not None and elapsed_s >= self.duration_s:
            return f"{self.duration_s:g} s passed (--duration)"
        return None


class ServerEngine(Engine):
    """An engine run as the user's HTTP server command, hooked through HSTRACE_RECORD."""

    support: ClassVar[EngineSupport]
    default_port: ClassVar[int] = 30000
    # the engine's own environment switches recorded in static (they change what it serves)
    env_prefixes: ClassVar[tuple[str, ...]] = ()
    # the hooks close each recording process's trace on CLOSE_SIGNAL, and the launcher sends
    # it before stopping the server (engines that SIGKILL their workers at shutdown)
    close_on_signal: ClassVar[bool] = False
    # True: stop by SIGINT to the whole process group; False: SIGTERM to the main process only
    stop_group_at_once: ClassVar[bool] = False
    # the engine's Prometheus counter of finished requests (`record --serve --requests N`)
    finished_counter: ClassVar[str | None] = None

    @property
    def label(self) -> str:
        return self.support.label

    def check_supported(self) -> str:
        """Version of the engine the server command will run. The server's own Python decides;
        we ask it when the command starts with a Python interpreter, else the hooks refuse
        inside the server before it takes traffic."""
        argv = self._argv()
        python = argv[0] if "python" in Path(argv[0]).name else sys.executable
        try:
            probe = subprocess.run(
                [python, "-c", version_probe(self.support.distributions)],
                capture_output=True,
                text=True,
                timeout=120,
            )
        except OSError as exc:
            raise EngineError(f"cannot run {python} (from --server-cmd): {exc.strerror}") from exc
        if probe.returncode != 0:
            raise EngineError(
                f"{self.label} is not installed for {python} (needed by --server-cmd)"
            )
        self.version = probe.stdout.strip()
        try:
            self.support.check_supported_version(self.version)
        except UntestedVersion:
            # the versions policy: an untested release is recorded when its source matches
            # every patch point and attribute the hooks use (else refused naming the point)
            root = self._source_root(python, self.version)
            self.version_check = self.support.check_source(self.version, root)
            print(self.version_check["warning"], file=sys.stderr, flush=True)
        return self.version

    def _source_root(self, python: str, version: str) -> Path:
        """The directory holding the engine's package in the server's Python, found without
        importing it (`importlib.util.find_spec` of a top-level package runs none of its
        code)."""
        code = (
            "import importlib.util, os\n"
            f"s = importlib.util.find_spec({self.support.package!r})\n"
            "print(os.path.dirname(os.path.dirname(s.origin)))\n"
        )
        try:
            probe = subprocess.run(
                [python, "-c", code], capture_output=True, text=True, timeout=120
            )
        except OSError as exc:
            raise EngineError(f"cannot run {python} (from --server-cmd): {exc.strerror}") from exc
        root = Path(probe.stdout.strip())
        if probe.returncode != 0 or not (root / self.support.package).is_dir():
            raise EngineError(
                f"{self.label} {version} is outside the tested table ({self.support.span}) and "
                f"its source was not found in {python} to check its patch points"
            )
        return root

    def _argv(self) -> list[str]:
        if not self.config.server_cmd:
            raise EngineError(f"the {self.name} engine needs --server-cmd")
        argv = shlex.split(self.config.server_cmd)
        if not argv:
            raise EngineError("--server-cmd is empty")
        return argv

    def record(self, prompts: Sequence[Prompt], out: Path, options: RecordOptions) -> RecordResult:
        """Start the server with the hooks, send `prompts`, stop it, close the trace."""

        def drive(proc: subprocess.Popen, base: str, result: RecordResult) -> str | None:
            return self._send(proc, base, prompts, options, result)

        return self._run(out, options, drive)

    def serve(self, out: Path, options: RecordOptions, until: ServeUntil) -> RecordResult:
        """Passive recording: start the server with the hooks, say where it listens, and record
        whatever the user's own clients send until `until` says stop (N requests finished, S
        seconds, SIGINT / SIGTERM to this process); then stop it and close the trace."""
        if until.requests is not None and self.finished_counter is None:
            raise EngineError(f"--requests needs {self.label}'s request counter; use --duration")

        def drive(proc: subprocess.Popen, base: str, result: RecordResult) -> str | None:
            return self._serve_until(proc, base, until, options, result)

        return self._run(out, options, drive)

    def _run(
        self,
        out: Path,
        options: RecordOptions,
        drive: Callable[[subprocess.Popen, str, RecordResult], str | None],
    ) -> RecordResult:
        from hstrace.engines.protocol import ENV, write_sitecustomize
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
        self._status_path, self._out_path = status, Path(out)  # for the shutdown
        env = dict(os.environ)
        env.update(self._launch_env(version))  # the engine's own switches (vLLM: its runner)
        # extra["baseline"]: the same launch and client without hooks (bench/gpu_e2e.sh's
        # side-by-side overhead measurement); the trace then holds only the run outcome.
        baseline = bool(self.config.extra.get("baseline"))
        if not baseline:
            write_sitecustomize(str(work))
        hook_cfg = {
            "out": str(Path(out).resolve()),
            "streams": sorted(options.streams),
            "on_full": options.on_full,
            "status": str(status),
            "engine": self.name,  # bootstrap installs only this engine's hooks
        }
        if self.close_on_signal:  # each recording process closes its trace on CLOSE_SIGNAL
            hook_cfg["close_on_signal"] = True
        if getattr(self, "version_check", None):  # an untested release whose source matched
            hook_cfg["source_checked"] = version
        if options.sample_every > 1:  # one request in K recorded, the others only checked
            hook_cfg["sample_every"] = options.sample_every
        env[ENV] = "" if baseline else json.dumps(hook_cfg)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(work), env.get("PYTHONPATH", "")) if p)
        log_path = work / "server.log"
        host, port = server_address(argv, self.default_port)
        base = f"http://{host}:{port}"
        result = RecordResult(
            out=Path(out),
            engine=self.name,
            engine_version=version,
            prompts_sent=0,
            prompts_completed=0,
            ok=False,
            server_log=log_path,
        )
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            try:
                error = self._wait_healthy(proc, base, options.startup_timeout_s)
                if error is None:
                    started = time.perf_counter()
                    error = drive(proc, base, result)
                    result.send_wall_s = time.perf_counter() - started
            finally:
                self._shutdown(proc)
        log_text = log_path.read_text(errors="replace")
        if error is None and proc.returncode not in (0, -signal.SIGTERM, -signal.SIGINT):
            error = f"server exited with {proc.returncode}"
        if error is not None:
            result.error = server_failure(error, log_text, log_path)
        result.ok = error is None
        self._finish_trace(out, result, status)
        return result

    def _serve_until(
        self,
        proc: subprocess.Popen,
        base: str,
        until: ServeUntil,
        options: RecordOptions,
        result: RecordResult,
    ) -> str | None:
        """Wait while the user's clients use the server; the reason to stop goes in the
        trace's `record.stopped_by`."""
        start = self.finished_requests(base) or 0
        began = time.monotonic()
        asked: list[str] = []

        def on_signal(signum: int, frame: Any) -> None:
            asked.append(signal.Signals(signum).name)

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        goal = []
        if until.requests is not None:
            goal.append(f"{until.requests} requests finished")
        if until.duration_s is not None:
            goal.append(f"{until.duration_s:g} s passed")
        goal.append("Ctrl-C / SIGTERM")
        print(
            f"hstrace: {self.label} is serving at {base} (OpenAI and native API); recording "
            f"until {' or '.join(goal)}",
            file=sys.stderr,
            flush=True,
        )
        try:
            while True:
                if proc.poll() is not None:
                    return f"the server exited (code {proc.returncode}) while recording"
                finished = None
                if until.requests is not None:
                    now = self.finished_requests(base)
                    finished = None if now is None else now - start
                reason = until.reason(finished, time.monotonic() - began, asked)
                if reason is not None:
                    result.stopped_by = reason
                    if finished is not None:
                        result.prompts_completed = finished
                    print(f"hstrace: stopping: {reason}", file=sys.stderr, flush=True)
                    if finished is not None and not asked:
                        # the engine counts a request when its last token is out of the engine
                        # core: leave the API server the moment to send it to the client
                        time.sleep(until.grace_s)
                    break
                time.sleep(until.poll_s)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if until.requests is None:  # how many the engine finished, said once at the end
            now = self.finished_requests(base)
            if now is not None:
                result.prompts_completed = now - start
        result.prompts_sent = result.prompts_completed
        self._after_send(base)
        return None

    def finished_requests(self, base: str) -> int | None:
        """Requests the engine has finished so far, from its own Prometheus counter
        (`finished_counter`, summed over its labels); None when it cannot be read."""
        if self.finished_counter is None:
            return None
        try:
            with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
                text = r.read().decode("utf-8", "replace")
        except (urllib.error.URLError, OSError):
            return None
        return count_metric(text, self.finished_counter)

    def _launch_env(self, version: str) -> dict[str, str]:
        """Environment variables the launcher sets for the server (none by default)."""
        return {}

    def _launch_static(self, version: str) -> dict[str, Any]:
        static: dict[str, Any] = {
            "engine_version": version,
            f"{self.name}_version": version,
            "server_cmd": self.config.server_cmd,
        }
        # The server inherits this environment: a switch set here (SGLANG_SIMULATE_ACC_LEN /
        # _METHOD makes every accept number fake) must reach replay even when it is not on
        # the command line.
        check = getattr(self, "version_check", None)
        if check:  # outside the tested table, recorded because its source matched
            static["version_check"] = {k: v for k, v in check.items() if k != "warning"}
        env = {k: v for k, v in os.environ.items() if k.startswith(self.env_prefixes)}
        if env and self.env_prefixes:
            static["env"] = env
        return static

    def _wait_healthy(self, proc: subprocess.Popen, base: str, timeout_s: float) -> str | None:
        return wait_healthy(proc, base, timeout_s)

    def _send(
        self,
        proc: subprocess.Popen,
        base: str,
        prompts: Sequence[Prompt],
        options: RecordOptions,
        result: RecordResult,
    ) -> str | None:
        """Send the prompts (greedy), `options.concurrency` at a time (1: one after the other;
        more: the engine batches the requests in flight together)."""
        from concurrent.futures import ThreadPoolExecutor

        from rich.progress import Progress

        error = self._before_send(base)
        if error is not None:
            return error
        width = max(1, int(getattr(options, "concurrency", 1)))
        with Progress(disable=not options.show_progress, transient=True) as progress:
            task = progress.add_task("recording", total=len(prompts))
            with ThreadPoolExecutor(width) as pool:
                for start in range(0, len(prompts), width):
                    wave = list(enumerate(prompts))[start : start + width]
                    result.prompts_sent += len(wave)
                    sent = pool.map(lambda item: self._send_one(proc, base, *item, options), wave)
                    for got in sent:
                        if isinstance(got, str):
                            return got
                        result.request_metrics.append(got)
                        result.prompts_completed += 1
                        progress.advance(task)
        self._after_send(base)
        return None

    def _before_send(self, base: str) -> str | None:
        """What the client needs to learn from the server first; an error line stops the run."""
        return None

    def _send_one(
        self, proc: subprocess.Popen, base: str, i: int, prompt: Prompt, options: RecordOptions
    ) -> dict[str, Any] | str:
        """One prompt through the engine's HTTP API: its request metrics, or an error line."""
        raise NotImplementedError

    def _after_send(self, base: str) -> None:
        """Read what the engine says about the run itself (its own counters)."""

    def _shutdown(self, proc: subprocess.Popen) -> None:
        if self.close_on_signal:
            close_traces(getattr(self, "_status_path", None), getattr(self, "_out_path", None))
        stop_server(proc, group_at_once=self.stop_group_at_once)

    def _record_extra(self, status: Path | None) -> dict[str, Any]:
        """More items for the trace's `record` (the engine's own counters, for instance)."""
        return {}

    def _finish_trace(self, out: Path, result: RecordResult, status: Path | None = None) -> None:
        """Say in the trace how the run ended (the ranks' writers close their own groups), and
        merge the static facts the engine's main process left in the status file (it has no
        writer)."""
        import zarr

        root = zarr.open_group(str(out), mode="r+")
        meta = dict(root.attrs.get("hstrace", {}))
        static = dict(meta.get("static") or {})
        entries = status_entries(status)
        for entry in entries:
            for key, value in (entry.get("static") or {}).items():
                static.setdefault(key, value)  # what the scheduler recorded itself comes first
        meta["static"] = static
        record: dict[str, Any] = {
            "ok": result.ok,
            "error": result.error,
            "prompts_sent": result.prompts_sent,
            "prompts_completed": result.prompts_completed,
            "request_metrics": result.request_metrics,
            "send_wall_s": result.send_wall_s,
            "mode": "serve" if result.stopped_by is not None else "drive",
            "stopped_by": result.stopped_by,
            "hooks": not self.config.extra.get("baseline"),
            **self._record_extra(status),
        }
        refused = [str(e["refused"]) for e in entries if e.get("refused")]
        if refused:  # the hooks stopped the server before traffic, and said why
            record["refused"] = refused
        meta["record"] = record
        root.attrs["hstrace"] = meta
