"""Where recording work runs (hstrace.trace.write.placement): off the engine thread's cores."""

from __future__ import annotations

import os
import threading

import pytest

from hstrace.trace.write import placement

linux = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")


def test_cpu_lists_parse_as_taskset_writes_them() -> None:
    assert placement.parse_cpus("1") == {1}
    assert placement.parse_cpus("2,3") == {2, 3}
    assert placement.parse_cpus("8-11,20") == {8, 9, 10, 11, 20}
    for bad in ("", "a", "3-1", "-2", ","):
        with pytest.raises(ValueError):
            placement.parse_cpus(bad)


@linux
def test_named_cpus_win_and_a_bad_name_moves_nothing(monkeypatch) -> None:
    monkeypatch.delenv("HSTRACE_RECORD_CPUS", raising=False)
    assert placement.tap_cpus() is None  # beside the serving thread unless named
    monkeypatch.setenv("HSTRACE_RECORD_CPUS", "0")
    assert placement.spare_cpus() == {0} and placement.tap_cpus() == {0}
    monkeypatch.setenv("HSTRACE_RECORD_CPUS", "zero")
    assert placement.spare_cpus() is None  # the server never fails over it
    assert placement.tap_cpus() is None


@linux
def test_spare_cpus_leave_out_the_engine_threads_cores(monkeypatch) -> None:
    monkeypatch.delenv("HSTRACE_RECORD_CPUS", raising=False)
    given = set(os.sched_getaffinity(0))
    monkeypatch.setattr(placement, "_given", given)
    engine = set(os.sched_getaffinity(os.getpid()))
    spare = placement.spare_cpus()
    assert spare == ((given - engine) or given)
    if len(given) > 1:  # bind the main thread to one core: the rest is spare
        one = min(given)
        os.sched_setaffinity(os.getpid(), {one})
        try:
            assert placement.spare_cpus() == given - {one}
        finally:
            os.sched_setaffinity(os.getpid(), given)


@linux
def test_move_here_binds_only_the_calling_thread() -> None:
    before = set(os.sched_getaffinity(0))
    seen: dict[str, set[int]] = {}

    def worker() -> None:
        placement.move_here({min(before)})
        seen["worker"] = set(os.sched_getaffinity(0))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["worker"] == {min(before)}
    assert set(os.sched_getaffinity(0)) == before


@linux
def test_a_thread_an_openmp_bind_pinned_before_the_bootstrap_still_sees_its_parents_cpus(
    monkeypatch,
) -> None:
    """vLLM's CPU worker starts with OMP_PLACES/OMP_PROC_BIND set: `import torch` binds its main
    thread before hstrace's plugin runs, so its own mask would leave nothing spare."""
    monkeypatch.delenv("HSTRACE_RECORD_CPUS", raising=False)
    parent = set(os.sched_getaffinity(os.getppid()))
    if len(parent) < 2:
        pytest.skip("needs a parent on two CPUs or more")
    one = min(parent)
    before = set(os.sched_getaffinity(0))
    monkeypatch.setattr(placement, "_given", None)
    os.sched_setaffinity(0, {one})  # what the OpenMP runtime did on import
    try:
        for name in placement.OMP_BIND:
            monkeypatch.delenv(name, raising=False)
        placement.remember_given()
        assert placement.spare_cpus() == {one}  # no bind named: only what it was given
        monkeypatch.setattr(placement, "_given", None)
        monkeypatch.setenv("OMP_PLACES", f"{{{one}}}")
        placement.remember_given()
        assert placement.spare_cpus() == parent - {one}
    finally:
        os.sched_setaffinity(0, before)
