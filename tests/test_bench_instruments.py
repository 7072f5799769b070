"""The bench's scratch instrument stays usable: `bench/step_segments.patch` (applied to a copy
of the tree to time vLLM's step in segments, bench/step_segments.py) must apply to this tree.
A patch whose context no longer matches fails at `git apply` with a rejected hunk, which is
how the nineteenth pass's review left it (a removed function named in a hunk's header line)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PATCH = REPO / "bench" / "step_segments.patch"


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_step_segments_patch_applies_to_this_tree() -> None:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    got = subprocess.run(
        ["git", "apply", "--check", str(PATCH)], cwd=REPO, capture_output=True, text=True
    )
    assert got.returncode == 0, got.stderr
    # it patches the files step_segments.py reads the logs of, and nothing else
    touched = {
        line.split(" b/", 1)[1].strip()
        for line in PATCH.read_text().splitlines()
        if line.startswith("diff --git ")
    }
    assert touched == {
        "hooks/common.py",
        "hooks/vllm_patches.py",
        "hstrace/trace/write/rowlog.py",
        "hstrace/trace/write/writer_process.py",
    }


def test_gap_cores_lays_switches_over_steps(tmp_path: Path, monkeypatch) -> None:
    """bench/gap_cores.py: who held each CPU in a gap and in the step before it, from a `perf
    script` of sched_switch events and a step log, on a made-up trace whose answer is known."""
    import json
    import sys

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    sys.modules.pop("gap_cores", None)
    import gap_cores

    log = tmp_path / "log"
    log.mkdir()
    # two armed steps of a round: x at 10.000, e at 10.006, x at 10.008, e at 10.014, x 10.016
    events = [
        ("x", 10.000, True), ("e", 10.006, True), ("x", 10.008, True),
        ("e", 10.014, True), ("x", 10.016, True),
    ]  # fmt: skip
    (log / "gap.1.1.json").write_text(json.dumps(events))

    def sw(cpu: int, t: float, comm: str, pid: int) -> str:
        return (
            f"[00{cpu}] {t:.6f}: sched:sched_switch: prev_comm=x prev_pid=1 prev_prio=120 "
            f"prev_state=R ==> next_comm={comm} next_pid={pid} next_prio=120"
        )

    lines = [
        sw(0, 9.990, "VLLM::Worker", 10),
        sw(0, 10.006, "hstrace-taps", 11),  # the tap thread: the first gap's first 1.5 ms
        sw(0, 10.0075, "VLLM::Worker", 10),
        sw(1, 9.990, "VLLM::EngineCor", 20),
        sw(1, 10.007, "python", 30),  # the API server: 0.5 ms of the gap on CPU 1
        sw(1, 10.0075, "VLLM::EngineCor", 20),
        sw(0, 10.020, "swapper/0", 0),
        sw(1, 10.020, "swapper/1", 0),
    ]
    trace = tmp_path / "sw.txt"
    trace.write_text("\n".join(lines) + "\n")
    runs = gap_cores.switches(trace)
    got = gap_cores.windows(gap_cores.load(str(log))[0], 9.990, 10.020, from_step=1)
    assert [(round(x, 3), round(e, 3), round(nx, 3)) for _, x, e, nx in got] == [
        (10.000, 10.006, 10.008),
        (10.008, 10.014, 10.016),
    ]
    times = {cpu: [t for t, _ in r] for cpu, r in runs.items()}
    first_gap_cpu0 = gap_cores.held(runs[0], times[0], 10.006, 10.008)
    assert {k: round(v * 1e3, 3) for k, v in first_gap_cpu0.items()} == {
        "tap thread": 1.5,
        "worker": 0.5,
    }
    first_gap_cpu1 = gap_cores.held(runs[1], times[1], 10.006, 10.008)
    assert {k: round(v * 1e3, 3) for k, v in first_gap_cpu1.items()} == {
        "engine core": 1.5,
        "python (API server, client)": 0.5,
    }
    # a round's first step is left out from --from-step 2 on
    assert len(gap_cores.windows(gap_cores.load(str(log))[0], 9.990, 10.020, from_step=2)) == 1


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="needs Linux /proc")
def test_placement_books_a_busy_thread_to_its_cpu(monkeypatch) -> None:
    """bench/live_overhead.py's Placement: the on-CPU time of a process's main thread, booked
    to the CPU it ran on. This test's own main thread spins for 0.3 s under it."""
    import os
    import sys
    import time

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    sys.modules.pop("live_overhead", None)
    import live_overhead as lo

    with lo.Placement(os.getpid(), period_s=0.005) as where:
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            pass
    booked = sum(where.ns.values())
    assert 0.1e9 < booked < 0.6e9, where.ns  # about the 0.3 s spun, not nothing, not the clock
    assert set(where.ns) <= os.sched_getaffinity(0)
    share = lo.placement_share([where.ns])
    assert abs(sum(share.values()) - 1.0) < 0.01
    assert lo.placement_share([{}]) == {}


