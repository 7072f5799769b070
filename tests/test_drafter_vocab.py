"""One function for the d2t readings (`hstrace.drafter.vocab`): offsets, a direct table, no map;
what a checkpoint's d2t holds; and the drafter's fault option `skip_fc` (a config, not a
patched method)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.drafters import randomized, tiny_cfg, tiny_model

from hstrace.drafter import Eagle3Drafter
from hstrace.drafter.vocab import (
    D2T_READINGS,
    DIRECT_TABLE,
    NO_MAP,
    OFFSETS,
    checkpoint_reading,
    draft_vocab_targets,
    map_draft_ids,
)

D2T = torch.tensor([0, 2, 2, 5])  # offsets to target ids 0, 3, 4, 8 of a vocab of 10


def test_the_three_readings():
    ids = torch.tensor([[0, 1], [2, 3]])
    assert map_draft_ids(ids, D2T, OFFSETS).tolist() == [[0, 3], [4, 8]]
    assert map_draft_ids(ids, D2T, DIRECT_TABLE).tolist() == [[0, 2], [2, 5]]
    assert map_draft_ids(ids, D2T, NO_MAP).tolist() == [[0, 1], [2, 3]]
    # a direct table holding ids past the vocab is clamped into it, as an engine indexing
    # its vocab would; offsets are never clamped (a misread shows as ids past the vocab)
    big = torch.tensor([0, 12])
    assert map_draft_ids(torch.tensor([1]), big, DIRECT_TABLE, vocab_size=10).tolist() == [9]
    assert map_draft_ids(torch.tensor([1]), big, OFFSETS, vocab_size=10).tolist() == [13]
    assert draft_vocab_targets(D2T).tolist() == [0, 3, 4, 8]
    assert D2T_READINGS == (OFFSETS, DIRECT_TABLE, NO_MAP)
    with pytest.raises(ValueError, match="unknown d2t reading"):
        map_draft_ids(ids, D2T, "table")


def test_the_drafter_maps_through_it():
    m = tiny_model()
    ids = torch.arange(61)
    assert torch.equal(m.draft_to_target(ids), map_draft_ids(ids, m.d2t, OFFSETS))
    assert torch.equal(m.draft_to_target(ids, direct=True), m.d2t)
    logits = torch.randn(2, 61)
    full = m.full_vocab_logits(logits)
    assert torch.equal(full[:, draft_vocab_targets(m.d2t)], logits)
    assert int(torch.isfinite(full).sum()) == 2 * 61


def _t2d(ids: list[int], vocab: int = 10) -> torch.Tensor:
    t = torch.zeros(vocab, dtype=torch.bool)
    t[ids] = True
    return t


@pytest.mark.parametrize(
    "d2t,t2d,has_d2t,state",
    [
        (D2T, _t2d([0, 3, 4, 8]), True, OFFSETS),
        (D2T, _t2d([0, 3, 4, 8]), False, "missing"),
        (torch.zeros(4, dtype=torch.long), _t2d([0, 1, 2, 3]), True, "zeros"),
        # absolute ids stored where offsets belong: t2d marks exactly d2t's values
        (torch.tensor([0, 3, 4, 8]), _t2d([0, 3, 4, 8]), True, "direct-table"),
        (torch.tensor([0, 3, 4, 9]), _t2d([0, 3, 4, 9]), True, "direct-table"),  # 3 + 9 >= 10
        (D2T, _t2d([0, 3, 4, 9]), True, "inconsistent"),
    ],
)
def test_what_a_checkpoint_holds(d2t, t2d, has_d2t, state):
    got = checkpoint_reading(d2t, t2d, 10, has_d2t=has_d2t, has_t2d=True)
    assert got.state == state, got
    assert got.info["draft_vocab_size"] == 4 and got.info["d2t_present"] is has_d2t
    if state == "inconsistent":
        assert got.mismatch["only_in_d2t"] == [8] and got.mismatch["only_in_t2d"] == [9]
    if state == "direct-table":
        assert got.info["offset_target_max"] >= 10 or got.info["d2t_equals_t2d_ids"]


def test_unsorted_offsets_and_same_vocab():
    d2t = torch.tensor([3, 0, 5, 5])  # targets 3, 1, 7, 8: a permutation no library builds
    assert checkpoint_reading(d2t, _t2d([1, 3, 7, 8]), 10, True, True).state == "unsorted"
    assert checkpoint_reading(D2T, _t2d([0]), 4, True, True).state == "same-vocab"


def test_skip_fc_is_a_config_option():
    """The engine fault "fc skipped" (one H-wide state delivered): the drafter with
    `skip_fc=True` given fc's own output computes what the trained drafter computes on the
    aux concat, and no method is patched."""
    model = randomized(Eagle3Drafter(tiny_cfg()), seed=3).eval()
    faulty = Eagle3Drafter(dataclasses.replace(model.cfg, skip_fc=True)).eval()
    faulty.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (6,), generator=g)
    aux = torch.randn(6, 3 * 32, generator=g)
    with torch.no_grad():
        want = model(ids, aux).logits
        got = faulty(ids, model.combine(aux)).logits
    torch.testing.assert_close(got, want)
    assert "combine" not in vars(faulty)  # an option, not an instance override
    with pytest.raises(ValueError, match="skip_fc: aux width 96 != hidden_size 32"):
        faulty(ids, aux)
