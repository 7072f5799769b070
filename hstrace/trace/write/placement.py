"""Where recording work runs: the writer process off the cores the engine's model thread is bound
to; the tap thread beside the serving thread.

vLLM's CPU worker binds the thread that runs the model to its cores (`VLLM_CPU_OMP_THREADS_BIND`;
`auto` binds rank 0 of a one-rank server to core 0 and leaves the rest to the engine core and
the API server), and a thread or a process inherits the CPU mask of the thread that creates
it. The bind is OpenMP's: vLLM sets `OMP_PLACES`/`OMP_PROC_BIND` for the worker it starts, and
`import torch` binds the worker's main thread before any plugin runs.

`spare_cpus()` (the writer process): the CPUs named by `HSTRACE_RECORD_CPUS` (`"1"`, `"2,3"`,
`"8-15"`: a team that keeps cores for recording says which); else the CPUs this process was
given less the model thread's mask; all of them when nothing is left over (tensor parallel
ranks bound to every core). Given: its mask when hstrace's bootstrap ran; its parent's where an
OpenMP bind is set in its environment (the worker's engine process); else every online CPU.
`tap_cpus()` (the tap thread): the named CPUs, else it stays where the serving thread runs.
Linux only; elsewhere nothing moves. Measured on the vLLM CPU tiny world (2 cores, bench/README.md
"seventh pass"): the writer on the other core and the tap thread beside the serving thread,
against both beside it and both on the other core.
"""

from __future__ import annotations

import ctypes
import os
import sys

_given: set[int] | None = None


# An OpenMP runtime told to bind (vLLM's CPU worker sets these for each rank it starts) binds the
# thread that loads it: `import torch` in a worker binds its main thread, before any plugin runs.
OMP_BIND = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def remember_given() -> None:
    """Called by the hooks' bootstrap, first thing in every server process. Where an OpenMP bind
    is set, the engine may have bound this thread already: the CPUs this process was started
    with are then its parent's (a worker's engine process), when they include this thread's."""
    global _given
    if _given is None and hasattr(os, "sched_getaffinity"):
        given = set(os.sched_getaffinity(0))
        if any(os.environ.get(name) for name in OMP_BIND):
            try:
                parent = set(os.sched_getaffinity(os.getppid()))
            except OSError:
                parent = set()
            if given <= parent:
                given = parent
        _given = given


def parse_cpus(text: str) -> set[int]:
    """`"1"`, `"2,3"`, `"8-15,20"` -> the CPU numbers (ValueError on anything else)."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if first < 0 or last < first:
            raise ValueError(f"not a CPU range: {part!r}")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError("no CPUs named")
    return cpus


def named_cpus() -> set[int] | None:
    """The CPUs `HSTRACE_RECORD_CPUS` names, or None (unset, unreadable: nothing moves)."""
    named = os.environ.get("HSTRACE_RECORD_CPUS")
    if not named or not hasattr(os, "sched_getaffinity"):
        return None
    try:
        return parse_cpus(named)
    except ValueError:
        return None  # the launcher validates it; a server never fails over it


def tap_cpus() -> set[int] | None:
    """Where the tap thread runs: the named CPUs, else (None) where the thread that serves runs.
    It is a thread of the serving interpreter: only one of them runs Python at a time, and on
    another core it takes the GIL back and forth with the serving thread's polling loop
    (vLLM CPU tiny world: 1.8-2.1 ms of tap CPU per engine step beside the serving thread,
    3.9-4.6 ms on the other core; bench/README.md, issue 29 seventh pass)."""
    return named_cpus()


def spare_cpus() -> set[int] | None:
    """Where the writer process runs, or None where affinity cannot be read."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    if os.environ.get("HSTRACE_RECORD_CPUS"):
        return named_cpus()
    given = _given if _given is not None else set(range(os.cpu_count() or 1))
    engine = set(os.sched_getaffinity(os.getpid()))  # the main thread: the one that serves
    return (given - engine) or given


def move_here(cpus: set[int] | None) -> None:
    """Bind the calling thread (Linux: pid 0 is the calling thread) to `cpus`."""
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:
            pass  # a mask the kernel refuses: the work stays where it is


def move_process(pid: int, cpus: set[int] | None) -> None:
    """Bind another process's main thread (a writer just started) to `cpus`."""
    if cpus:
        try:
            os.sched_setaffinity(pid, cpus)
        except OSError:
            pass


_PR_SET_NAME = 15  # linux/prctl.h


def name_thread(name: str) -> None:
    """Give the calling thread a kernel name (`top -H`, `/proc/PID/task/TID/comm`), so an
    operator, and the bench's per-thread CPU counters, can tell recording work from serving
    (threads otherwise carry their process's name). Linux only; at most 15 bytes are kept."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
