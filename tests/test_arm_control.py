"""The control channel of a dormant server's process (hstrace.hooks.control) and its client
(hstrace.engines.control), without an engine: the real recorder (hstrace.hooks.common.Recorder)
with the real trace writer, its channel on a real unix socket, driven by the real client in
another thread. What a patch point does is played by this test calling `rec.armed` / `emit` as
the engines' wrappers do (the live runs: tests/test_vllm_arm_live.py).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from pathlib import Path

import pytest
from helpers.armed import arm_in_thread
from hstrace.hooks import common, control
from hstrace.hooks.common import Recorder

from hstrace.engines import control as client
from hstrace.engines.protocol import WORK_LEVELS, dormant_env
from hstrace.engines.rows import requests_write
from hstrace.errors import HstraceError, TraceError
from hstrace.trace import open_trace


@pytest.fixture
def dormant(tmp_path):
    run = tmp_path / "run"
    rec = Recorder(json.loads(dormant_env("vllm", str(run))), (0, 32, 0))
    channel = control.serve(rec, "vllm")
    assert channel is not None
    yield rec, run, channel
    rec.disarm()
    if channel.server is not None:
        channel.server.close()
    channel._unlink()


def step(rec: Recorder, rid: str) -> None:
    """What a per-step patch point does: one flag check, then rows."""
    if rec.armed:
        rec.step_requests([rid], [rid])
        rec.emit([requests_write([rid], [[1, 2, 3]], [0])])


def test_dormant_records_nothing_and_keeps_the_static_audit(dormant, tmp_path) -> None:
    rec, run, _ = dormant
    assert not rec.armed
    rec.static({"weights": {"loaded": ["fc.weight"]}})
    step(rec, "before-arm")
    assert rec._writer is None  # no trace opened, no row written while dormant
    sock = next(run.glob("*.sock"))
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    conn = client.Connection(sock)
    try:  # which process answers, and the audit it keeps for the next session
        hello = conn.ask({"cmd": "hello"})
    finally:
        conn.close()
    assert hello["pid"] == os.getpid() and hello["armed"] is False
    assert hello["audit"] == ["weights"]
    assert (
        hello["title"]
        == Path("/proc/self/cmdline")
        .read_bytes()
        .replace(b"\0", b" ")
        .decode(errors="replace")
        .strip()
    )

    out = tmp_path / "a.zarr"
    t, box = arm_in_thread(run, out)
    assert rec.armed
    step(rec, "r1")
    step(rec, "r2")
    assert client.disarm(str(run)) == {os.getpid(): True}
    t.join(30)
    session = box["session"]
    assert session.ended == {os.getpid(): "disarm"} and session.ok
    assert [r["title"] for r in session.armed] == [hello["title"]]  # what `hstrace arm` prints
    assert not rec.armed
    step(rec, "after-disarm")
    with open_trace(out) as tr:
        assert tr.meta["static"]["weights"] == {"loaded": ["fc.weight"]}  # kept from load
        assert tr.rank(0).table("requests").num_steps == 2  # r1, r2 only
        assert tr.meta["record"]["ended"] == {str(os.getpid()): "disarm"}

    # a second session in the same process: its own trace, the audit again
    out2 = tmp_path / "b.zarr"
    t, box = arm_in_thread(run, out2)
    step(rec, "r3")
    client.disarm(str(run))
    t.join(30)
    with open_trace(out2) as tr:
        assert tr.meta["static"]["weights"] == {"loaded": ["fc.weight"]}
        assert tr.rank(0).table("requests").num_steps == 1


def test_a_dead_client_leaves_no_hooks_armed(dormant, tmp_path) -> None:
    rec, run, channel = dormant
    from hstrace.trace import create_trace

    out = tmp_path / "lease.zarr"
    create_trace(out, engine={"name": "vllm"}, command_line=[])
    conn = client.Connection(next(run.glob("*.sock")))
    reply = conn.ask({"cmd": "arm", "out": str(out), "streams": ["requests"]})
    assert reply["armed"] and rec.armed
    step(rec, "r1")
    conn.close()  # the client dies: its connection closes
    deadline = time.monotonic() + 10
    while channel.lease is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    with channel.lock:  # held by the channel until the trace is closed
        assert not rec.armed
    with open_trace(out) as tr:
        assert tr.rank(0).table("requests").num_steps == 1  # what was recorded is closed


def test_limits_end_the_session_inside_the_server(dormant, tmp_path) -> None:
    rec, run, _ = dormant
    t, box = arm_in_thread(run, tmp_path / "d.zarr", duration_s=0.3)
    t.join(30)
    assert box["session"].ended == {os.getpid(): "duration"} and not rec.armed

    # --requests 2: the first two are waited for to the end (r2 still in the batch: armed)
    t, box = arm_in_thread(run, tmp_path / "r.zarr", requests=2)
    rec.step_requests(["r1"], ["r1"])
    rec.step_requests(["r2"], ["r1", "r2"])
    rec.step_requests(["r3"], ["r2", "r3"])
    assert rec.armed
    rec.step_requests([], ["r3"])  # neither r1 nor r2 left: the session ends
    t.join(30)
    assert box["session"].ended == {os.getpid(): "requests"} and not rec.armed


def test_one_session_at_a_time(dormant, tmp_path) -> None:
    rec, run, _ = dormant
    t, _ = arm_in_thread(run, tmp_path / "one.zarr")
    with pytest.raises(HstraceError, match="already armed"):
        client.arm(str(run), tmp_path / "two.zarr", ["requests"])
    assert rec.armed  # the refused client did not end the first session
    client.disarm(str(run))
    t.join(30)
    assert not rec.armed


def test_a_work_level_the_hooks_do_not_take_is_refused_and_leaves_them_dormant(
    dormant, tmp_path
) -> None:
    """The bench's `work` levels (protocol.WORK_LEVELS) are the vLLM V1 hooks'; hooks that
    take only a recording refuse the others by name, never record something else instead."""
    rec, run, _ = dormant
    assert set(Recorder.WORK_LEVELS) < set(WORK_LEVELS)
    with pytest.raises(HstraceError, match=r"work 'collect': this engine's hooks take rows"):
        client.arm(str(run), tmp_path / "w.zarr", ["requests"], work="collect")
    assert not rec.armed and not rec.session_open and rec.work == "rows"
    t, box = arm_in_thread(run, tmp_path / "rows.zarr", work="rows")  # the default still arms
    assert "error" not in box and rec.armed and rec.work == "rows"
    client.disarm(str(run))
    t.join(30)


def test_server_given_as_a_pid_names_its_run_dir(tmp_path) -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "HSTRACE_RECORD"}
    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    dormant_proc = subprocess.Popen(
        sleep, env={**env, "HSTRACE_RECORD": dormant_env("vllm", str(tmp_path / "run"))}
    )
    plain = subprocess.Popen(sleep, env=env)
    try:
        assert client.run_dir_of(str(dormant_proc.pid)) == tmp_path / "run"
        with pytest.raises(HstraceError, match="not started dormant"):
            client.run_dir_of(str(plain.pid))
    finally:
        for proc in (dormant_proc, plain):
            proc.kill()
            proc.wait()
    with pytest.raises(HstraceError, match="neither a run directory nor a process id"):
        client.run_dir_of(str(tmp_path / "nowhere"))


def test_a_run_dir_open_to_others_is_refused(tmp_path) -> None:
    run = tmp_path / "open"
    run.mkdir(mode=0o755)
    os.chmod(run, 0o755)
    rec = Recorder(json.loads(dormant_env("vllm", str(run))), (0, 32, 0))
    assert control.serve(rec, "vllm") is None  # serving goes on, unarmable, said on stderr
    assert not list(run.glob("*.sock"))


def test_socket_peer_credentials_are_the_kernels(dormant) -> None:
    _, run, _ = dormant
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(next(run.glob("*.sock"))))
        s.sendall(b'{"cmd": "hello"}\n')
        reply = json.loads(s.makefile().readline())
    assert {k: reply[k] for k in ("pid", "engine", "version", "armed", "audit")} == {
        "pid": os.getpid(),
        "engine": "vllm",
        "version": "0.32.0",
        "armed": False,
        "audit": [],
    }


def test_a_disarm_waits_for_the_step_in_flight_and_the_tap_thread(dormant, tmp_path) -> None:
    """The step a disarm interrupts began armed: its rows (handed to the tap thread after the
    disarm was asked for) are in the session's trace, and nothing after it."""
    rec, run, channel = dormant
    out = tmp_path / "inflight.zarr"
    t, box = arm_in_thread(run, out)
    rec.stepping = True  # a step wrapper is collecting (vllm_patches.propose_draft_token_ids)
    asked = threading.Thread(target=client.disarm, args=(str(run),), daemon=True)
    asked.start()
    deadline = time.monotonic() + 10
    while rec.armed and time.monotonic() < deadline:  # the disarm has begun
        time.sleep(0.01)
    assert not rec.armed and rec.session_open
    rec.defer(lambda: rec.emit([requests_write(["in-flight"], [[4, 5]], [0])]))
    rec.stepping = False
    asked.join(30)
    t.join(30)
    assert box["session"].ended == {os.getpid(): "disarm"}
    step(rec, "after")  # dormant again: not recorded
    with open_trace(out) as tr:
        assert tr.rank(0).clean_close
        assert tr.rank(0).table("requests").num_rows("req") == 1


