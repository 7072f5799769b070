"""The pure parts of replay, fed tensors directly: alignment, slot fingerprints, logit
comparison against an fp32 judge, what-if search."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hstrace.findings import Finding
from hstrace.replay.align import align, common_prefix
from hstrace.replay.compare import (
    SAME_COS,
    agreement_by_step,
    compare_topk,
    gathered_logprobs,
    layer_fingerprint,
    rows_of_other_requests,
    slot_health,
    slot_matrix,
)
from hstrace.replay.result import ReplayResult
from hstrace.replay.whatif import WhatIf, reproducing, search


def test_common_prefix():
    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert common_prefix(np.array([1, 2]), np.array([1, 2, 3])) == 2
    assert common_prefix(np.array([9]), np.array([1])) == 0


def test_align_exact_prefix_and_unmatched():
    rng = np.random.default_rng(0)
    train = [rng.integers(0, 1000, 40) for _ in range(5)]
    serving = [
        train[3].copy(),  # exact
        np.concatenate([train[1][:20], [7, 7, 7]]),  # shares 20 tokens, then drifts
        rng.integers(0, 1000, 30),  # no match
        train[0][:5],  # too short to align
    ]
    matches, cov = align(serving, train, min_tokens=8)
    by = {m.serving: m for m in matches}
    assert by[0].training == 3 and by[0].kind == "exact" and by[0].length == 40
    assert by[1].training == 1 and by[1].kind == "prefix" and by[1].length == 20
    assert 2 not in by and 3 not in by
    assert cov.aligned_requests == 2 and cov.exact == 1 and cov.prefix == 1
    assert cov.aligned_tokens == 60 and cov.serving_tokens == 40 + 23 + 30 + 5
    assert cov.training_samples == 5 and cov.training_samples_matched == 2


def test_align_picks_longest_common_prefix():
    base = np.arange(50)
    a, b = base.copy(), base.copy()
    a[30:] += 100  # shares 30 with the serving sequence
    b[45:] += 100  # shares 45
    matches, _ = align([base], [a, b])
    assert matches[0].training == 1 and matches[0].length == 45


def _states(n=64, k=3, h=32, seed=0):
    return torch.randn(n, k, h, generator=torch.Generator().manual_seed(seed))


def test_slot_matrix_identity_and_permutation():
    x = _states()
    m = slot_matrix(x, x.clone())
    assert np.allclose(np.diag(m.cos), 1.0, atol=1e-6) and m.best.tolist() == [0, 1, 2]
    assert np.allclose(np.diag(m.rel_norm), 1.0, atol=1e-6)
    perm = slot_matrix(x[:, [2, 0, 1]], x)
    assert perm.best.tolist() == [2, 0, 1]
    assert (perm.cos[np.arange(3), perm.best] > SAME_COS).all()
    assert (np.diag(perm.cos) < 0.5).all()


def test_slot_matrix_bf16_is_same_noise_is_not():
    x = _states()
    bf = slot_matrix(x.to(torch.bfloat16).float(), x)
    assert (np.diag(bf.cos) > SAME_COS).all()
    noisy = x + 0.1 * x.norm(dim=-1, keepdim=True) / np.sqrt(32) * torch.randn_like(x)
    drift = slot_matrix(noisy, x)
    assert (np.diag(drift.cos) < SAME_COS).all() and (np.diag(drift.cos) > 0.98).all()


def test_slot_matrix_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        slot_matrix(_states(n=10), _states(n=11))


def test_slot_health():
    x = _states()
    x[:, 1] = 0
    x[:, 2] = x[:1, 2]
    health = slot_health(x)
    assert not health[0].corrupt
    assert health[1].zero_rows == 1.0 and health[1].corrupt
    assert health[2].constant and health[2].corrupt


def test_layer_fingerprint_names_the_layer():
    layers = _states(k=9)  # 9 "layers"
    slots = layers[:, [2, 4, 5]].clone()
    fp = layer_fingerprint(slots, layers)
    assert fp.layer == [2, 4, 5] and min(fp.cos) > 0.999


def test_rows_of_other_requests():
    t = [_states(n=20, seed=i) for i in range(3)]
    s = [t[0].clone(), t[2].clone(), t[2].clone()]  # request 1 carries request 2's rows
    crossed = rows_of_other_requests(s, t)
    assert [(i, j) for i, j, _ in crossed] == [(1, 2)]


def test_compare_topk_judges_against_the_fp32_spread():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(50, 100, generator=g) * 3
    lowp = ref.to(torch.bfloat16).float()
    ids = ref.topk(4).indices
    same = compare_topk(ids, gathered_logprobs(ref, ids), ref, lowp)
    assert same.top1 == 1.0 and same.topk == 1.0 and same.within_noise
    # An engine whose log-probs are off by more than bf16 could explain.
    off = compare_topk(ids, gathered_logprobs(ref, ids) + 0.5, ref, lowp)
    assert off.top1 == 1.0 and not off.within_noise
    assert off.max_logprob_diff == pytest.approx(0.5, abs=1e-4)
    other = torch.randn(50, 100, generator=g)
    wrong = compare_topk(other.topk(4).indices, None, ref, lowp)
    assert wrong.top1 < 0.2 and not wrong.agrees


def test_gathered_logprobs_equals_log_softmax():
    x = torch.randn(5, 30)
    ids = torch.tensor([[1, 2], [3, 4], [0, 29], [7, 7], [5, 6]])
    assert torch.allclose(gathered_logprobs(x, ids), torch.log_softmax(x, -1).gather(-1, ids))


def test_whatif_search_finds_the_reproducing_hypothesis():
    g = torch.Generator().manual_seed(1)
    truth = torch.randn(40, 50, generator=g)
    ids = truth.topk(3).indices
    lp = gathered_logprobs(truth, ids)
    candidates = [
        WhatIf("a", "rope-theta", lambda: torch.randn(40, 50, generator=g)),
        WhatIf("b", "norm-flag", lambda: truth.clone()),
        WhatIf("c", "token-shift", lambda: (_ for _ in ()).throw(ValueError("n/a"))),
    ]
    results = search(candidates, ids, lp)
    assert [r.name for r in results] == ["b", "a"]  # "c" could not run
    best = reproducing(results, baseline=0.1, tolerance=1e-4)
    assert best is not None and best.code == "norm-flag-mismatch"
    assert reproducing(results[1:], baseline=0.1, tolerance=1e-4) is None


def test_result_verdict_order_and_exit_codes():
    info = Finding("no-wiring-fault", "ok", severity="info")
    assert ReplayResult([info]).verdict.code == "no-wiring-fault"
    assert ReplayResult([info]).exit_code == 0
    late = Finding("token-shift", "late", fix="x")
    early = Finding("aux-layer-shift", "early", fix="y")
    warn = Finding("spec-params-adjusted", "warn", severity="warning")
    r = ReplayResult([late, warn, early])
    assert r.verdict.code == "aux-layer-shift"  # first fault in dataflow order
    assert [f.code for f in r.findings] == [
        "aux-layer-shift",
        "token-shift",
        "spec-params-adjusted",
    ]
    assert r.exit_code == 1
    only_warning = ReplayResult([warn])
    assert only_warning.verdict.code == "spec-params-adjusted" and only_warning.exit_code == 0
    j = r.to_json()
    assert j["verdict"]["code"] == "aux-layer-shift" and j["verdict"]["stage"] == "target-capture"


def test_agreement_by_step_locates_where_the_engine_drifts():
    """Rows of steps 0 and 2 are the reference's own top-k; step 1 proposes other ids with
    shifted log-probs: only step 1 shows the disagreement."""
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(9, 50, generator=gen)
    steps = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    ids = ref.topk(4, dim=-1).indices
    lp = gathered_logprobs(ref, ids)
    drift = steps == 1
    ids[drift] = (-ref[drift]).topk(4, dim=-1).indices  # the least likely ids instead
    lp[drift] = gathered_logprobs(ref[drift], ids[drift]) + 0.5
    by_step = agreement_by_step(steps, ids, lp, ref)
    assert [p["step"] for p in by_step] == [0, 1, 2]
    assert [p["rows"] for p in by_step] == [3, 3, 3]
    assert by_step[0]["top1_agreement"] == by_step[2]["top1_agreement"] == 1.0
    assert by_step[0]["max_logit_diff"] < 1e-5 and by_step[2]["topk_agreement"] == 1.0
    assert by_step[1]["top1_agreement"] == 0.0 and by_step[1]["topk_agreement"] == 0.0
    assert by_step[1]["max_logit_diff"] == pytest.approx(0.5, abs=1e-5)
