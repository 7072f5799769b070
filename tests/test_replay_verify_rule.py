"""The verify stage's rule math (`hstrace.replay.verify`) on hand-written verify rounds (stand-ins
for a trace's verify rows, values chosen so each answer is computed by hand below); the live
counterpart, on vLLM's own rejection sampler, is tests/test_vllm_sampled_live.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hstrace.replay.read import VerifyRound
from hstrace.replay.verify import rule_sums, token_transform


def _round(drafts, accepted, rule=1, params=None, **tokens) -> VerifyRound:
    n = len(drafts)
    cols = {
        "p_target": np.full(n, np.nan),
        "q_draft": np.ones(n),
        "logit_raw": np.full(n, np.nan),
        "logit_pen": np.full(n, np.nan),
        "logit_proc": np.full(n, np.nan),
        "target_argmax": np.full(n, -1),
        "seen_prompt": np.full(n, -1),
        "n_out": np.full(n, -1),
    }
    cols.update({k: np.asarray(v) for k, v in tokens.items()})
    return VerifyRound(0, 1, accepted, np.asarray(drafts), rule, params or {}, cols)


def test_one_hot_rule_predicts_sum_of_p_over_the_positions_reached() -> None:
    # round 1 accepted both (reached 2 positions); round 2 rejected at its first (reached 1)
    r1 = _round([5, 6, 7], 2, p_target=[0.5, 0.5, 0.9])
    r2 = _round([5, 6, 7], 0, p_target=[0.5, 0.8, 0.8])
    s = rule_sums([r1, r2])["one-hot"]
    assert s.reached == 3 + 1 and s.realized == 2
    assert s.predicted == pytest.approx(0.5 + 0.5 + 0.9 + 0.5)
    assert s.sigma == pytest.approx(math.sqrt(0.25 + 0.25 + 0.09 + 0.25))
    assert s.predicted_accept_len == pytest.approx(((0.5 + 0.25 + 0.225) + (0.5 + 0.4 + 0.32)) / 2)
    assert not s.beyond_spread


def test_draft_probs_rule_uses_min_one_p_over_q_and_greedy_is_exact() -> None:
    r = _round([3, 4], 1, rule=2, p_target=[0.2, 0.6], q_draft=[0.4, 0.3])
    assert rule_sums([r])["draft-probs"].predicted == pytest.approx(0.5 + 1.0)
    # greedy: the engine accepted a draft that is not the target's argmax -> beyond any spread
    g = [_round([3, 4], 2, rule=0, p_target=[0.9, 0.9], target_argmax=[3, 9]) for _ in range(2)]
    s = rule_sums(g)["greedy"]
    assert (s.predicted, s.sigma, s.realized) == (2.0, 0.0, 4) and s.beyond_spread


def test_transform_mismatch_is_named_by_stage_and_by_the_reading_that_reproduces_it() -> None:
    params = {"temperature": 0.5, "repetition_penalty": 2.0, "frequency_penalty": 0.5}
    # token 7, once in the committed output: position 0 counts 1 (3/2 - 0.5 = 1, /T = 2);
    # position 1 also counts the earlier draft 7: 2 (1.5 - 1 = 0.5, /T = 1)
    tok = {"logit_raw": [3.0, 3.0], "seen_prompt": [0, 0], "n_out": [1, 1]}
    ok = _round([7, 7], 1, params=params, logit_pen=[1.0, 0.5], logit_proc=[2.0, 1.0], **tok)
    assert "explained" not in token_transform(ok, 0) and "explained" not in token_transform(ok, 1)
    # an engine that counts only the committed output (penalties once per step)
    once = _round([7, 7], 1, params=params, logit_pen=[1.0, 1.0], logit_proc=[2.0, 2.0], **tok)
    row = token_transform(once, 1)
    assert row["stage"] == "penalties" and row["reference"] == pytest.approx(0.5)
    assert row["explained"] == [
        "penalties ignore the round's earlier drafts (applied once per step)"
    ]
    none = _round([7, 7], 1, params=params, logit_pen=[3.0, 3.0], logit_proc=[6.0, 6.0], **tok)
    assert token_transform(none, 0)["explained"] == ["penalties not applied"]
    # temperature: not applied; another one applied; a NaN where no mask gives NaN
    plain = {"logit_raw": [3.0], "logit_pen": [3.0]}
    t05 = {"temperature": 0.5}
    no_temp = _round([7], 0, params=t05, logit_proc=[3.0], **plain)
    assert token_transform(no_temp, 0)["explained"] == ["temperature not applied"]
    other = token_transform(_round([7], 0, params=t05, logit_proc=[1.5], **plain), 0)
    assert other["stage"] == "temperature" and other["implied_temperature"] == pytest.approx(2.0)
    assert other["explained"] == ["temperature applied is not the request's 0.5"]
    nan = token_transform(_round([7], 0, params=t05, logit_proc=[np.nan], **plain), 0)
    assert nan["explained"][0].startswith("processed logit nan")
    # top-k/top-p masked after the penalties: the penalties are still checked (and a wrong
    # one still named), the temperature is not comparable
    masked = token_transform(_round([7], 0, params=t05, logit_proc=[-np.inf], **plain), 0)
    assert masked["stage"] == "penalties" and masked["masked"] and "explained" not in masked
    hidden = _round([7, 7], 1, params=params, logit_pen=[1.0, 1.0], logit_proc=[-np.inf] * 2, **tok)
    assert token_transform(hidden, 1)["explained"] == [
        "penalties ignore the round's earlier drafts (applied once per step)"
    ]
    assert token_transform(_round([7], 0, params=t05, **plain), 0) is not None  # NaN: no mask
    unrecorded = _round([7], 0, params=t05, logit_raw=[np.nan], logit_pen=[np.nan])
    assert token_transform(unrecorded, 0) is None  # nothing recorded: nothing to compare


def test_every_drafted_token_with_its_logits_is_checked_at_the_penalty_stage() -> None:
    """The stage counts (issue 26): a token top-p masked after its penalties counts for the
    penalty stage and not for the temperature stage; the total is every token with its raw and
    penalised logits recorded."""
    from hstrace.replay.read import ServingData
    from hstrace.replay.verify import build_sampled_acceptance

    params = {"temperature": 0.5, "top_p": 0.9, "repetition_penalty": 2.0}
    # token 7 seen in the prompt: 3 / 2 = 1.5, / T = 3; the second one masked by top-p; the
    # third not recorded
    r = _round(
        [7, 7, 8],
        1,
        params=params,
        p_target=[0.5, 0.1, 0.1],
        logit_raw=[3.0, 3.0, np.nan],
        logit_pen=[1.5, 1.5, np.nan],
        logit_proc=[3.0, -np.inf, np.nan],
        seen_prompt=[1, 1, 0],
        n_out=[0, 0, 0],
    )
    sa = build_sampled_acceptance(ServingData(requests=[], meta={}, verify_rounds=[r]))
    assert sa.transform_checked == 2 and sa.n_mismatched == 0
    assert sa.checked_by_stage == {"penalties": 2, "temperature": 1} and sa.masked == 1
    out = sa.to_json()["sampled_acceptance"]
    assert out["transform_checked_by_stage"] == {"penalties": 2, "temperature": 1}