def test_an_audit_item_that_is_not_json_data_is_refused_once_not_kept(dormant, tmp_path) -> None:
    """Kept unchecked, it failed every later arm (the writer sends audit items as JSON data)."""
    rec, run, _ = dormant
    with pytest.raises(TraceError, match="static audit items must be JSON data"):
        rec.static({"weights_dir": object()})
    rec.static({"weights": {"loaded": ["fc.weight"]}})
    assert list(rec.kept_static) == ["weights"]
    out = tmp_path / "a.zarr"
    t, box = arm_in_thread(run, out)
    assert rec.armed
    step(rec, "r1")
    client.disarm(str(run))
    t.join(30)
    assert box["session"].ok
    with open_trace(out) as tr:
        assert tr.meta["static"]["weights"] == {"loaded": ["fc.weight"]}


def test_a_paced_tap_thread_starts_a_step_when_the_engine_says_it_ended() -> None:
    """Paced (vLLM V1: `sample_tokens` returned), a step handed over is held, not queued, until
    the step's end: the tap thread is not woken while the step's own Python still runs, and
    builds the rows after. Held steps go in the order they came; a drain (disarm, close)
    queues the held ones without a cue, and a cue that never comes holds at most DEFER_DEPTH
    steps: nothing is dropped."""
    rec = Recorder({"streams": []}, (0, 32, 0))
    rec.paced = True
    ran: list[str] = []
    rec.defer(lambda: ran.append("one"))
    time.sleep(0.2)
    assert ran == [] and rec._deferred.qsize() == 0  # held: the tap thread was not woken
    rec.step_ended()
    rec.drain()
    assert ran == ["one"]
    block = threading.Event()
    rec.defer(block.wait)  # occupies the thread once its cue comes
    rec.step_ended()
    rec.defer(lambda: ran.append("two"))
    rec.defer(lambda: ran.append("three"))
    block.set()
    time.sleep(0.2)
    assert ran == ["one"]  # both wait for their step's end, however idle the thread
    rec.step_ended()
    rec.defer(lambda: ran.append("four"))  # its end never comes: the drain queues it
    rec.drain()
    assert ran == ["one", "two", "three", "four"]
    for i in range(Recorder.DEFER_DEPTH):  # no cue at all: held up to DEFER_DEPTH, then queued
        rec.defer(lambda i=i: ran.append(f"n{i}"))
    deadline = time.monotonic() + 10
    while len(ran) < 4 + Recorder.DEFER_DEPTH and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran[4:] == [f"n{i}" for i in range(Recorder.DEFER_DEPTH)]


