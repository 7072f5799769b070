"""Crash safety and concurrency: a SIGKILLed writer process leaves a store whose committed
prefix is complete and bit-exact; two rank processes write one store at the same time."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers.native_route import ROUTES, use_route
from helpers.trace_steps import script_env, step_data, verify_prefix

from hstrace.errors import TraceError
from hstrace.trace import TraceWriter, create_trace, open_trace
from hstrace.trace.write.recorder import BACKLOG_AGE_FACTOR


def _produce(w: TraceWriter, stop: threading.Event, written: list[int]) -> None:
    s = 0
    try:
        while not stop.is_set():
            w.write("target", **step_data(s))
            s += 1
            written[0] = s
    except TraceError:
        pass  # the writer process was killed: the producer learns it on its next write


@pytest.mark.slow
def test_sigkill_writer_keeps_committed_prefix(tmp_path):
    rng = random.Random(1234)
    results = []
    for trial in range(20):
        path = tmp_path / f"crash{trial}.zarr"
        create_trace(path, engine={"name": "test"})
        w = TraceWriter(
            path, rank=0, tail_flush_s=0.2, staging_bytes=4 << 20, max_part_bytes=256 << 10
        )
        stop, written = threading.Event(), [0]
        producer = threading.Thread(target=_produce, args=(w, stop, written))
        producer.start()
        alive_s = rng.uniform(0.05, 2.0)
        time.sleep(alive_s)
        os.kill(w.writer_pid, signal.SIGKILL)
        stop.set()
        producer.join(timeout=30)
        assert not producer.is_alive()
        with pytest.raises(TraceError):
            w.close()  # the writer is gone: close says so instead of hanging
        committed = verify_prefix(path)
        assert committed <= written[0]
        results.append((round(alive_s, 2), committed, written[0]))
    # Not just "0 is a prefix": the tail flush must have made steps durable in every trial that
    # outlived its worst-case age. The producer outruns the writer here, so the writer is always
    # draining a backlog and defers tail flushes to BACKLOG_AGE_FACTOR x tail_flush_s (0.8 s);
    # 0.4 s of slack for a loaded host.
    late = [r for r in results if r[0] >= BACKLOG_AGE_FACTOR * 0.2 + 0.4]
    assert len(late) >= 5, results  # the seeded kill times give 8
    assert all(c > 0 for _, c, _ in late), results


def test_sigkill_after_a_tail_flush_loses_nothing_older(tmp_path):
    """A run that pauses longer than the tail-flush age has everything before the pause committed."""
    path = tmp_path / "pause.zarr"
    create_trace(path, engine={"name": "test"})
    w = TraceWriter(path, rank=0, tail_flush_s=0.2)
    for s in range(50):
        w.write("target", **step_data(s))
    time.sleep(2.0)  # > tail_flush_s plus processing; the writer flushes and commits by age
    os.kill(w.writer_pid, signal.SIGKILL)
    with pytest.raises(TraceError):
        w.close()
    assert verify_prefix(path) == 50
    with open_trace(path) as tr:
        assert not tr.rank(0).clean_close


RANK_SCRIPT = """
from helpers.trace_steps import step_data
from hstrace.trace import TraceWriter
with TraceWriter({path!r}, rank={rank}) as w:
    for s in range({steps}):
        w.write("target", **step_data(s))
"""


def test_two_rank_processes_write_one_store(tmp_path):
    path = tmp_path / "two.zarr"
    create_trace(path, engine={"name": "test"})
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT.format(path=str(path), rank=r, steps=120)],
            env=script_env(),
        )
        for r in (0, 1)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    with open_trace(path) as tr:
        assert tr.ranks == [0, 1]
        assert all(tr.rank(r).clean_close for r in (0, 1))
    assert verify_prefix(path, 0) == verify_prefix(path, 1) == 120
    assert not list(path.rglob("*.partial"))


ABANDONING_PRODUCER = """
import sys
import torch
from hstrace.trace import TraceWriter
w = TraceWriter(sys.argv[1], rank=0)
for s in range(3):
    w.write("target", step={"mode": 0}, req={"req_key": [7], "n_tok": [2]},
            tok={"input_ids": torch.tensor([s, s + 1]), "positions": torch.tensor([0, 1]),
                 "aux_hidden": torch.ones(2, 4, dtype=torch.bfloat16)})
