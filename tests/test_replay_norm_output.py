"""Replay reads a SpecForge `norm_output` the way the training tensors say (SpecForge PR #879).

`load_drafter` reads it in the pre-PR sense; the second world's EAGLE-3.1 drafter
(traces/second-world/drafter-specforge-eagle31: trained feeding norm(h) back, saved by SpecForge
with `norm_output: true`) scores as trained only under the post-PR reading, and replay, having its
training data, must run it so and say so in `inputs`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.second_world import producer

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
WORLD = ROOT / "traces" / "second-world"
SERVED = [16, 17, 18, 19]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    pytest.importorskip("speculators.models.eagle3", reason="the producer serves speculators")
    from hstrace.training import open_training

    td = open_training(WORLD / "training-specforge")
    prompts = [td[i].input_ids.tolist() for i in SERVED]
    out = tmp_path_factory.mktemp("norm") / "t.zarr"
    return producer().record(
        out, WORLD / "target", WORLD / "drafter-speculators", prompts, layers=[2, 3, 4]
    )


def test_eagle31_drafter_runs_under_the_reading_its_training_tensors_pick(trace):
    from hstrace import replay_trace
    from hstrace.drafter import load_drafter
    from hstrace.drafter.norm_output import POST_879

    ck = WORLD / "drafter-specforge-eagle31"
    _, report = load_drafter(ck)
    assert report.dialect == "specforge" and report.config["norm_output"] is True
    doc = replay_trace(
        trace, WORLD / "training-specforge", drafter_path=ck, target_path=WORLD / "target"
    ).to_json()
    got = doc["inputs"]["specforge_norm_output"]
    assert got["norm_output"] is True
    assert got["reading"] == POST_879, got
    assert got["from"].startswith("the training tensors"), got
    res = got["resolution"]
    assert res["only_right_after_pr_879"] > 10 * max(res["only_right_before_pr_879"], 1), res
    assert res["accuracy"][POST_879] >= 0.9, res


def test_speculators_drafter_has_no_norm_output_reading(trace):
    """Only SpecForge's `norm_output` is ambiguous: a speculators drafter leaves inputs alone."""
    from hstrace import replay_trace

    doc = replay_trace(
        trace, WORLD / "training-speculators", target_path=WORLD / "target"
    ).to_json()
    assert "specforge_norm_output" not in doc["inputs"]
    assert doc["inputs"]["drafter_dialect"] == "speculators"
