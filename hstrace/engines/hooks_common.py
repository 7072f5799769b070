"""What every engine's hooks share: the per-process recorder, the status protocol with the
launcher, the row type the taps produce, and the patch-point machinery (signature-checked
wrapping at import time).

Used inside serving processes (SGLang schedulers, vLLM engine core / workers); imports no engine.
The engine-specific parts are the patch tables (`*_versions.py`), the pure row builders
(`*_taps.py`, `*_audit.py`) and the wrappers (`hstrace.hooks.*_patches`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import inspect
import json
import os
import re
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hstrace.errors import EngineError

Version = tuple[int, int, int]
# What the launcher sends a recording process to close its trace (`Recorder._close_on_signal`).
CLOSE_SIGNAL = __import__("signal").SIGUSR1


def parse_version(text: str, engine: str = "engine") -> Version:
    match = re.match(r"^\s*(\d+)\.(\d+)\.(\d+)", text)
    if not match:
        raise EngineError(f"cannot read {engine} version {text!r}")
    return int(match[1]), int(match[2]), int(match[3])


@dataclass(frozen=True)
class PatchPoint:
    """One function hstrace wraps: `module:Qual.name`, the parameter names it binds by, the
    versions in which they look like that, and what it feeds."""

    target: str
    params: tuple[str, ...]
    since: Version
    until: Version  # inclusive
    feeds: tuple[str, ...]

    def applies_to(self, version: Version) -> bool:
        return self.since <= version <= self.until

    @property
    def module(self) -> str:
        return self.target.split(":")[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":")[1]


def bind_args(original: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A wrapped call's arguments by parameter name (patch points bind by name)."""
    return inspect.signature(original).bind(*args, **kwargs).arguments


def choose_points(table: tuple[PatchPoint, ...], version: Version) -> tuple[PatchPoint, ...]:
    chosen = tuple(p for p in table if p.applies_to(version))
    targets = [p.target for p in chosen]
    duplicated = {t for t in targets if targets.count(t) > 1}
    if duplicated:  # a table bug, not bad input
        raise AssertionError(f"patch table has overlapping rows for {sorted(duplicated)}")
    return chosen


@dataclass(frozen=True)
class EngineSupport:
    """One engine's versions, as data: which releases the patch table covers, how its version
    is read in a Python, and how its plugin entry point is found. Each `*_versions.py` holds one
    (`SUPPORT`); the bootstrap and the launcher ask it, never the engine-specific module."""

    label: str  # the engine's name in messages
    distributions: tuple[str, ...]  # the distributions that install it (same import name)
    min_supported: Version
    max_supported: Version
    install_hint: str  # what to install instead of an unsupported release
    patch_points: tuple[PatchPoint, ...]
    plugin_group: str
    plugins_env: str  # the engine's allow-list of plugins (comma-separated names)
    plugins_since: Version = (0, 0, 0)  # the first release that loads plugin entry points
    empty_env_allows_all: bool = True  # SGLANG_PLUGINS="": all; VLLM_PLUGINS="": none

    def parse_version(self, text: str) -> Version:
        return parse_version(text, self.label)

    def check_supported_version(self, version_text: str) -> Version:
        """The parsed version, or an `EngineError` naming the supported range."""
        version = self.parse_version(version_text)
        if not (self.min_supported <= version <= self.max_supported):
            lo = ".".join(map(str, self.min_supported))
            hi = ".".join(map(str, self.max_supported))
            span = lo if lo == hi else f"{lo}-{hi}"
            raise EngineError(
                f"{self.label} {version_text} is not supported by this hstrace (patch tables "
                f"cover {span}); install {self.install_hint} or an hstrace release that knows "
                f"{version_text}"
            )
        return version

    def patch_points_for(self, version: Version) -> tuple[PatchPoint, ...]:
        return choose_points(self.patch_points, version)

    def installed_version(self) -> str | None:
        """The engine's version in this Python (any of its distributions), or None."""
        from importlib.metadata import PackageNotFoundError, version

        for dist in self.distributions:
            try:
                return version(dist)
            except PackageNotFoundError:
                continue
        return None

    def plugin_will_run(self, installed: str | None) -> bool:
        """Whether the engine will call hstrace's plugin entry point itself (then the generated
        sitecustomize leaves activation to it)."""
        from importlib.metadata import entry_points

        if installed is None or self.parse_version(installed) < self.plugins_since:
            return False
        allowed = os.environ.get(self.plugins_env)
        if allowed is not None and (allowed or not self.empty_env_allows_all):
            if "hstrace" not in {x.strip() for x in allowed.split(",")}:
                return False
        return any(ep.name == "hstrace" for ep in entry_points(group=self.plugin_group))