print(w.writer_pid, flush=True)
# exits without close(): a crashed or careless producer
"""


def test_a_producer_that_never_closes_keeps_its_steps(tmp_path):
    path = str(tmp_path / "t.zarr")
    create_trace(path, engine={"name": "test", "version": "0"}, command_line=["t"], static={})
    out = subprocess.run(
        [sys.executable, "-c", ABANDONING_PRODUCER, path], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    _wait_gone(int(out.stdout.split()[0]))
    assert "Traceback" not in out.stderr
    with open_trace(path) as tr:
        rank = tr.rank(0)
        assert not rank.clean_close
        assert rank.table("target").column("tok", "input_ids").tolist() == [0, 1, 1, 2, 2, 3]


def _wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still alive after {timeout_s} s")


# Writes steps until killed; prints "<step>" after each write returned (the step is handed over).
STEADY_PRODUCER = """
import os, sys, time
{prelude}
from helpers.trace_steps import step_data
from hstrace.trace import TraceWriter
w = TraceWriter({path!r}, rank=0, tail_flush_s=0.2, staging_bytes=8 << 20,
                max_part_bytes=1 << 20)
print("pids", os.getpid(), w.writer_pid, flush=True)
s = 0
while True:
    w.write("target", **step_data(s))
    print(s, flush=True)
    s += 1