def test_gap_cores_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """A missing trace, a missing or empty step log, a step log that is not JSON: one line on
    stderr naming it, exit 2, no traceback."""
    import sys

    script = REPO / "bench" / "gap_cores.py"
    trace = tmp_path / "sw.txt"
    trace.write_text(
        "[000] 1.000000: sched:sched_switch: prev_comm=a prev_pid=1 prev_prio=120 "
        "prev_state=R ==> next_comm=VLLM::Worker next_pid=10 next_prio=120\n"
    )
    empty = tmp_path / "log"
    empty.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "gap.1.json").write_text("not json")
    cases = [
        ([str(tmp_path / "none.txt"), str(empty)], "no such file"),
        ([str(trace), str(tmp_path / "nolog")], "no such directory"),
        ([str(trace), str(empty)], "no steps logged"),
        ([str(trace), str(broken)], "not a step log"),
    ]
    for argv, said in cases:
        got = subprocess.run(
            [sys.executable, str(script), *argv], capture_output=True, text=True, cwd=tmp_path
        )
        assert got.returncode == 2, (argv, got.stderr)
        lines = got.stderr.strip().splitlines()
        assert len(lines) == 1 and said in lines[0], got.stderr


def test_step_segments_splits_the_gap_at_the_engine_cores_draft_call(monkeypatch) -> None:
    """bench/step_segments.py: where the instrument marks vLLM's `take_draft_token_ids` in the
    gap (d, D), the gap splits into e->d, d->D and D->x, and the tap thread's work spans (w)
    are booked to each part they overlap, on made-up events whose answer is known."""
    import sys

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    sys.modules.pop("step_segments", None)
    import step_segments

    def cycle(t0: float, armed: bool) -> list[tuple]:
        marks = ["x", "X", "s", "r", "R", "p", "P", "e"]
        ev = [(m, t0 + 0.001 * i, armed) for i, m in enumerate(marks)]  # e at t0 + 7 ms
        return ev + [("d", t0 + 0.0075, armed), ("D", t0 + 0.0076, armed)]

    ev = cycle(10.0, True) + cycle(10.009, True) + cycle(10.018, True) + cycle(10.027, True)
    # the tap thread worked from e + 0.2 ms to d + 0.3 ms (0.3 ms in e->d, 0.1 ms in d->D,
    # 0.2 ms in D->x) after the first step
    ev.append(("w", 10.0072, 10.0078))
    ev.sort(key=lambda e: e[1])
    seg = step_segments.segments(ev)[True]
    assert len(seg["gap"]) == 2  # a cycle counts once the next one starts: the last two do not
    assert seg["e->d"][0] == pytest.approx(0.0005)
    assert seg["d->D"][0] == pytest.approx(0.0001)
    assert seg["D->x"][0] == pytest.approx(0.009 - 0.0076)
    assert seg["tap in e->d"][0] == pytest.approx(0.0003)
    assert seg["tap in d->D"][0] == pytest.approx(0.0001)
    assert seg["tap in D->x"][0] == pytest.approx(0.0002)
    assert seg["tap in e->d"][1] == 0.0  # the second gap had no work in it


