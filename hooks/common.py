"""What every engine's hooks share inside a serving process: the per-process recorder (one
trace writer per rank, closed at exit or on the launcher's signal), the status protocol with
the launcher, and the patch-point machinery (signature-checked wrapping, applied now or right
after a module's import through a meta-path finder).

Server-side only (SGLang schedulers, vLLM engine core / workers); imports no engine. The
engine-specific parts are each engine package's patch table (`hstrace.engines.<name>.versions`),
its pure row builders and audit (`taps`, `audit`) and its wrappers (`hstrace.hooks.<name>_patches`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import inspect
import json
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hstrace.engines.protocol import (
    CLOSE_SIGNAL,
    DRAIN_WAIT_MAX_S,
    DRAIN_WAIT_S,
    QUIET_S,
)
from hstrace.engines.rows import TableWrite
from hstrace.engines.support import PatchPoint, Version


def bind_args(original: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A wrapped call's arguments by parameter name (patch points bind by name). Runs on the
    serving thread about three times a step: `inspect.signature` is read once per function
    (15 us a call otherwise), and a call whose arguments all name a parameter of their own is
    mapped without `Signature.bind` (5 us): the same names and values, not in the signature's
    order. A call the function would refuse (an argument missing) is the engine's to fail."""
    sig, positional, named = _parameters(original)
    if len(args) <= len(positional) and (
        not kwargs or (named.issuperset(kwargs) and not kwargs.keys() & positional[: len(args)])
    ):
        bound = dict(zip(positional, args, strict=False))  # the trailing ones left out
        if kwargs:
            bound.update(kwargs)
        return bound
    return sig.bind(*args, **kwargs).arguments


@functools.lru_cache(maxsize=256)
def _parameters(fn: Callable) -> tuple[inspect.Signature, tuple[str, ...], frozenset[str]]:
    """`fn`'s signature, its leading positional parameters' names (up to a `*args`), and every
    name an argument may be passed by (not `**kwargs`' own)."""
    sig = inspect.signature(fn)
    positional: list[str] = []
    for p in sig.parameters.values():
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        positional.append(p.name)
    named = frozenset(
        p.name
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    )
    return sig, tuple(positional), named


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


def write_rows(w: Any, tw: TableWrite) -> None:
    """One table's rows of a step into the trace writer `w` (`TraceWriter.write`)."""
    # only the axes this table has (verify has no `tok`, requests no per-step cols)
    axes = {"step": tw.step, "req": tw.req, "tok": tw.tok, **tw.other}
    kwargs: dict[str, Any] = {axis: cols for axis, cols in axes.items() if cols}
    if tw.column_attrs:
        kwargs["column_attrs"] = tw.column_attrs
    w.write(tw.table, **kwargs)


def _may_raise_back(soft_rlimit: int, nice: int, cap_eff: int) -> bool:
    """Whether a thread lowered to SCHED_IDLE may be raised back to SCHED_OTHER at `nice`
    (sched_setscheduler(2), Linux: CAP_SYS_NICE, or RLIMIT_NICE's soft limit at least
    20 - nice)."""
    return 20 - nice <= soft_rlimit or bool(cap_eff >> 23 & 1)  # bit 23: CAP_SYS_NICE


def _may_restore_policy() -> bool:
    """`_may_raise_back` for this process; never guessed: unreadable means no."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
        if soft == resource.RLIM_INFINITY:
            return True
        cap_eff = 0
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    cap_eff = int(line.split()[1], 16)
        return _may_raise_back(soft, os.nice(0), cap_eff)
    except (OSError, ValueError, ImportError):
        return False


def _finite(value: Any) -> bool:
    """A finite int or float from the arm message (a bool is not a number here)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return ok and math.isfinite(value)


def hold_limit(hold_mb: Any) -> int | None:
    """A session's `hold_mb` in bytes (None: not held); anything but a positive number is
    refused (the arming client says it)."""
    if hold_mb is None:
        return None
    if not _finite(hold_mb) or not hold_mb > 0:
        raise ValueError(f"hold_mb must be a positive number of MiB, not {hold_mb!r}")
    return max(1, int(hold_mb * 2**20))