"""


def _shared_maps(pid: int) -> list[str]:
    """Paths of the shared mappings of a process that are staging memory (memfd or /dev/shm)."""
    with open(f"/proc/{pid}/maps") as f:
        paths = [ln.split(None, 5)[5].strip() for ln in f if len(ln.split(None, 5)) == 6]
    return [p for p in paths if "hstrace-ring" in p or p.startswith("/dev/shm/")]


def _start_steady(tmp_path, prelude: str = "") -> tuple[subprocess.Popen, int, int, object]:
    path = tmp_path / "steady.zarr"
    create_trace(path, engine={"name": "test"})
    proc = subprocess.Popen(
        [sys.executable, "-c", STEADY_PRODUCER.format(path=str(path), prelude=prelude)],
        env=script_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a server's process tree
    )
    first = proc.stdout.readline().split()
    assert first[:1] == ["pids"], (first, proc.stderr.read() if proc.poll() is not None else "")
    return proc, int(first[1]), int(first[2]), path


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux)")
@pytest.mark.parametrize(
    "prelude",
    [
        "",
        # Where there is no memfd, a named /dev/shm segment unlinked once both sides mapped it.
        "del os.memfd_create",
    ],
    ids=["memfd", "named-segment"],
)
def test_killing_the_whole_process_group_leaks_no_shared_memory(tmp_path, prelude):
    before = set(os.listdir("/dev/shm"))
    proc, pid, writer_pid, path = _start_steady(tmp_path, prelude)
    try:
        for _ in range(20):
            proc.stdout.readline()
        maps = _shared_maps(pid) + _shared_maps(writer_pid)
    finally:
        os.killpg(pid, signal.SIGKILL)  # the server's process tree: producer and writer at once
        proc.wait(timeout=30)
    _wait_gone(writer_pid)
    # Both sides map the ring, and none of the mappings has a name left in /dev/shm ...
    assert len(maps) >= 2, maps
    for m in maps:
        assert "(deleted)" in m or m.startswith("/memfd:"), m
    # ... so nothing stays behind once the group is gone.
    leaked = [n for n in set(os.listdir("/dev/shm")) - before if any(n in m for m in maps)]
    assert not leaked, leaked
    assert "Traceback" not in proc.stderr.read()
    verify_prefix(path)  # whatever was committed is intact


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux)")
def test_a_killed_producer_loses_only_what_it_had_not_handed_over(tmp_path):
    """The writer drains the messages still in the pipe after the producer died, then commits
    (it used to stop at the first BrokenPipeError answering the dead producer)."""
    for trial in range(3):
        sub = tmp_path / f"t{trial}"
        sub.mkdir()
        proc, pid, writer_pid, path = _start_steady(sub)
        handed = -1
        for _ in range(150 + 60 * trial):
            line = proc.stdout.readline().strip()
            handed = int(line)
        os.kill(pid, signal.SIGKILL)  # the producer only: the writer lives on and drains
        proc.wait(timeout=30)
        handed = max([handed] + [int(x) for x in proc.stdout.read().split() if x.isdigit()])
        _wait_gone(writer_pid)
        committed = verify_prefix(path)
        assert committed >= handed + 1, (trial, committed, handed)
        assert "Traceback" not in proc.stderr.read()


@pytest.mark.slow
def test_steps_past_a_full_descriptor_queue_keep_their_order(tmp_path):
    """With the writer stopped, the first DESC_SLOTS steps go through the shared descriptor
    queue and the rest, with a control message among them, down the data pipe; once the
    writer runs again every step is there, in order and bit-exact, and after it catches up
    steps take the queue again."""
    from hstrace.trace.write.process_sink import DESCRIPTORS
    from hstrace.trace.write.ring import DESC_SLOTS

    path = tmp_path / "order.zarr"
    create_trace(path, engine={"name": "test"})
    w = TraceWriter(path, rank=0)
    first = DESC_SLOTS + 300
    os.kill(w.writer_pid, signal.SIGSTOP)
    try:
        for s in range(first):
            assert w.write("target", **step_data(s))
            if s == DESC_SLOTS + 10:
                w.update_static({"mid": s})
        published = w.sink._published
    finally:
        os.kill(w.writer_pid, signal.SIGCONT)
    w.flush()
    assert verify_prefix(path) == first
    for s in range(first, first + 100):
        assert w.write("target", **step_data(s))
    w.close()
    assert verify_prefix(path) == first + 100
    with open_trace(path) as tr:
        assert tr.rank(0).clean_close and tr.meta["static"]["mid"] == DESC_SLOTS + 10
    if DESCRIPTORS:  # x86: the queue filled, the rest went down the pipe, then the queue again
        assert published == DESC_SLOTS
        assert w.sink._published > DESC_SLOTS


@pytest.mark.parametrize("route", ROUTES)
def test_a_killed_writer_is_noticed_within_a_liveness_interval(tmp_path, monkeypatch, route):
    """Steps are published without a syscall, so a producer learns of a SIGKILLed writer at its
    next liveness check (every LIVENESS_EVERY descriptors), not at its next write; what it wrote
    meanwhile was never durable anyway (nor were the steps still in the ring at the kill). The
    native one-call step and the Python route check alike."""
    from hstrace.trace.write.process_sink import LIVENESS_EVERY

    use_route(monkeypatch, route)
    path = tmp_path / "alive.zarr"
    create_trace(path, engine={"name": "test"})
    w = TraceWriter(path, rank=0)
    w.write("target", **step_data(0))
    w.flush()
    os.kill(w.writer_pid, signal.SIGKILL)
    w.sink._proc.wait(timeout=30)
    written = 0
    with pytest.raises(TraceError, match=r"writer process of rank 0 exited"):
        for s in range(1, 3 * LIVENESS_EVERY):
            w.write("target", **step_data(s % 40 if s % 40 != 7 else 8))  # no 3000-token step
            written += 1
    assert written < LIVENESS_EVERY
    if route == "native":  # it took every step after the first, the one that noticed too
        assert w.sink._cur.taken == written + 1
    with pytest.raises(TraceError):
        w.close()
    assert verify_prefix(path) == 1  # the flushed step stays