def test_step_segments_books_the_workers_collections_to_armed_and_dormant_steps(
    monkeypatch, tmp_path
) -> None:
    """bench/step_segments.py: the worker's garbage collections (g, G) go to the step they
    start in, armed or dormant, and its counts of what held steps keep (o) are read; another
    process's log (no step marks) is not the worker's; the writer's log is left out. Made-up
    logs whose answer is known."""
    import json
    import sys

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    sys.modules.pop("step_segments", None)
    import step_segments

    worker = [
        ("g", 0.5, 2), ("G", 0.9, 2),  # start-up, before any step: no step's
        ("x", 1.0, False), ("g", 1.001, 0), ("G", 1.0012, 0),
        ("x", 1.01, True), ("g", 1.011, 0), ("G", 1.0113, 0), ("g", 1.012, 1), ("G", 1.014, 1),
        ("x", 1.02, True),
    ]  # fmt: skip
    (tmp_path / "gap.101.1.json").write_text(json.dumps(worker[:6]))  # dumped at two disarms
    (tmp_path / "gap.101.2.json").write_text(json.dumps(worker[6:]))
    (tmp_path / "gap.202.1.json").write_text(json.dumps([("g", 1.011, 0), ("G", 1.5, 0)]))
    (tmp_path / "gap.writer.303.1.json").write_text(json.dumps([[1.0, 1.1, -2]]))
    got = step_segments.collections(str(tmp_path))
    assert len(got[False][-1]) == 1 and len(got[True][-1]) == 2
    assert got[False][0] == [pytest.approx(0.0002)] and 1 not in got[False]
    assert got[True][0] == [pytest.approx(0.0003)] and got[True][1] == [pytest.approx(0.002)]
    assert 2 not in got[True] and 2 not in got[False]
    # what held steps keep, counted at the disarms: the worker's sessions that held steps
    (tmp_path / "gap.101.3.json").write_text(
        json.dumps(
            [("x", 2.0, True), ("o", 2.1, 130, 4680, [["Tensor", 2210]]), ("o", 3.0, 0, 5, [])]
        )
    )
    (tmp_path / "gap.202.2.json").write_text(json.dumps([("o", 2.2, 9, 99, [])]))  # not the worker
    assert step_segments.held_objects(str(tmp_path)) == [(130, 4680, [["Tensor", 2210]])]


def test_a_disarm_ended_beside_a_round_raises_what_it_raised(monkeypatch) -> None:
    """bench/live_overhead.py's end_beside (`--drain-round`): the disarm runs on a thread while
    the next round is served; a session that did not close clean stops the bench at `result`,
    as a disarm on the main thread would (a bare thread drops a SystemExit silently)."""
    import sys
    import threading

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    sys.modules.pop("live_overhead", None)
    import live_overhead as lo

    gate, ended = threading.Event(), []

    class Session:
        def __init__(self, ok: bool) -> None:
            self.ok = ok

        def end(self, what: str) -> None:
            assert gate.wait(10)
            ended.append(what)
            if not self.ok:
                raise SystemExit(f"{what}: the session did not end cleanly")

    clean = lo.end_beside(Session(True), "round 0")
    broken = lo.end_beside(Session(False), "round 1")
    assert ended == []  # both wait on the gate: the caller went on (the round is served)
    gate.set()
    clean.result()
    with pytest.raises(SystemExit, match="round 1: the session did not end cleanly"):
        broken.result()
    assert sorted(ended) == ["round 0", "round 1"]


def _run_file(path: Path, ratios: list[float]) -> Path:
    import json

    path.write_text(json.dumps({"one_server_armed_vs_dormant": {"ratio_per_pair": ratios}}))
    return path