def test_the_engines_step_start_and_end_reach_the_writer_and_never_raise() -> None:
    """vLLM's hooks tell the writer when a step starts (`execute_model`) and ends
    (`sample_tokens`): `TraceWriter.step_phase`, which keeps the writer process's work out
    of the gap between steps. A writer without it, or one whose mark fails, changes nothing
    for the engine."""

    class Writer:
        def __init__(self) -> None:
            self.marks: list[bool] = []

        def step_phase(self, running: bool) -> None:
            self.marks.append(running)

    rec = Recorder({"streams": []}, (0, 32, 0))
    rec.step_started()  # no writer yet: nothing to tell
    w = rec._writer = Writer()
    rec.step_started()
    rec.step_ended()
    assert w.marks == [True, False]

    class Broken:
        def step_phase(self, running: bool) -> None:
            raise OSError("the ring is gone")

    rec._writer = Broken()
    rec.step_started()
    rec.step_ended()
    rec._writer = object()  # a writer with no step_phase
    rec.step_started()
    rec.step_ended()


def test_the_tap_thread_gives_way_to_a_step_that_began_and_goes_on_at_its_end(
    monkeypatch,
) -> None:
    """Between the stages of a step's rows (`Recorder.make_way`), the tap thread yields, and
    if the engine's next step has begun it waits for that step's end before its next stage:
    its work stays in the gaps between steps, not beside the step on the serving thread's
    core. Never on the serving thread (inline work is the step's own), never longer than
    GAP_WAIT_S, and a disarm (no step end will come) lets it go on at once;
    HSTRACE_TAP_YIELD=0 turns it off."""
    rec = Recorder({"streams": []}, (0, 32, 0))
    rec.paced = True
    rec.GAP_WAIT_S = 30.0  # long: a test that waits it out fails on time, not by luck
    stages: list[str] = []

    def work() -> None:
        stages.append("a")
        rec.make_way()
        stages.append("b")

    def waiting() -> None:  # the tap thread has stopped at make_way for the step's end
        deadline = time.monotonic() + 10
        while rec._gap_waiter is None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert rec._gap_waiter is not None and stages == ["a"]

    rec.step_started()
    t0 = time.monotonic()
    rec.make_way()  # the serving thread: returns at once, however long the step
    assert time.monotonic() - t0 < 10
    rec.defer(work)
    rec._release()  # queued mid-step (as a full hold is)
    waiting()
    time.sleep(0.1)
    assert stages == ["a"]  # stage b waits for the step's end
    rec.step_ended()
    rec.drain()
    assert stages == ["a", "b"]

    # a disarm mid-step: no step end will be told, the tap thread goes on
    stages.clear()
    rec.armed = rec.session_open = True
    rec.step_started()
    rec.defer(work)
    rec._release()
    waiting()
    t0 = time.monotonic()
    assert rec.disarm()
    assert stages == ["a", "b"] and time.monotonic() - t0 < 10

    # switched off: no wait, even mid-step
    monkeypatch.setenv("HSTRACE_TAP_YIELD", "0")
    assert not Recorder({"streams": []}, (0, 32, 0)).give_way  # what the switch sets
    stages.clear()
    rec.give_way = False
    rec.step_started()
    rec.defer(work)
    rec._release()
    t0 = time.monotonic()
    rec.drain()
    assert stages == ["a", "b"] and time.monotonic() - t0 < 10
    rec.step_ended()


