"""What every engine's hooks share inside a serving process: the per-process recorder (one
trace writer per rank, closed at exit or on the launcher's signal), the status protocol with
the launcher, and the patch-point machinery (signature-checked wrapping, applied now or right
after a module's import through a meta-path finder).

Server-side only (SGLang schedulers, vLLM engine core / workers); imports no engine. The
engine-specific parts are each engine package's patch table (`hstrace.engines.<name>.versions`),
its pure row builders and audit (`taps`, `audit`) and its wrappers (`hstrace.hooks.<name>_patches`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import inspect
import json
import os
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from hstrace.engines.protocol import CLOSE_SIGNAL
from hstrace.engines.rows import TableWrite
from hstrace.engines.support import PatchPoint, Version


def bind_args(original: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A wrapped call's arguments by parameter name (patch points bind by name)."""
    return inspect.signature(original).bind(*args, **kwargs).arguments


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