@dataclass
class TableWrite:
    """Rows of one trace table for one event, axis by axis (what `TraceWriter.write` takes)."""

    table: str
    step: dict[str, Any] = field(default_factory=dict)
    req: dict[str, Any] = field(default_factory=dict)
    tok: dict[str, Any] = field(default_factory=dict)
    other: dict[str, dict[str, Any]] = field(
        default_factory=dict
    )  # extra axes: proposed, accepted, rid
    column_attrs: dict[str, dict[str, Any]] | None = None


# ---- rows every engine's taps build the same way ----------------------------------------------


def request_keys(rids: Sequence[str]) -> Any:
    """The store's stable 63-bit hash of each request id, as the `req_key` column."""
    import torch

    from hstrace.trace import request_key

    return torch.tensor([request_key(r) for r in rids], dtype=torch.int64)


def requests_write(rids: Sequence[str], prompts: Sequence[Any], n_cached: Sequence[int]) -> Any:
    """One `requests` row per new request: its id (bytes and hash), prompt token ids, and the
    prompt tokens the engine served from its prefix cache."""
    import torch

    ids = [torch.as_tensor(list(p), dtype=torch.int64) for p in prompts]
    rid_bytes = [torch.frombuffer(bytearray(str(r).encode()), dtype=torch.uint8) for r in rids]
    return TableWrite(
        "requests",
        req={
            "req_key": request_keys([str(r) for r in rids]),
            "n_prompt": torch.tensor([len(p) for p in ids], dtype=torch.int64),
            "rid_len": torch.tensor([len(b) for b in rid_bytes], dtype=torch.int64),
            "n_cached": torch.tensor(list(n_cached), dtype=torch.int64),
        },
        tok={"prompt_ids": torch.cat(ids)},
        other={"rid": {"bytes": torch.cat(rid_bytes)}},
    )


def aux_hidden_attrs(layer_ids: Sequence[int], width: int) -> dict[str, Any]:
    """Column attributes of `target.aux_hidden`, as the reference engine writes them. Both
    engines' capture id k is the residual stream entering decoder layer k = HF
    `hidden_states[k]` (SGLang's `layers_to_capture`, vLLM's aux ids: no +1 at this point), and
    captures are concatenated in layer order (so the slots are the sorted, distinct ids)."""
    slots = sorted(set(layer_ids))
    return {
        "layer_ids": slots,
        "layer_id_convention": "hf_hidden_states_index",
        "slot_width": width // len(slots) if slots else width,
    }


# ---- the status protocol: the launcher's side channel (one JSON object a line) --------------


def write_status(cfg: Mapping[str, Any], entry: dict[str, Any]) -> None:
    status = cfg.get("status")
    if not status:
        return
    with open(status, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"pid": os.getpid(), **entry}, default=str) + "\n")


