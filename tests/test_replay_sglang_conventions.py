"""Replay on traces written with SGLang's producer conventions (docs/trace-format.md), on the
tiny world's reference engine, without SGLang installed:

- a SpecForge drafter (no embedding saved) is replayed with the target's embedding, as SGLang
  serves it, never with random weights; without a target, `skipped` says the drafter checks
  could not run;
- draft-extend rows without a top-k (id -1, log-prob -inf) feed the drafter as context but are
  not compared (no crash, no false `d2t-direct-table`); NaN log-probs are unknown (ids only);
- a check that fails internally lands in `skipped`, the replay goes on.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from hstrace import replay_trace
from hstrace.engines import EngineConfig, Prompt, RecordOptions, get_engine
from hstrace.replay.compare import compare_topk
from hstrace.replay.whatif import WhatIf, search
from hstrace.training import open_training

WORLD = Path(__file__).resolve().parent.parent / "traces" / "tiny-world"
TARGET, DRAFTER = WORLD / "target", WORLD / "drafter-specforge"
TRAINING = WORLD / "training-specforge"
pytestmark = pytest.mark.skipif(not TARGET.is_dir(), reason="tiny world not built")


@pytest.fixture(scope="module")
def specforge_trace(tmp_path_factory) -> Path:
    """The reference engine serving the SpecForge drafter with the target's embedding, as
    SGLang does (`set_embed`; the knob, since the checkpoint carries none)."""
    td = open_training(TRAINING)
    prompts = [
        Prompt(input_ids=tuple(td[i].input_ids[:20].tolist()), source_id=f"p{i}") for i in (40, 41)
    ]
    out = tmp_path_factory.mktemp("specforge") / "clean.zarr"
    config = EngineConfig(target=TARGET, drafter=DRAFTER, extra={"embed_from_target": True})
    engine = get_engine("reference", config)
    result = engine.record(prompts, out, RecordOptions(max_new_tokens=12, show_progress=False))
    assert result.ok and result.prompts_completed == 2
    return out


def _as_sglang_writes_it(src: Path, dst: Path) -> dict[str, int]:
    """A copy of the trace whose draft_extend top-k follows SGLang's conventions: a multi-row
    extend keeps its top-k on the last row only (ids -1, log-prob -inf elsewhere); extends after
    a verify (every extend of a request but its first, topk == 1) keep ids but record NaN
    log-probs. (A drafter this good has every post-verify extend multi-row, so both apply.)"""
    shutil.copytree(src, dst)
    table = dst / "rank0" / "draft_extend"
    offsets = zarr.open_array(str(table / "offsets"), mode="r")
    off = offsets[:, offsets.attrs["axes"].index("tok")]
    cols = {
        name: zarr.open_array(str(table / f"tok.{name}"), mode="r+")
        for name in ("topk_draft_ids", "topk_target_ids", "topk_logprobs")
    }
    req_keys = zarr.open_array(str(table / "req.req_key"), mode="r")[:]
    ids, tids, lps = (cols[n][:] for n in ("topk_draft_ids", "topk_target_ids", "topk_logprobs"))
    dropped = nan = 0
    seen: set[int] = set()
    for step, (a, b) in enumerate(zip(off[:-1], off[1:], strict=True)):
        if b - a > 1:
            ids[a : b - 1], tids[a : b - 1], lps[a : b - 1] = -1, -1, -np.inf
            dropped += int(b - a - 1)
        key = int(req_keys[step])  # one request per extend step in the reference engine
        if key in seen:
            lps[b - 1 : b] = np.nan
            nan += 1
        seen.add(key)
    cols["topk_draft_ids"][:], cols["topk_target_ids"][:] = ids, tids
    cols["topk_logprobs"][:] = lps
    return {"dropped": dropped, "nan": nan, "rows": int(off[-1])}


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hstrace", "replay", *args, "--json"],
        capture_output=True,
        text=True,
        cwd=cwd,
    )


def test_specforge_drafter_replays_with_the_target_embedding(specforge_trace):
    result = replay_trace(specforge_trace, TRAINING, drafter_path=DRAFTER, target_path=TARGET)
    assert result.verdict.code == "no-wiring-fault", result.to_json()
    assert result.inputs["drafter_embedding"].startswith("target")
    evr = result.metrics["engine_vs_reference"]
    # With a random embedding the engine and the reference agree on ~7% of rows.
    assert evr["top1_agreement"] == 1.0 and evr["within_noise"] is True, evr
    assert not any("failed internally" in why for why in result.skipped.values())
    assert result.failed == {} and result.complete


def test_without_a_target_the_drafter_checks_are_skipped_not_random(specforge_trace, tmp_path):
    # The same trace, as if its target had moved away since it was recorded.
    trace = tmp_path / "moved.zarr"
    shutil.copytree(specforge_trace, trace)
    root = json.loads((trace / "zarr.json").read_text())
    root["attributes"]["hstrace"]["static"]["target"]["path"] = str(tmp_path / "gone")
    (trace / "zarr.json").write_text(json.dumps(root))
    run = _cli(str(trace), "--against", str(TRAINING), "--drafter", str(DRAFTER), cwd=tmp_path)
    assert run.returncode in (0, 1) and "Traceback" not in run.stderr, run.stderr
    data = json.loads(run.stdout)
    assert "carries no embedding" in data["skipped"]["drafter forward"]
    assert data["inputs"]["drafter_embedding"] is None
    assert "engine_vs_reference" not in data["metrics"]  # nothing ran with random weights
    assert "acc0_training" not in data["metrics"] and "acc0_serving" not in data["metrics"]
    assert "weak" not in data["verdict"]["summary"]  # nothing ran the drafter: no such claim


def test_rows_without_topk_and_nan_logprobs_replay_clean(specforge_trace, tmp_path):
    trace = tmp_path / "sglang-style.zarr"
    counts = _as_sglang_writes_it(specforge_trace, trace)
    assert counts["dropped"] > 0 and counts["nan"] > 0
    run = _cli(str(trace), "--against", str(TRAINING), "--drafter", str(DRAFTER),
               "--target", str(TARGET), cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    data = json.loads(run.stdout)
    assert data["verdict"]["code"] == "no-wiring-fault", json.dumps(data)[:3000]
    codes = {f["code"] for f in data["findings"]}
    assert "d2t-direct-table" not in codes  # the -1 rows are not vocab-map mismatches
    assert data["metrics"]["vocab_readings"]["offsets"] == 1.0
    evr = data["metrics"]["engine_vs_reference"]
    assert evr["rows_without_topk"] == counts["dropped"]
    assert evr["rows"] == counts["rows"] - counts["dropped"]
    assert evr["rows_ids_only"] == counts["nan"]
    assert "ids only" in evr["logprobs_note"]
    assert evr["top1_agreement"] == 1.0 and evr["within_noise"] is True
    assert evr["max_logprob_diff"] is not None  # the prefill rows still carry log-probs
    assert not any("failed internally" in why for why in data["skipped"].values())
    assert data["failed"] == {} and data["complete"] is True and data["exit_code"] == 0


def test_a_check_that_fails_internally_is_not_raised_nor_a_clean_verdict(
    specforge_trace, monkeypatch
):
    import hstrace.diagnose as diagnose

    def broken_check(ctx):
        raise RuntimeError("boom in a check")

    monkeypatch.setattr(diagnose, "CHECKS", (broken_check, *diagnose.CHECKS))
    result = replay_trace(specforge_trace, TRAINING, drafter_path=DRAFTER, target_path=TARGET)
    assert result.failed["check broken_check"] == "RuntimeError: boom in a check"
    assert "check broken_check" not in result.skipped  # a failure is not missing evidence
    # Issue 24: the other checks still ran, but "no wiring fault" is not claimed: exit 3.
    assert result.verdict.code == "could-not-judge" and result.exit_code == 3
    assert "no-wiring-fault" not in [f.code for f in result.findings]
    assert "engine_vs_reference" in result.metrics


# -- pure: the comparisons on tensors ----------------------------------------------------------
def _rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 32, generator=g)
    lp = torch.log_softmax(logits, -1)
    top_lp, top_ids = lp.topk(2, dim=-1)
    top_ids[:3], top_lp[:3] = -1, -math.inf  # no top-k on the first three rows
    top_lp[3] = math.nan  # argmax recorded without probabilities
    return logits, top_ids, top_lp


def test_compare_topk_leaves_out_rows_without_topk_and_reads_nan_as_unknown():
    logits, ids, lps = _rows()
    a = compare_topk(ids, lps, logits, logits.to(torch.bfloat16).float())
    assert (a.rows, a.rows_without_topk, a.rows_ids_only) == (3, 3, 1)
    assert a.top1 == 1.0 and a.topk == 1.0
    assert a.max_logprob_diff < 1e-5 and a.within_noise
    # A wrong id on a NaN row still counts: ids are compared there.
    ids[3, 0] = (ids[3, 0] + 1) % 32
    assert compare_topk(ids, lps, logits).top1 == pytest.approx(2 / 3)
    # Only NaN log-probs: unknown, not a difference.
    only_nan = compare_topk(ids[3:], torch.full_like(lps[3:], math.nan), logits[3:])
    assert math.isnan(only_nan.max_logprob_diff) and only_nan.within_noise
    assert only_nan.to_json()["max_logprob_diff"] is None


def test_whatif_search_scores_only_rows_with_topk():
    logits, ids, lps = _rows()
    shuffled = logits[:, torch.randperm(32, generator=torch.Generator().manual_seed(1))]
    whatifs = [
        WhatIf("same", "x", lambda: logits),
        WhatIf("other", "y", lambda: shuffled),
    ]
    best, other = search(whatifs, ids, lps)
    assert best.name == "same" and best.agreement == 1.0 and best.max_logprob_diff < 1e-5
    assert other.max_logprob_diff > 0.1