def test_pool_runs_pools_runs_and_bootstraps_over_runs_then_pairs(tmp_path: Path) -> None:
    """bench/pool_runs.py, the figures' pooling: per-run medians, the pooled median, an
    interval that holds it and widens with the spread between runs, and the difference of two
    sets, on made-up runs whose answers are known; the same files give the same figures."""
    import json
    import sys

    held, streamed = tmp_path / "held", tmp_path / "streamed"
    held.mkdir()
    streamed.mkdir()
    for i, base in enumerate((0.95, 0.96, 0.97)):
        _run_file(held / f"r{i}.json", [base - 0.01, base, base + 0.01])
    for i, base in enumerate((0.90, 0.91)):
        _run_file(streamed / f"r{i}.json", [base - 0.01, base, base + 0.01])
    (held / "failed.json").write_text("")  # a run that failed: skipped, named
    script = REPO / "bench" / "pool_runs.py"
    argv = [sys.executable, str(script), str(held / "*.json"), str(streamed / "*.json")]
    got = subprocess.run(argv, capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    assert "failed.json: empty" in got.stderr
    out = json.loads(got.stdout)
    h, s = out[str(held / "*.json")], out[str(streamed / "*.json")]
    assert h["runs"] == 3 and h["samples"] == 9 and h["per_run_median"] == [0.95, 0.96, 0.97]
    assert h["pooled_median"] == 0.96 and h["ci95"][0] < 0.96 < h["ci95"][1]
    assert 0.94 <= h["ci95"][0] and h["ci95"][1] <= 0.98  # within the samples' range
    assert s["pooled_median"] == 0.905 and s["ci95"][1] < h["ci95"][0]
    d = out["first_minus_second"]
    assert d["ci95"][0] > 0 and d["ci95"][0] <= d["median"] <= d["ci95"][1]
    assert abs(d["median"] - 0.055) <= 0.015
    again = subprocess.run(argv, capture_output=True, text=True)
    assert again.stdout == got.stdout  # fixed seeds


def test_pool_runs_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    import sys

    script = REPO / "bench" / "pool_runs.py"
    (tmp_path / "notjson.json").write_text("{")
    _run_file(tmp_path / "noratios.json", [])
    (tmp_path / "other.json").write_text('{"with_vs_without": {}}')
    (tmp_path / "nan.json").write_text(
        '{"one_server_armed_vs_dormant": {"ratio_per_pair": [0.95, NaN]}}'
    )
    cases = [
        (str(tmp_path / "none-*.json"), "no file matches"),
        (str(tmp_path / "notjson.json"), "not a live_overhead.py run"),
        (str(tmp_path / "other.json"), "not a live_overhead.py run"),
        (str(tmp_path / "noratios.json"), "not a non-empty list of finite numbers"),
        (str(tmp_path / "nan.json"), "not a non-empty list of finite numbers"),
    ]
    for pattern, said in cases:
        got = subprocess.run([sys.executable, str(script), pattern], capture_output=True, text=True)
        assert got.returncode == 2, (pattern, got.stderr)
        lines = got.stderr.strip().splitlines()
        assert len(lines) == 1 and said in lines[0], got.stderr
    three = [sys.executable, str(script), *(str(tmp_path / "other.json"),) * 3]
    got = subprocess.run(three, capture_output=True, text=True)
    assert got.returncode == 2 and got.stderr.strip() == "pool_runs: one or two globs, not 3"


def test_raw_snapshot_times_both_routes_on_the_same_logits() -> None:
    """bench/raw_snapshot.py: the verify's two serving-thread copies side by side; what each
    copies is the drafted rows whole against one value a drafted token (no timing asserted:
    speed is the bench's figure, not a test's)."""
    import json
    import sys

    pytest.importorskip("torch")
    from hstrace.engines import tapmath

    if tapmath.native() is None:
        pytest.skip("the native module is not built")
    script = REPO / "bench" / "raw_snapshot.py"
    argv = [sys.executable, str(script), "--vocab", "64", "1000", "--batch", "2", "--k", "3"]
    got = subprocess.run([*argv, "--calls", "3"], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    out = json.loads(got.stdout)
    for vocab in (64, 1000):
        v = out["by_vocab"][str(vocab)]
        assert v["rows_bytes"] == 2 * 3 * vocab * 4 and v["values_bytes"] == 2 * 3 * 4
        assert v["rows_us"] > 0 and v["values_us"] > 0