def drain_wait(value: Any) -> float:
    """A session's `drain_wait_s` (None: `protocol.DRAIN_WAIT_S`): how long its held rows wait
    at the disarm for a quiet server; anything but a number of seconds in [0,
    DRAIN_WAIT_MAX_S] is refused."""
    if value is None:
        return DRAIN_WAIT_S
    if not _finite(value) or not 0 <= value <= DRAIN_WAIT_MAX_S:
        raise ValueError(
            f"drain_wait_s must be a number of seconds in [0, {DRAIN_WAIT_MAX_S:g}], not {value!r}"
        )
    return float(value)


def _no_work() -> None:
    """Queued to wake the tap thread (`Recorder._wake_taps`)."""


class Recorder:
    """Per-process state: the config, the lazily opened writer (only processes that record a
    row or an audit item open one), disabled taps.

    Armed or dormant: `armed` is the one flag every per-step patch point checks first. A
    recorder started with `dormant` in its config (`hstrace.engines.protocol.dormant_env`)
    records nothing until `arm` (from the control channel, `hstrace.hooks.control`) opens a
    trace, and `disarm` closes it; the static audit, taken at load time, is kept in memory
    (`kept_static`) and written into every trace armed later."""

    def __init__(self, cfg: dict[str, Any], version: Version) -> None:
        self.cfg = cfg
        self.version = version
        self.streams = set(cfg.get("streams", ()))
        self.disabled: set[str] = set()
        self.lock = threading.Lock()
        self._writer: Any = None
        self.closed = False  # the launcher asked this process to close its trace
        self.writer_factory: Callable[[int], Any] | None = None  # tests may inject the real writer
        self.dormant = bool(cfg.get("dormant"))
        self.armed = not self.dormant  # new steps are recorded
        self.session_open = self.armed  # rows may still be written (until the close)
        self.stepping = False  # an engine's step wrapper is collecting (see `disarm`)
        self.closing = False  # a disarm is closing the session's trace
        # the session: held by the serving thread while it writes, by `disarm` while it closes
        self.session_lock = threading.Lock()
        self.kept_static: dict[str, Any] = {}  # every static item, for traces armed later
        self.kept_main_static: dict[str, Any] = {}  # main_process_static while dormant
        self.kept_errors: list[tuple[str, str]] = []  # taps disabled while dormant
        self.requests_limit: int | None = None  # the session ends after this many requests
        self.limit_rids: set[str] = set()  # the first `requests_limit` requests of the session
        self.on_limit: Callable[[str], None] | None = None  # the control channel's disarm
        self._finalizers = False
        self._deferred: Any = None  # the tap thread's queue (`defer`), started on first use
        self.tap_thread = True  # a session may ask for the step's work inline (bench's variant)
        self.work = "rows"  # how far a step goes (protocol.WORK_LEVELS; the bench's switch)
        # Paced (an engine whose hooks say when a step has handed back: `step_ended`): a step
        # handed over is held until then and only then queued, so the tap thread wakes once a
        # step, after it, not while the step's own Python still runs (both share this
        # process's GIL and core: a wake mid-step took the GIL from serving to go back to sleep)
        self.paced = False
        self._held: Any = None  # collections.deque of steps handed over, not yet queued
        self._release_lock = threading.Lock()  # queues held steps in order (serving or drain)
        # Paced: the engine's step runs (`step_started` .. `step_ended`); the tap thread, between
        # two stages of a step's work, gives way to it (`make_way`). HSTRACE_TAP_YIELD=0: never
        # (the bench's side by side).
        self.in_step = False
        self.give_way = os.environ.get("HSTRACE_TAP_YIELD", "1") != "0"
        # make_way also inside a stage: between the tables it stages and between the draft
        # top-k's calls (vLLM's worker, whose engine core's call arrives mid-stage, waits for
        # the rest of the stage). HSTRACE_TAP_FINE=0: between stages only (the bench's side by
        # side; bench/README.md, twenty-second pass)
        self.fine_way = os.environ.get("HSTRACE_TAP_FINE", "1") != "0"
        self._gap_waiter: threading.Event | None = None  # the tap thread, waiting for a gap
        self._tap_ident: int | None = None  # the tap thread's (make_way runs there only)
        # A step that starts while the tap thread is mid-stage (it gives way only between its
        # stages) lowers it to SCHED_IDLE until the step ends: the kernel then runs it only when
        # the serving thread's core would idle, not in the step's time slices (where it took the
        # GIL from the step's forward). Only where this process may raise it back
        # (`_may_restore_policy`). HSTRACE_TAP_IDLE=0: never (the bench's side by side).
        self.step_idle = os.environ.get("HSTRACE_TAP_IDLE", "1") != "0"
        self._tap_tid: int | None = None  # the tap thread's kernel id, where it may be lowered
        self._tap_parked = True  # waiting for work or for a gap (not mid-stage)
        self._tap_lowered = False  # lowered for the step that runs
        # A session armed with `hold_mb` (`hstrace arm --hold-mb`): the steps handed over are
        # held in memory, not queued, and the tap thread builds their rows only when the server
        # is quiet (no step for IDLE_S, `_next_step`: between bursts while armed, and at the
        # disarm), or once they hold `hold_bytes` (from then on they go to it as they come).
        # While it holds, a step costs the serving thread its copies and one append; what it
        # leaves is the same rows, later, and a server that dies first loses the held steps.
        self.hold_bytes: int | None = None
        self._hold_used = 0  # bytes of the steps held (the engine's `defer(..., nbytes)`)
        self._hold_freed = 0  # of those, taken by the tap thread in a quiet moment
        self._releasing = False  # a release thread queues the held steps (the hold ran over)
        # the session's hold, kept while it streams after running over: held again once the
        # backlog is built and the server is quiet (`_hold_again`)
        self._hold_limit: int | None = None
        self._hold_auto = False  # the hold is the client's default, not asked for: hooks that
        # cannot hold stream without a word
        self._built_quiet = False  # the tap thread built a held step in a quiet moment
        self._quiet_flushed = 0.0  # monotonic: the last flush after those (`_flush_quiet`)
        # The disarm of a held session: its steps are built when the server idles (no step
        # for IDLE_S), not beside the steps it serves on: the engine's step cues go on while
        # they drain (`cued`, `draining`), and the tap thread waits for a quiet server before
        # each held step and inside it (`_wait_idle`), for `drain_wait_s` in all; past that
        # it builds the rest at once, as it did before. A server that never idles pays the
        # rows then, as a streamed session pays them while armed (bench/README.md,
        # twenty-eighth pass).
        self.drain_wait_s = DRAIN_WAIT_S  # the session's (`arm`)
        self.draining = False  # a held session's steps drain, waiting for a quiet server
        self._idle_until = 0.0  # monotonic: the drain waits no longer than this
        self._last_step_end = 0.0  # monotonic: the last step's end told (`step_ended`)
        # the step cues are told (`step_started` / `step_ended`): armed, or draining held steps
        # (one flag for the engine's wrappers to read, as `armed`)
        self.cued = self.armed

    # the `work` levels (protocol.WORK_LEVELS) an engine's hooks honour: only a recording here
    WORK_LEVELS: tuple[str, ...] = ("rows",)

    # ---- off the serving thread -----------------------------------------------------------------

    DEFER_DEPTH = 8  # steps handed over and not yet written; a full queue stalls serving (block)

    # engines whose step taps hand their work to the tap thread (`defer`) may hold it
    HOLDS = False

    def defer(self, fn: Callable[[], None], nbytes: int = 0) -> None:
        """Run `fn` (a step's top-k, row building and staging) on this process's tap thread,
        in order, so the serving thread only collects. `fn` must own what it reads (copies, or
        tensors the engine never writes again). A full queue blocks: nothing is dropped.
        `nbytes`: what `fn` holds, counted against a session's `hold_bytes`."""
        q = self._deferred
        if q is None:
            import queue

            with self.lock:
                if self._deferred is None:
                    self._deferred = queue.Queue(self.DEFER_DEPTH)
                    threading.Thread(
                        target=self._tap_loop, name="hstrace-taps", daemon=True
                    ).start()
            q = self._deferred
        held = self._held
        if held is None:
            import collections

            held = self._held = collections.deque()
        limit = self.hold_bytes  # read once: a disarm sets it to None while a step ends
        if limit is not None:
            held.append((fn, nbytes))  # taken when the server is quiet, or at the disarm
            self._hold_used += nbytes  # (this thread's count; the tap thread's is `_hold_freed`)
            if self._hold_used - self._hold_freed >= limit:  # full: the tap thread works now
                self.hold_bytes = None
                self._releasing = True  # its queue takes DEFER_DEPTH: never this thread's wait
                threading.Thread(
                    target=self._release_held, name="hstrace-release", daemon=True
                ).start()
            return
        if self.paced or self._releasing or held:
            held.append((fn, 0))  # paced: queued at the step's end (`step_ended`), or by `drain`
            # a step whose end never came: no unbounded hold (unpaced: queued now, in order);
            # disarmed (the step that ran as the disarm came): queued by the disarm's drain,
            # never here, where it would wait on a held session's backlog
            if (
                self.armed
                and not self._releasing
                and (not self.paced or len(held) >= self.DEFER_DEPTH)
            ):
                self._release()
            return
        q.put(fn)

    def _release_held(self) -> None:
        """The held steps to the tap thread, in order, off the serving thread (a hold that ran
        over its bytes): the steps handed over meanwhile join the same deque behind them."""
        try:
            self._release()
        finally:
            self._releasing = False

    def step_started(self) -> None:
        """The engine's step has started (its serving thread, armed only): the writer process
        is told, so that it works while the step runs, not in the gap after it, and a tap
        thread caught mid-stage is lowered to SCHED_IDLE until the step ends (`_open_gap`)."""
        self.in_step = True
        if self._tap_tid is not None and not self._tap_parked and not self._behind():
            self._tap_lowered = self._tap_policy(True)
            if not self.cued:  # a disarm (or its drain's end) came in between: its
                self._open_gap()  # `_open_gap` may have run
        self._phase(True)

    def step_ended(self) -> None:
        """The engine's step has handed back (its serving thread, armed only): the writer is
        told, a tap thread waiting for the gap goes on, and the steps it handed over go to the
        tap thread now."""
        self._last_step_end = time.monotonic()
        self._open_gap()
        self._phase(False)
        if self._held and self.hold_bytes is None and not self._releasing and not self.draining:
            self._release()  # (a drain's backlog is queued by the disarm's thread, not here)

    def _open_gap(self) -> None:
        """No step runs now (its end, or a disarm's): the tap thread, if lowered for the step,
        is raised back before it is let go on."""
        self.in_step = False
        if self._tap_lowered:
            self._tap_lowered = False
            self._tap_policy(False)
        waiter = self._gap_waiter
        if waiter is not None:
            self._gap_waiter = None
            waiter.set()

    # the longest the tap thread waits for a step's end before it goes on (`make_way`)
    GAP_WAIT_S = 0.05

    def make_way(self) -> None:
        """Between two stages of a step's work, on the tap thread (paced engines only). First
        a yield with the GIL released: vLLM's worker, woken in the gap for its next step, waits
        for the GIL, and the tap thread, which would take it back at once, otherwise keeps it
        until its whole step is written (its Python holds it between torch calls; the forced
        switch comes only after sys.getswitchinterval(), 5 ms): reasoned from vLLM's wait loop
        and CPython's GIL, not traced; the bench's side by side is the evidence
        (bench/README.md, twenty-first pass). Then, if that next step has
        begun, the rest of this step's work waits for its end (at most GAP_WAIT_S, and never
        with half the queue waiting: the tap thread must keep up), so that it does not run
        beside the step on the serving thread's core."""
        if not self.paced or not self.give_way or threading.get_ident() != self._tap_ident:
            return  # (inline, the step's own work: nothing to give way to)
        os.sched_yield()  # releases the GIL (CPython >= 3.11.1, as vLLM's own spin relies on)
        if self.draining or self._holding():  # a held step: until the server is quiet (or,
            self._wait_idle()  # draining, the wait is over: then at once, the backlog behind)
            return
        if not self.in_step:
            return
        if self._behind():
            return
        waiter = threading.Event()
        self._gap_waiter = waiter
        if self.in_step:  # the step may have ended since: then nobody will set it
            self._tap_parked = True
            waiter.wait(self.GAP_WAIT_S)
            self._tap_parked = False
        self._gap_waiter = None

    def make_way_within(self) -> None:
        """`make_way` inside a stage (between its rows built and staged, between the tables it
        stages, between the top-k's calls), where `fine_way` is on. Never called holding
        `session_lock` (a wait here may last GAP_WAIT_S). In the gap after a step, vLLM's
        engine core calls the worker once more (`take_draft_token_ids`) before it schedules
        the next step; the call waits for the tap thread's stage to end, and a shorter stage
        leaves it less to wait (bench/README.md, twenty-second pass: traced)."""
        if self.fine_way:
            self.make_way()

    def _behind(self) -> bool:
        """Half the tap thread's queue waits: it must keep up, in the steps too (`make_way`
        does not wait then either, and it is not lowered). A held session's drain is not
        behind while it waits for a quiet server (a step that starts mid-stage lowers it)."""
        q = self._deferred
        if q is None or q.qsize() < self.DEFER_DEPTH // 2:
            return False
        return not self.draining or time.monotonic() >= self._idle_until

    # a server is quiet once no step has run for this long (vLLM's steps under load follow
    # each other within a few ms; the tiny world's take 5-11 ms on this project's CPU host)
    IDLE_S = QUIET_S

    def _holding(self) -> bool:
        """A held session is armed and still holds (its hold not run over), in an engine that
        tells its steps: its steps are built only when the server is quiet."""
        return self.hold_bytes is not None and self.armed and self.paced

    def _quiet_for(self) -> float:
        """Seconds since the engine's last step ended (0 while one runs)."""
        return 0.0 if self.in_step else time.monotonic() - self._last_step_end

    def _wait_idle(self) -> None:
        """On the tap thread, building a held step: wait until no step has run for IDLE_S;
        while the session is armed, for as long as it holds (its hold run over, it streams:
        no more waiting), and at the disarm's drain until the drain's wait (`drain_wait_s`)
        is over. It looks every IDLE_S at most while the server serves (a wake per step would
        cost serving, the `handover` rung of bench/README.md's ladder). Only where the engine
        tells its steps (`paced`); a step whose end is never told keeps it waiting to the
        deadline, or, armed, until the hold runs over or the session ends."""
        if not self.paced:
            return
        while True:
            if self.draining:
                left = self._idle_until - time.monotonic()
            elif self._holding():
                left = math.inf
            else:
                return
            if left <= 0:
                return
            quiet = self._quiet_for()
            if quiet >= self.IDLE_S:
                return
            self._tap_parked = True  # waiting: a step that starts does not lower it
            try:
                time.sleep(min(self.IDLE_S - quiet, left))
            finally:
                self._tap_parked = False

    def _next_step(self, q: Any) -> Callable[[], None]:
        """The tap thread's next work: what is queued, or, while a held session is armed, its
        oldest held step once the server has been quiet for IDLE_S (moved to the queue here,
        so that a drain's `join` waits for it too): a held session's rows reach its trace in
        the server's quiet moments, not only at the disarm. A held session that ran over its
        hold streams until its backlog is built and the server is quiet, then holds again
        (`_hold_again`). It looks every IDLE_S at most while the server serves, and never
        while no held session is armed (the arm wakes it, `_wake_taps`)."""
        import queue

        while True:
            if self._holding():
                if self._held and self._quiet_for() >= self.IDLE_S and self._take_held(q):
                    return q.get()
                wait = self.IDLE_S if not self._held else self.IDLE_S - self._quiet_for()
            elif self._overflowed():
                wait = self.IDLE_S
            else:
                return q.get()
            try:
                return q.get(timeout=max(wait, 0.002))
            except queue.Empty:
                self._hold_again()

    def _overflowed(self) -> bool:
        """An armed held session streams: its hold ran over."""
        return (
            self._hold_limit is not None and self.hold_bytes is None and self.armed and self.paced
        )

    def _hold_again(self) -> None:
        """On the tap thread, its queue empty: a held session that ran over its hold holds
        again once its backlog is built (nothing held, nothing being released) and the server
        is quiet. Under the session's lock, so that a disarm (which lifts the hold) is never
        undone here."""
        if not self._overflowed() or self._releasing or self._held:
            return
        if self._quiet_for() < self.IDLE_S:
            return
        with self.session_lock:
            if self._overflowed() and not self._releasing and not self._held:
                self._hold_freed = self._hold_used  # nothing held now (the serving thread
                self.hold_bytes = self._hold_limit  # counts only while it holds)

    def _take_held(self, q: Any) -> bool:
        """Move the oldest held step to the queue (the tap thread's, in a quiet moment of an
        armed held session); False when there is none, or the queue has no room."""
        with self._release_lock:  # in order with a release (a hold run over, a drain)
            held = self._held
            if not held or not self._holding() or q.full():
                return False
            fn, nbytes = held.popleft()
            q.put_nowait(fn)
            self._hold_freed += nbytes
            self._built_quiet = True
            return True

    # a held session's rows built in a quiet moment are flushed there, at most this often
    # (the writer's own tail flush, every 2 s, would otherwise land in the next burst)
    QUIET_FLUSH_S = 0.5

    def _flush_quiet(self) -> None:
        """On the tap thread, once the steps held before a quiet moment are built: the writer
        commits them now, while the server is still quiet, not at its next tail flush, in
        the burst that follows (at most every QUIET_FLUSH_S; not once a step has started:
        then after the next held step built in a quiet moment)."""
        if self._quiet_for() < self.IDLE_S:
            return
        self._built_quiet = False
        now = time.monotonic()
        if now - self._quiet_flushed < self.QUIET_FLUSH_S:
            return
        self._quiet_flushed = now
        try:
            with self.session_lock:
                if self.session_open and self._writer is not None and not self.closed:
                    self._writer.flush()
        except Exception as exc:  # never take serving down: the tail flush still comes
            print(f"hstrace: quiet flush: {type(exc).__name__}: {exc}", file=sys.stderr)

    def _wake_taps(self) -> None:
        """A held session was armed: the tap thread, if it waits on its queue for good
        (`_next_step`), goes back to looking for quiet moments."""
        q = self._deferred
        if q is not None:
            try:
                q.put_nowait(_no_work)
            except Exception:  # full: it is awake anyway
                pass

    def _tap_policy(self, lowered: bool) -> bool:
        """The tap thread to SCHED_IDLE or back to SCHED_OTHER (the serving thread's call: two
        a step at most, only while the tap thread is mid-stage). A refusal to lower turns this
        off for good; one to raise it back (not expected: `_may_restore_policy`) too."""
        tid = self._tap_tid
        if tid is None:
            return False
        try:
            policy = os.SCHED_IDLE if lowered else os.SCHED_OTHER
            os.sched_setscheduler(tid, policy, os.sched_param(0))
            return True
        except OSError:
            self._tap_tid = None
            return False

    def _phase(self, running: bool) -> None:
        w = self._writer
        if w is None:
            return
        try:  # words stored in the writer's ring (TraceWriter.step_phase; a test's has none)
            mark = getattr(w, "step_phase", None)
            if mark is not None:
                mark(running)
        except Exception:  # never take serving down: the writer then works as if never told
            pass

    def _release(self) -> None:
        """Queue the held steps, in the order they were handed over (a full queue blocks, as
        `defer` does unpaced)."""
        held, q = self._held, self._deferred
        if held is None or q is None:
            return
        with self._release_lock:  # the serving thread's step end, or a drain's
            while held:
                q.put(held.popleft()[0])

    def _tap_loop(self) -> None:
        from hstrace.trace.write import placement

        placement.move_here(placement.tap_cpus())  # beside the serving thread unless named
        placement.name_thread("hstrace-taps")
        self._tap_ident = threading.get_ident()
        if (
            self.step_idle
            and self.paced
            and _may_restore_policy()
            and os.sched_getscheduler(0) == os.SCHED_OTHER  # what `_tap_policy` restores
        ):
            self._tap_tid = threading.get_native_id()
        q = self._deferred
        while True:
            self._tap_parked = True
            fn = self._next_step(q)  # paced: queued at its step's end (`step_ended`)
            self._tap_parked = False
            try:
                if self.draining:  # a held step, at the disarm: once the server is quiet
                    self._wait_idle()
                fn()  # its taps run under run_tap: a failure disables one and is recorded
                if self._built_quiet and not self._held and self._holding():
                    self._flush_quiet()  # the held steps built: committed while quiet
            except Exception as exc:  # never let the tap thread die
                print(f"hstrace: deferred tap: {type(exc).__name__}: {exc}", file=sys.stderr)
            finally:
                q.task_done()

    def drain(self) -> None:
        """Wait until every step handed over is written (before a close; never on the serving
        thread, which is the only one that hands over)."""
        q = self._deferred
        if q is not None and threading.current_thread().name != "hstrace-taps":
            self._release()  # a step handed over whose end has not come (or never will)
            q.join()

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

                    if not self._finalizers:  # once per process, whatever the sessions
                        self._finalizers = True
                        atexit.register(self.close)
                        # engine workers started by multiprocessing end with os._exit, which
                        # skips atexit; its own exit finalizers still run (before daemonic
                        # children die)
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
        self._open_gap()  # the engine stops: no step end will be told
        self._idle_until = 0.0  # nor will a held session's drain wait for a quiet server,
        self.hold_bytes = self._hold_limit = None  # nor its steps held now
        self.drain()  # steps handed over to the tap thread are written first
        self.closed = True
        if self._writer is not None:
            self._writer.close()  # idempotent: a second call (atexit after Finalize) is a no-op

    # ---- a session armed in a running server (hstrace.hooks.control) --------------------------

    def arm(self, session: Mapping[str, Any]) -> dict[str, Any]:
        """Open a trace session: `out` (a trace root the client created), `streams`,
        `on_full`, optional `requests` (the limit). Writes the kept static audit at once (the
        audit of a model loaded long before), then lets the patch points record. Returns what
        the client merges into the trace: this process's rank and its front-end facts."""
        work = session.get("work") or "rows"
        if work not in self.WORK_LEVELS:
            raise ValueError(
                f"work {work!r}: this engine's hooks take {', '.join(self.WORK_LEVELS)}"
            )
        hold_bytes = hold_limit(session.get("hold_mb"))
        wait_s = drain_wait(session.get("drain_wait_s"))
        auto = session.get("hold_auto") is True  # `hstrace arm`'s default hold
        if hold_bytes is not None and not self.HOLDS:
            if not auto:
                raise ValueError("hold_mb: this engine's hooks build a step's rows as it runs")
            hold_bytes = None  # streamed, as these hooks always are
        with self.session_lock:
            if self.armed or self.session_open:
                raise RuntimeError("already armed")
            self.cfg = {
                **self.cfg,
                "out": session["out"],
                "streams": list(session["streams"]),
                "on_full": session.get("on_full", "block"),
            }
            self.streams = set(self.cfg["streams"])
            self.closed = False
            self.requests_limit = session.get("requests")
            self.limit_rids = set()
            self.tap_thread = bool(session.get("tap_thread", True))
            self.work = work
            self.hold_bytes, self._hold_used, self._hold_freed = hold_bytes, 0, 0
            self._hold_limit, self._hold_auto = hold_bytes, auto
            self._last_step_end = time.monotonic()  # (quiet counted from the arm at most)
            self.drain_wait_s = wait_s
            self.on_arm()
            if self.kept_static or self.kept_errors:
                w = self.writer()
                if self.kept_static:
                    w.update_static(dict(self.kept_static))
                for name, message in self.kept_errors:
                    w.note_error(name, message)
                w.flush()
            self.session_open = self.armed = self.cued = True
        if hold_bytes is not None:
            self._wake_taps()
        return {
            "rank": self.rank(),
            "main_static": dict(self.kept_main_static),
            "holds": hold_bytes is not None,
        }

    def disarm(self) -> bool:
        """End the session: the patch points go dormant, then the trace is closed (outside the
        lock: the serving thread never waits on a flush). False when nothing was armed."""
        with self.session_lock:
            if not self.armed:
                return False
            # a held session's steps wait for a quiet server: the step cues go on meanwhile
            self._last_step_end = time.monotonic()  # (quiet counted from the disarm at most)
            self._idle_until = self._last_step_end + self.drain_wait_s
            # (a session armed with a hold whose steps were never held, a CUDA step's, has
            # nothing to wait for: that path lifted `_hold_limit`)
            self.draining = self._hold_limit is not None and self.paced and self.drain_wait_s > 0
            self.cued = self.draining
            self.armed = False  # no new step starts recording
            self.hold_bytes = self._hold_limit = None  # the held steps: queued by the drain
        # a step that began armed is finished and written into this session's trace
        deadline = time.monotonic() + 30.0
        while self.stepping and time.monotonic() < deadline:
            time.sleep(0.001)
        if not self.draining:
            self._open_gap()  # no step end will be told now: the tap thread does not wait
        try:
            self.drain()
        finally:
            self.draining = self.cued = False  # the cues stop: a step that began while
            self._open_gap()  # draining ends untold
        self.closing = True  # `hello` says armed until the trace is closed on disk
        try:
            with self.session_lock:
                self.session_open = False
                writer, self._writer = self._writer, None
            if writer is not None:
                writer.close()
        finally:
            self.closing = False
        return True

    def on_arm(self) -> None:
        """An engine's per-session state, reset when a session starts (held: session_lock)."""

    def step_requests(self, new: Iterable[str], batch: Iterable[str]) -> None:
        """The `requests` limit, told by an engine's step tap (armed only): the first N requests
        recorded in this session are waited for to the end; the session ends at the first step
        whose batch holds none of them (requests that arrived meanwhile are recorded too, cut
        where the session ends). The close runs off the serving thread (it flushes)."""
        limit = self.requests_limit
        if limit is None:
            return
        for rid in new:
            if len(self.limit_rids) < limit:
                self.limit_rids.add(str(rid))
        if len(self.limit_rids) >= limit and not self.limit_rids.intersection(map(str, batch)):
            self.requests_limit = None
            if self.on_limit is not None:
                threading.Thread(target=self.on_limit, args=("requests",), daemon=True).start()

    def static(self, items: dict[str, Any]) -> None:
        from hstrace.trace.write.writer import plain_static

        # checked here, in the caller's tap: an item that is not JSON data is refused once,
        # never kept to fail every later arm
        items = plain_static(items)
        self.kept_static.update(items)  # a later session's trace gets the load-time audit too
        if self.closed or not self.session_open:
            return
        with self.session_lock:
            if not self.session_open:
                return
            w = self.writer()
            w.update_static(items)
            w.flush()  # the audit must be on disk even if the server dies right after loading

    def main_process_static(self, items: dict[str, Any]) -> None:
        """Static facts found in a process without a trace writer (the engine's front end): a
        status line, merged into the trace's `static` by the launcher when the run ends (a
        dormant server: kept, and handed to the arming client)."""
        self.kept_main_static.update(items)
        if self.dormant:
            return
        write_status(self.cfg, {"static": items})

    def emit(self, writes: list[TableWrite]) -> None:
        if self.closed:  # closed on the launcher's request: the run is over
            return
        with self.session_lock:
            if not self.session_open:  # the session is closed: nothing more to write
                return
            w = self.writer()
            for tw in writes:
                if tw.table in self.streams:
                    write_rows(w, tw)

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
            self.note_error(name, message)
            return None

    def note_error(self, name: str, message: str) -> None:
        """Say in the trace what went wrong at `name` (dormant: in the next session's trace);
        never raises."""
        try:
            if not self.session_open:
                self.kept_errors.append((name, message))
                return
            self.writer().note_error(name, message)
            self.writer().flush()
        except Exception:
            print(f"hstrace: {name}: {message}", file=sys.stderr)


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