def test_the_tap_threads_wait_for_a_gap_is_bounded_and_never_with_a_backlog() -> None:
    """A step end that never comes holds the tap thread GAP_WAIT_S at most; with half the
    queue waiting behind it, it does not wait at all: waiting would let the queue fill and
    block serving."""
    rec = Recorder({"streams": []}, (0, 32, 0))
    rec.paced = True
    rec.GAP_WAIT_S = 0.3
    waited: list[float] = []

    def work() -> None:
        t0 = time.monotonic()
        rec.make_way()
        waited.append(time.monotonic() - t0)

    rec.step_started()
    rec.defer(work)
    rec._release()
    rec.drain()
    assert waited[0] >= 0.25  # waited for an end that never came, then went on

    rec.GAP_WAIT_S = 30.0
    waited.clear()
    gate = threading.Event()
    rec.defer(lambda: gate.wait(10))
    for _ in range(Recorder.DEFER_DEPTH // 2 + 1):
        rec.defer(work)
    rec._release()
    gate.set()
    deadline = time.monotonic() + 10
    while not waited and time.monotonic() < deadline:
        time.sleep(0.001)
    assert waited and waited[0] < 10  # the first ran with the rest queued behind it
    rec.step_ended()  # the later ones (a shorter queue behind them) waited for it
    rec.drain()
    assert len(waited) == Recorder.DEFER_DEPTH // 2 + 1


def test_fine_way_gives_way_between_the_tables_of_a_stage_and_the_top_ks_calls(
    monkeypatch,
) -> None:
    """With `fine_way` (the default; HSTRACE_TAP_FINE=0 turns it off), the tap thread also
    gives way inside a stage: before each table a stage stages (`vllm_patches._emit_built`:
    the first after the rows are built, the others between tables), never inside
    `Recorder.emit`, which holds the session's lock, and between the draft top-k's native
    calls (`taps.finish_topk`'s `between`); with it off, `make_way_within` does nothing. The
    tables written are the same either way."""
    import torch
    from hstrace.hooks.vllm_patches import _emit_built

    from hstrace.engines import tapmath
    from hstrace.engines.rows import TableWrite
    from hstrace.engines.vllm import taps

    seen: list[str] = []

    class Writer:
        def write(self, table: str, **kwargs) -> None:
            seen.append(table)

    tables = [TableWrite("a"), TableWrite("skipped"), TableWrite("b"), TableWrite("c")]
    for fine in ("1", "0"):
        monkeypatch.setenv("HSTRACE_TAP_FINE", fine)
        rec = Recorder({"streams": ["a", "b", "c"]}, (0, 32, 0))
        assert rec.fine_way is (fine == "1")
        rec.make_way = lambda: seen.append("way")  # type: ignore[method-assign]
        rec.writer_factory = lambda rank: Writer()
        rec.session_open = True
        rec.emit(tables)  # emit itself never gives way (it holds session_lock)
        assert seen == ["a", "b", "c"]
        seen.clear()
        _emit_built(rec, tables)
        if fine == "1":
            assert seen == ["way", "a", "way", "b", "way", "c"]
        else:
            assert seen == ["a", "b", "c"]
        seen.clear()

    if tapmath.native() is None:
        pytest.skip("the native top-k is not built")
    gen = torch.Generator().manual_seed(0)
    calls = [
        taps.DraftCall(torch.zeros(2, dtype=torch.int64), torch.zeros(2), None) for _ in range(3)
    ]
    for c in calls:
        c.logits = torch.randn(2, 16, generator=gen)
    step = taps.Step(req_ids=["r0", "r1"], num_draft_tokens=[0, 0], calls=calls)
    between: list[int] = []
    taps.finish_topk(step, between=lambda: between.append(1))
    assert len(between) == 2 and all(c.topk is not None and c.logits is None for c in calls)


def _policy(tid: int) -> int:
    return os.sched_getscheduler(tid)


@pytest.mark.skipif(
    not hasattr(os, "SCHED_IDLE") or not common._may_restore_policy(),
    reason="this process may not raise a thread back from SCHED_IDLE (no CAP_SYS_NICE, "
    "RLIMIT_NICE 0): the hooks then never lower it (the next test)",
)
def test_a_step_that_starts_mid_stage_lowers_the_tap_thread_until_it_ends() -> None:
    """A step that starts while the tap thread is mid-stage (it gives way only between
    stages) puts it in SCHED_IDLE until the step ends or a disarm says none runs: the kernel
    runs it only when the serving thread's core would idle (bench/README.md, twenty-third
    pass). A tap thread waiting for work or for a gap is left as it is."""
    rec = Recorder({"streams": []}, (0, 32, 0))
    rec.paced = True
    gate, inside = threading.Event(), threading.Event()

    def stage() -> None:  # mid-stage: neither waiting for work nor for a gap
        inside.set()
        gate.wait(10)

    rec.defer(stage)
    rec.step_ended()
    assert inside.wait(10)
    tid = rec._tap_tid
    assert tid is not None and _policy(tid) == os.SCHED_OTHER
    rec.step_started()
    assert _policy(tid) == os.SCHED_IDLE
    rec.step_ended()
    assert _policy(tid) == os.SCHED_OTHER
    rec.step_started()
    assert _policy(tid) == os.SCHED_IDLE
    rec.armed = rec.session_open = True
    gate.set()
    assert rec.disarm()  # no step end will come: raised back all the same
    assert _policy(tid) == os.SCHED_OTHER and not rec._tap_lowered

    # behind (half the queue waiting): not lowered, it must keep up
    gate.clear()
    inside.clear()
    rec.defer(stage)
    rec.step_ended()
    assert inside.wait(10)
    for _ in range(Recorder.DEFER_DEPTH // 2):
        rec.defer(lambda: None)
    rec._release()
    rec.step_started()
    assert _policy(tid) == os.SCHED_OTHER and not rec._tap_lowered
    gate.set()
    rec.step_ended()
    rec.drain()

    # parked (waiting for work): a step's start leaves it alone
    deadline = time.monotonic() + 10
    while not rec._tap_parked and time.monotonic() < deadline:
        time.sleep(0.001)
    rec.step_started()
    assert _policy(tid) == os.SCHED_OTHER and not rec._tap_lowered
    rec.step_ended()


def test_the_tap_thread_is_never_lowered_where_it_could_not_be_raised_back(
    monkeypatch,
) -> None:
    """Lowered to SCHED_IDLE, a thread needs CAP_SYS_NICE or RLIMIT_NICE to leave it; without
    them the hooks never lower it (a tap thread stuck there would starve beside vLLM's
    spinning worker). A kernel that refuses a change turns it off for good; HSTRACE_TAP_IDLE=0
    turns it off; neither ever reaches the engine."""
    assert common._may_raise_back(soft_rlimit=0, nice=0, cap_eff=0) is False
    assert common._may_raise_back(soft_rlimit=20, nice=0, cap_eff=0) is True
    assert common._may_raise_back(soft_rlimit=10, nice=10, cap_eff=0) is True
    assert common._may_raise_back(soft_rlimit=0, nice=0, cap_eff=1 << 23) is True  # SYS_NICE
    assert common._may_raise_back(soft_rlimit=0, nice=0, cap_eff=(1 << 23) - 1) is False

    calls: list[tuple[int, int]] = []

    def refuse(tid: int, policy: int, param: object) -> None:
        calls.append((tid, policy))
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(common.os, "sched_setscheduler", refuse)
    rec = Recorder({"streams": []}, (0, 32, 0))
    rec.paced = True
    rec._tap_tid, rec._tap_parked = 12345, False  # a tap thread mid-stage
    rec.step_started()  # refused: never raises, and off from now on
    assert calls == [(12345, os.SCHED_IDLE)] and rec._tap_tid is None and not rec._tap_lowered
    rec.step_ended()
    rec.step_started()
    assert len(calls) == 1

    monkeypatch.setattr(common, "_may_restore_policy", lambda: False)
    rec = Recorder({"streams": []}, (0, 32, 0))
    rec.paced = True
    rec.defer(lambda: None)
    rec.step_ended()
    rec.drain()
    assert rec._tap_tid is None  # the tap thread runs, never to be lowered

    # a thread that does not start in SCHED_OTHER (an operator's SCHED_BATCH, say) is left
    # alone: raising it back would not restore what it had
    monkeypatch.setattr(common, "_may_restore_policy", lambda: True)
    monkeypatch.setattr(common.os, "sched_getscheduler", lambda pid: os.SCHED_BATCH)
    rec = Recorder({"streams": []}, (0, 32, 0))
    rec.paced = True
    rec.defer(lambda: None)
    rec.step_ended()
    rec.drain()
    assert rec._tap_tid is None

    monkeypatch.setenv("HSTRACE_TAP_IDLE", "0")
    assert not Recorder({"streams": []}, (0, 32, 0)).step_idle


class _Holds(Recorder):
    HOLDS = True  # as vLLM V1's recorder: its step taps hand their work to the tap thread


@pytest.fixture
def holding(tmp_path):
    run = tmp_path / "run-held"  # its own run dir: beside `dormant`, a socket of the same pid
    rec = _Holds(json.loads(dormant_env("vllm", str(run))), (0, 32, 0))
    rec.paced = True  # vLLM V1: the step's end is told (`step_ended`)
    channel = control.serve(rec, "vllm")
    assert channel is not None
    yield rec, run
    rec.disarm()
    if channel.server is not None:
        channel.server.close()
    channel._unlink()


def held_step(rec: Recorder, rid: str, ran: list[str], nbytes: int = 1000) -> None:
    """What vLLM's step wrapper does armed: the step's work handed over (`defer`), with the
    bytes its copies hold; then the step's end."""
    rec.defer(
        lambda: (ran.append(rid), rec.emit([requests_write([rid], [[1, 2, 3]], [0])])), nbytes
    )
    rec.step_ended()


def wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def committed_requests(out: Path) -> int:
    """The request rows a trace still being written has committed on disk."""
    with open_trace(out) as tr:
        table = tr.rank(0).table("requests")  # (none before the first commit)
        return 0 if table is None else table.num_rows("req")


def test_a_held_session_builds_its_rows_only_when_the_server_is_quiet(holding, tmp_path) -> None:
    """`hstrace arm --hold-mb`: while the server serves (steps told), the steps handed over
    stay in memory (the tap thread is not woken, nothing reaches the writer); once no step has
    run for IDLE_S they are built, in order, while the session is still armed (the tap thread
    was blocked on its queue by a streamed session before: the arm wakes it) and committed on
    disk while it is quiet, and the memory they took is free again; steps held after that are
    built at the disarm, into a trace that closes clean."""
    rec, run = holding
    t, box = arm_in_thread(run, tmp_path / "streamed.zarr")  # starts the tap thread
    ran: list[str] = []
    held_step(rec, "s0", ran)
    assert wait_for(lambda: ran == ["s0"]) and rec.armed  # streamed: built while armed
    client.disarm(str(run))
    t.join(30)

    out = tmp_path / "held.zarr"
    t, box = arm_in_thread(run, out, hold_mb=1)
    assert "error" not in box and rec.hold_bytes == 2**20
    serving = Serving(rec)
    for i in range(20):  # 20 KB held of 1 MiB
        held_step(rec, f"r{i}", ran)
    time.sleep(0.3)
    assert ran == ["s0"] and rec._deferred.qsize() == 0 and len(rec._held) == 20
    assert rec._writer is None and serving.steps >= 20  # no row written: no writer opened
    serving.end()  # quiet: built now, the session still armed and holding
    assert wait_for(lambda: len(ran) == 21)
    assert ran == ["s0"] + [f"r{i}" for i in range(20)]
    # and committed while quiet (`_flush_quiet`), not at the writer's tail flush 2 s later
    assert wait_for(lambda: committed_requests(out) == 20, timeout=1.0)
    assert rec.armed and rec.hold_bytes == 2**20 and not rec._held and rec._writer is not None
    assert rec._hold_used - rec._hold_freed == 0
    serving = Serving(rec)
    for i in range(20, 25):  # held again while it serves; built at the disarm
        held_step(rec, f"r{i}", ran)
    time.sleep(0.2)
    assert len(ran) == 21 and len(rec._held) == 5
    serving.end()
    client.disarm(str(run))
    t.join(30)
    assert box["session"].ok and ran == ["s0"] + [f"r{i}" for i in range(25)]
    assert rec.hold_bytes is None and not rec._held
    with open_trace(out) as tr:
        assert tr.rank(0).clean_close
        assert tr.rank(0).table("requests").num_rows("req") == 25
    # the next session, armed without a hold, streams again: the tap thread builds each step
    t, box = arm_in_thread(run, tmp_path / "streamed2.zarr")
    assert rec.hold_bytes is None
    serving = Serving(rec)
    held_step(rec, "s1", ran)
    assert wait_for(lambda: ran[-1] == "s1") and rec.armed  # built while serving, armed
    serving.end()
    client.disarm(str(run))
    t.join(30)


def test_steps_built_in_a_quiet_moment_free_their_share_of_the_hold(holding, tmp_path) -> None:
    """The hold counts what is held now: steps built in a quiet moment give their bytes
    back, so a session whose bursts each fit in `hold_mb` never runs over it (counting every
    step ever held, the second burst here would: 2 x 0.75 MiB)."""
    rec, run = holding
    t, box = arm_in_thread(run, tmp_path / "bursts.zarr", hold_mb=1)
    ran: list[str] = []
    for burst in range(2):
        serving = Serving(rec)
        for i in range(3):
            held_step(rec, f"b{burst}-{i}", ran, nbytes=2**18)
        assert rec.hold_bytes == 2**20 and len(rec._held) == 3  # held, not run over
        serving.end()
        assert wait_for(lambda burst=burst: len(ran) == 3 * (burst + 1))
    assert rec.hold_bytes == 2**20 and not rec._releasing
    client.disarm(str(run))
    t.join(30)
    assert box["session"].ok and ran == [f"b{b}-{i}" for b in range(2) for i in range(3)]


def test_a_hold_that_runs_over_streams_on_in_order_and_never_blocks_serving(
    holding, tmp_path
) -> None:
    """Past `hold_mb`, the held steps (more than the tap thread's queue takes) go to the tap
    thread from a thread of their own, so the step that ran over does not wait for them; the
    steps that come while they are queued join them in order, and the disarm writes the rest:
    nothing dropped, nothing reordered. (From then on a step waits only as a streamed one does,
    for a full queue.)"""
    rec, run = holding
    out = tmp_path / "over.zarr"
    t, box = arm_in_thread(run, out, hold_mb=1)
    serving = Serving(rec)  # never quiet: nothing held is built before it runs over
    gate = threading.Event()
    ran: list[str] = []
    rec.defer(lambda: (gate.wait(10), ran.append("gate")), 0)  # holds the tap thread up
    n = 3 * Recorder.DEFER_DEPTH  # more than the tap thread's queue takes
    for i in range(n):
        held_step(rec, f"r{i}", ran)
    assert rec.hold_bytes is not None and len(rec._held) == n + 1
    t0 = time.monotonic()
    held_step(rec, f"r{n}", ran, nbytes=2**20)  # runs over 1 MiB
    for i in range(n + 1, n + 4):  # the release is stuck behind the tap thread: these join it
        held_step(rec, f"r{i}", ran)
    assert time.monotonic() - t0 < 1.0  # a queue put here would have waited for the gate
    assert rec.hold_bytes is None and rec._releasing and ran == []
    gate.set()
    serving.end()
    client.disarm(str(run))
    t.join(30)
    assert box["session"].ok and not rec._releasing
    assert ran == ["gate"] + [f"r{i}" for i in range(n + 4)]
    with open_trace(out) as tr:
        assert tr.rank(0).table("requests").num_rows("req") == n + 4


def test_a_hold_that_ran_over_holds_again_once_its_backlog_is_built_and_the_server_quiet(
    holding, tmp_path
) -> None:
    """Past `hold_mb` a held session streams (the backlog and the steps that follow go to the
    tap thread as they come); once that backlog is built and the server is quiet it holds
    again, with the whole `hold_mb` free: the next burst is held while the server serves, and
    built in the next quiet moment; every step in order."""
    rec, run = holding
    out = tmp_path / "again.zarr"
    t, box = arm_in_thread(run, out, hold_mb=1)
    ran: list[str] = []
    serving = Serving(rec)
    for i in range(3):
        held_step(rec, f"a{i}", ran, nbytes=2**19)  # the third runs over 1 MiB
    assert rec.hold_bytes is None  # streams now
    for i in range(3, 6):  # built as they come, while it serves
        held_step(rec, f"a{i}", ran)
    assert wait_for(lambda: len(ran) == 6) and rec.hold_bytes is None
    serving.end()  # quiet: the backlog is built, so it holds again
    assert wait_for(lambda: rec.hold_bytes == 2**20)
    serving = Serving(rec)
    for i in range(6, 9):  # 1.5 MiB counted in all, 0.75 held now: no run-over
        held_step(rec, f"a{i}", ran, nbytes=2**18)
    time.sleep(0.3)
    assert len(ran) == 6 and len(rec._held) == 3 and rec.hold_bytes == 2**20
    serving.end()
    assert wait_for(lambda: len(ran) == 9) and rec.armed
    client.disarm(str(run))
    t.join(30)
    assert box["session"].ok and ran == [f"a{i}" for i in range(9)]
    with open_trace(out) as tr:
        assert tr.rank(0).table("requests").num_rows("req") == 9


def test_the_default_hold_streams_in_hooks_that_cannot_hold(dormant, holding, tmp_path) -> None:
    """`hstrace arm` without `--hold-mb` asks for its default hold with `hold_auto`: hooks that
    cannot hold (SGLang's, here the base recorder) stream instead of refusing, and say they do
    not hold; hooks that can hold do (`Session.held` names the processes that held)."""
    rec, run, _ = dormant
    t, box = arm_in_thread(run, tmp_path / "auto.zarr", hold_mb=64, hold_auto=True)
    assert "error" not in box and rec.armed and rec.hold_bytes is None
    step(rec, "r1")
    client.disarm(str(run))
    t.join(30)
    assert box["session"].ok and box["session"].held == []
    with open_trace(tmp_path / "auto.zarr") as tr:
        assert tr.meta["record"]["held"] == []
        assert tr.rank(0).table("requests").num_rows("req") == 1
    rec, run = holding
    t, box = arm_in_thread(run, tmp_path / "auto-held.zarr", hold_mb=64, hold_auto=True)
    assert rec.hold_bytes == 64 * 2**20
    client.disarm(str(run))
    t.join(30)
    assert box["session"].held == [os.getpid()]


def test_a_hold_is_refused_by_hooks_that_cannot_hold_and_when_not_a_positive_size(
    dormant, holding, tmp_path
) -> None:
    rec, run, _ = dormant  # the base recorder: SGLang's hooks build a step's rows as it runs
    with pytest.raises(HstraceError, match="hold_mb: this engine's hooks build a step's rows"):
        client.arm(str(run), tmp_path / "h.zarr", ["requests"], hold_mb=64)
    assert not rec.armed and not rec.session_open and rec.hold_bytes is None
    rec, run = holding
    for bad in (0, -1, float("nan"), float("inf"), "64", True):
        with pytest.raises(HstraceError, match="hold_mb must be a positive number of MiB"):
            client.arm(str(run), tmp_path / f"bad-{bad}.zarr", ["requests"], hold_mb=bad)
        assert not rec.armed and rec.hold_bytes is None
    assert common.hold_limit(0.5) == 2**19 and common.hold_limit(None) is None


class Serving:
    """The engine's serving thread while a held session drains: its step cues, told as vLLM's
    wrappers tell them (only while `rec.cued`), a step every `every_s`, until stopped."""

    def __init__(self, rec: Recorder, every_s: float = 0.005) -> None:
        self.rec, self.every_s, self.stop, self.steps = rec, every_s, threading.Event(), 0
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        rec = self.rec
        while not self.stop.is_set():
            if rec.cued:  # what `wrap_execute_model` / `wrap_sample_tokens` read
                rec.step_started()
                time.sleep(self.every_s / 2)
                if rec.cued:
                    rec.step_ended()
                self.steps += 1
            time.sleep(self.every_s / 2)

    def end(self) -> None:
        self.stop.set()
        self.thread.join(10)


def disarm_in_thread(run: Path) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def go() -> None:
        box["reply"] = client.disarm(str(run))

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, box


def test_a_held_sessions_rows_wait_for_a_quiet_server_at_the_disarm(holding, tmp_path) -> None:
    """The disarm of a held session: while the server serves on (steps told), the held steps
    are not built; the step cues go on meanwhile; once no step has run for IDLE_S, they are
    built in order and the trace closes clean; then the cues stop."""
    rec, run = holding
    out = tmp_path / "quiet.zarr"
    t, box = arm_in_thread(run, out, hold_mb=1)
    ran: list[str] = []
    serving = Serving(rec)  # never quiet while armed
    for i in range(12):  # more than the tap thread's queue takes: the disarm's thread queues
        held_step(rec, f"r{i}", ran)
    d, reply = disarm_in_thread(run)
    time.sleep(0.6)
    steps = serving.steps
    assert ran == [] and rec.draining and rec.cued and not rec.armed  # waiting, cues told
    assert steps >= 20 and d.is_alive()
    serving.end()  # the server goes quiet: the rows are built now
    d.join(30)
    t.join(30)
    assert not d.is_alive() and reply["reply"] == {os.getpid(): True}
    assert box["session"].ok and ran == [f"r{i}" for i in range(12)]
    assert not rec.draining and not rec.cued and not rec.in_step
    with open_trace(out) as tr:
        assert tr.rank(0).clean_close
        assert tr.rank(0).table("requests").num_rows("req") == 12


def test_a_held_step_begun_in_a_quiet_moment_waits_inside_it_for_the_next_one(
    holding, tmp_path
) -> None:
    """A held step whose build began while the server was quiet, then a step started: at its
    next give-way (`make_way`) the tap thread waits until the server is quiet again, not just
    for that step's end."""
    rec, run = holding
    t, box = arm_in_thread(run, tmp_path / "inside.zarr", hold_mb=1)
    stages: list[str] = []
    began = threading.Event()

    def two_stages() -> None:
        stages.append("a")
        began.set()
        time.sleep(0.05)  # the test's serving thread starts meanwhile
        rec.make_way()
        stages.append("b")

    rec.defer(two_stages, 10)
    rec.step_ended()
    d, _ = disarm_in_thread(run)
    assert began.wait(10)
    serving = Serving(rec)
    time.sleep(0.5)
    assert stages == ["a"] and serving.steps >= 20
    serving.end()
    d.join(30)
    t.join(30)
    assert stages == ["a", "b"] and box["session"].ok


def test_a_server_that_never_idles_gets_its_held_rows_after_the_drain_wait(
    holding, tmp_path
) -> None:
    """The wait is bounded: past `drain_wait_s` the rows are built beside the steps served,
    and the disarm returns while the server still serves. `drain_wait_s=0`: at once, the cues
    stop at the disarm."""
    rec, run = holding
    out = tmp_path / "busy.zarr"
    t, box = arm_in_thread(run, out, hold_mb=1, drain_wait_s=0.4)
    assert rec.drain_wait_s == 0.4
    ran: list[str] = []
    serving = Serving(rec)  # serving from the arm on: never quiet
    for i in range(5):
        held_step(rec, f"r{i}", ran)
    t0 = time.monotonic()
    d, _ = disarm_in_thread(run)
    d.join(30)
    waited = time.monotonic() - t0
    assert not serving.stop.is_set()  # it served throughout
    serving.end()
    t.join(30)
    assert 0.4 <= waited < 10 and ran == [f"r{i}" for i in range(5)] and box["session"].ok

    t, box = arm_in_thread(run, tmp_path / "now.zarr", hold_mb=1, drain_wait_s=0)
    serving = Serving(rec)
    held_step(rec, "n0", ran)
    t0 = time.monotonic()
    client.disarm(str(run))  # while it serves: the default wait (30 s) would not be over
    t.join(30)
    assert time.monotonic() - t0 < 10 and ran[-1] == "n0" and box["session"].ok
    n = serving.steps
    time.sleep(0.1)
    assert not rec.cued and serving.steps == n  # no cue told from the disarm on
    serving.end()


def test_a_drain_wait_that_is_not_a_number_of_seconds_is_refused(holding, tmp_path) -> None:
    rec, run = holding
    for bad in (-1, 301, float("nan"), float("inf"), "30", True):
        with pytest.raises(
            HstraceError, match=r"drain_wait_s must be a number of seconds in \[0, 300\]"
        ):
            client.arm(str(run), tmp_path / f"w-{bad}.zarr", ["requests"], hold_mb=1,
                       drain_wait_s=bad)  # fmt: skip
        assert not rec.armed and not rec.cued
    assert common.drain_wait(None) == common.DRAIN_WAIT_S and common.drain_wait(0) == 0.0
    assert common.drain_wait(300) == 300.0


def test_the_step_in_flight_at_a_held_sessions_disarm_never_waits_for_the_backlog(
    holding, tmp_path
) -> None:
    """The step that runs as a held session is disarmed hands its work over after the hold is
    lifted: it joins the held steps (the disarm's thread queues them, in order), and the
    serving thread never queues the backlog itself (it would wait on the tap thread's full
    queue, the tap thread waiting for a quiet server meanwhile)."""
    rec, run = holding
    out = tmp_path / "inflight.zarr"
    t, box = arm_in_thread(run, out, hold_mb=1)
    ran: list[str] = []
    serving = Serving(rec)
    for i in range(3 * Recorder.DEFER_DEPTH):
        held_step(rec, f"r{i}", ran)
    rec.stepping = True  # a step runs as the disarm comes (the disarm waits for it)
    d, _ = disarm_in_thread(run)
    deadline = time.monotonic() + 10
    while rec.armed and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not rec.armed and rec.draining
    t0 = time.monotonic()
    rec.defer(lambda: (ran.append("last"), rec.emit([requests_write(["last"], [[1]], [0])])), 9)
    assert time.monotonic() - t0 < 1.0  # appended, not queued: the serving thread went on
    rec.stepping = False
    time.sleep(0.3)
    assert ran == []  # still serving: nothing built yet
    serving.end()
    d.join(30)
    t.join(30)
    n = 3 * Recorder.DEFER_DEPTH
    assert box["session"].ok and ran == [f"r{i}" for i in range(n)] + ["last"]
    with open_trace(out) as tr:
        assert tr.rank(0).table("requests").num_rows("req") == n + 1


def test_a_server_that_closes_while_held_rows_wait_for_quiet_has_them_built_at_once(
    holding, tmp_path
) -> None:
    """The engine shuts down (`Recorder.close`: atexit, a signal) while a held session's disarm
    waits for a quiet server: the wait ends, the rows are built and the trace closes."""
    rec, run = holding
    t, box = arm_in_thread(run, tmp_path / "closing.zarr", hold_mb=1)
    ran: list[str] = []
    serving = Serving(rec)  # steps told throughout: the wait would last its 30 s
    for i in range(3):
        held_step(rec, f"r{i}", ran)
    d, _ = disarm_in_thread(run)
    time.sleep(0.3)
    assert rec.draining and ran == []
    t0 = time.monotonic()
    rec.close()
    d.join(30)
    t.join(30)
    serving.end()
    assert time.monotonic() - t0 < 10 and ran == ["r0", "r1", "r2"] and box["session"].ok


@pytest.mark.parametrize("auto", [False, True])
def test_a_step_that_cannot_be_held_is_built_as_it_runs_and_lifts_the_hold(
    holding, tmp_path, monkeypatch, auto
) -> None:
    """vLLM's step wrapper (`wrap_propose_draft_token_ids`, real) with a step whose tensors
    are not on the CPU (CUDA: what this box cannot make, so `_on_cpu` says so; the step's
    collection and rows stood in): the step is built as it runs, the hold is lifted (the
    disarm then has no held step to wait for: it returns while the server serves on, and
    does not hold the step cues on, `draining`), the trace closes clean with the step's rows.
    An asked-for hold leaves the trace's `hold` error entry; the default hold does not."""
    from hstrace.hooks import vllm_patches as vp

    rec, run = holding
    ran: list[str] = []
    monkeypatch.setattr(vp, "_begin_step", lambda rec, runner, bound: "cuda-step")
    monkeypatch.setattr(vp, "_on_cpu", lambda step: False)
    monkeypatch.setattr(
        vp,
        "_emit_step",  # the step's rows: one request's, so that the rank's trace is written
        lambda rec, step, *keep: (
            ran.append(step),
            rec.emit([requests_write(["r0"], [[1, 2, 3]], [0])]),
        ),
    )
    monkeypatch.setattr(vp, "REC", rec)
    out = tmp_path / f"cuda-{auto}.zarr"
    t, box = arm_in_thread(run, out, hold_mb=1, hold_auto=auto)
    assert rec.hold_bytes == 2**20
    propose = vp.wrap_propose_draft_token_ids(lambda self, *a: "drafts")
    serving = Serving(rec)  # never quiet
    assert propose(object()) == "drafts" and ran == ["cuda-step"]  # built as it ran
    assert rec.hold_bytes is None and not rec._held
    t0 = time.monotonic()
    client.disarm(str(run))  # the default drain wait (30 s) would not be over
    t.join(30)
    serving.end()
    assert time.monotonic() - t0 < 5 and box["session"].ok and not rec.draining
    with open_trace(out) as tr:
        assert tr.rank(0).clean_close and tr.rank(0).table("requests").num_rows("req") == 1
        taps = [e.get("tap") for e in tr.rank(0).errors]
    assert taps == ([] if auto else ["hold"])