def refuse(cfg: Mapping[str, Any], message: str) -> None:
    """Stop the server before it takes traffic: a clear line, and a status entry the launcher
    reads. SystemExit, not an Exception: engines' plugin loaders swallow Exceptions."""
    write_status(cfg, {"refused": message})
    print(f"hstrace: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


# ---- the per-process recorder ---------------------------------------------------------------


class Recorder:
    """Per-process state: the config, the lazily opened writer (only processes that record a
    row or an audit item open one), disabled taps."""

    def __init__(self, cfg: dict[str, Any], version: Version) -> None:
        self.cfg = cfg
        self.version = version
        self.streams = set(cfg.get("streams", ()))
        self.disabled: set[str] = set()
        self.lock = threading.Lock()
        self._writer: Any = None
        self.closed = False  # the launcher asked this process to close its trace
        self.writer_factory: Callable[[int], Any] | None = None  # tests may inject the real writer

    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def writer(self) -> Any:
        with self.lock:
            if self._writer is None:
                if self.writer_factory is not None:
                    self._writer = self.writer_factory(self.rank())
                else:
                    from hstrace.trace import TraceWriter

                    self._writer = TraceWriter(
                        self.cfg["out"], rank=self.rank(), on_full=self.cfg.get("on_full", "block")
                    )
                    import atexit
                    import multiprocessing.util

                    _unpin(self._writer.writer_pid)
                    atexit.register(self.close)
                    # engine workers started by multiprocessing end with os._exit, which skips
                    # atexit; its own exit finalizers still run (before daemonic children die)
                    multiprocessing.util.Finalize(self, self.close, exitpriority=100)
                    from hstrace.hooks.bootstrap import _state

                    # how the hooks got into this process: "plugin" (the engine's entry point)
                    # or "sitecustomize" (the generated fallback)
                    self._writer.update_static({"hooks_via": _state.get("via")})
                    if self.cfg.get("close_on_signal"):  # opt-in: the launcher will use it
                        self._close_on_signal()
            return self._writer

    def _close_on_signal(self) -> None:
        """Let the launcher close this process's trace before it stops the server: engines
        kill their workers' process trees at shutdown (vLLM: SIGKILL, writer included), so
        the last tail-flush period would be lost. The launcher sends CLOSE_SIGNAL only to
        pids that announced the handler in the status file (the default action would kill)."""
        import signal

        def handler(signum, frame):
            # never close inside the handler: it may interrupt a write holding the writer lock
            threading.Thread(target=self.close, name="hstrace-close", daemon=True).start()

        try:
            signal.signal(CLOSE_SIGNAL, handler)
        except (ValueError, OSError):  # not the main thread: no close on request here
            return
        write_status(self.cfg, {"close_on": int(CLOSE_SIGNAL), "rank": self.rank()})

    def close(self) -> None:
        self.closed = True
        if self._writer is not None:
            self._writer.close()  # idempotent: a second call (atexit after Finalize) is a no-op

    def static(self, items: dict[str, Any]) -> None:
        if self.closed:
            return
        w = self.writer()
        w.update_static(items)
        w.flush()  # the audit must be on disk even if the server dies right after loading

    def main_process_static(self, items: dict[str, Any]) -> None:
        """Static facts found in a process without a trace writer (the engine's front end): a
        status line, merged into the trace's `static` by the launcher when the run ends."""
        write_status(self.cfg, {"static": items})

    def emit(self, writes: list[TableWrite]) -> None:
        if self.closed:  # closed on the launcher's request: the run is over
            return
        w = self.writer()
        for tw in writes:
            if tw.table not in self.streams:
                continue
            # only the axes this table has (verify has no `tok`, requests no per-step columns)
            axes = {"step": tw.step, "req": tw.req, "tok": tw.tok, **tw.other}
            kwargs: dict[str, Any] = {axis: cols for axis, cols in axes.items() if cols}
            if tw.column_attrs:
                kwargs["column_attrs"] = tw.column_attrs
            w.write(tw.table, **kwargs)

    def run_tap(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run one tap; an exception disables it (recorded in the trace) and never reaches the
        engine."""
        if name in self.disabled:
            return None
        try:
            return fn()
        except Exception as exc:  # never take serving down: disable and say so in the trace
            self.disabled.add(name)
            message = f"{type(exc).__name__}: {exc} | " + traceback.format_exc(limit=3).replace(
                "\n", " "
            )
            try:
                self.writer().note_error(name, message)
                self.writer().flush()
            except Exception:
                print(f"hstrace: tap {name} disabled: {message}", file=sys.stderr)
            return None


def _unpin(pid: int | None) -> None:
    """Engines pin their model thread to a core (vLLM's CPU worker binds its OpenMP threads);
    a writer process started from it inherits that affinity and would compete for the serving
    core. Give it the CPUs of the engine process that started this one instead."""
    import os

    if pid is None or not hasattr(os, "sched_setaffinity"):
        return
    try:
        mine, parent = os.sched_getaffinity(0), os.sched_getaffinity(os.getppid())
        if parent - mine:
            os.sched_setaffinity(pid, parent)
    except OSError:
        pass


# ---- installing wrappers: now, or right after the module is imported ------------------------

Wrappers = Mapping[str, Callable[[Callable], Callable]]


def apply_point(point: PatchPoint, module: Any, wrappers: Wrappers, rec: Recorder | None) -> None:
    """Patch one point; a failure to patch is recorded and never reaches the engine's import."""
    try:
        _apply(point, module, wrappers, rec)
    except Exception as exc:  # never take serving down: an unpatched point records nothing
        message = f"cannot patch {point.qualname}: {type(exc).__name__}: {exc}"
        if rec is not None:
            rec.run_tap(f"patch:{point.target}", lambda: rec.static({"patch_error": message}))
        print(f"hstrace: {message}", file=sys.stderr, flush=True)


def _apply(point: PatchPoint, module: Any, wrappers: Wrappers, rec: Recorder | None) -> None:
    cls_name, attr = point.qualname.split(".")
    cls = getattr(module, cls_name)
    original = cls.__dict__[attr]
    if getattr(original, "__hstrace_wrapped__", False):
        return
    params = tuple(inspect.signature(original).parameters)
    if params[: len(point.params)] != point.params:
        if rec is not None:  # signature drift inside a supported range: record it, do not patch
            mismatch = {point.target: {"expected": list(point.params), "found": list(params)}}
            rec.run_tap(f"patch:{point.target}", lambda: rec.static({"patch_mismatch": mismatch}))
        return
    wrapped = wrappers[point.qualname](original)
    wrapped.__hstrace_wrapped__ = True  # type: ignore[attr-defined]
    setattr(cls, attr, wrapped)


ModulePatch = Callable[[Any], None]


class PostImport(importlib.abc.MetaPathFinder):
    """Runs a module's patches right after it executes, before any importer sees it (hooks and
    stand-ins are installed before the engine imports the modules they change)."""

    def __init__(self, pending: dict[str, list[ModulePatch]]) -> None:
        self.pending = pending

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module
        todo = self.pending.pop(fullname)

        def exec_and_patch(module):
            exec_module(module)
            for patch in todo:
                patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def patch_modules(patches: Mapping[str, list[ModulePatch]]) -> None:
    """Apply each module's patches now if it is imported, else right after its import."""
    pending: dict[str, list[ModulePatch]] = {}
    for name, todo in patches.items():
        if name in sys.modules:
            for patch in todo:
                patch(sys.modules[name])
        else:
            pending.setdefault(name, []).extend(todo)
    if pending:
        sys.meta_path.insert(0, PostImport(pending))


def install_points(points: tuple[PatchPoint, ...], wrappers: Wrappers, rec: Recorder) -> None:
    by_module: dict[str, list[ModulePatch]] = {}
    for point in points:
        by_module.setdefault(point.module, []).append(
            lambda module, point=point: apply_point(point, module, wrappers, rec)
        )
    patch_modules(by_module)
