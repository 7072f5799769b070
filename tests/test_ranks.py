"""Multi-rank traces (issue 27): replay reads every rank and compares it with rank 0.

The two-rank traces are written the way a tensor-parallel server's ranks write theirs: one
trace, one `TraceWriter` per rank (`tests/helpers/field_producer.py`, the public writer). Rank
0's events are a clean reference-engine recording of the tiny world; rank 1 replicates them
(what tensor parallelism does: the same requests, steps, aux states) and is then made to
diverge the way the field reports do:

- `local`: rank 1 takes its draft top-k over its own half of the draft vocab (the argmax over
  the local shard without the gather, TensorRT-LLM PR #16440): its top-k is recomputed by the
  drafter from its recorded inputs with the other half masked;
- `unshared`: rank 1's static audit says its drafter does not share the target's embedding
  while rank 0's does (vllm #50158), every row equal.

The live counterpart (a real vLLM TP = 2 server) is tests/test_vllm_tp2_live.py.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from helpers import field_producer as fp
from rich.console import Console

from hstrace import replay_trace
from hstrace.drafter import load_drafter
from hstrace.engines import EngineConfig, Prompt, RecordOptions, get_engine
from hstrace.report import render_markdown, render_terminal
from hstrace.training import open_training

WORLD = Path(__file__).resolve().parent.parent / "traces" / "tiny-world"
TARGET = WORLD / "target"
DRAFTER = WORLD / "drafter-speculators"
TRAINING = WORLD / "training-speculators"
HELDOUT = range(40, 44)

pytestmark = pytest.mark.skipif(not TARGET.is_dir(), reason="tiny world not built")

SHARED = {"embed_head": {"has_own_embed_tokens": False, "embed_shared_with_target": True}}
UNSHARED = {"embed_head": {"has_own_embed_tokens": True, "embed_shared_with_target": False}}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("ranks")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def drafter():
    model, _ = load_drafter(DRAFTER)
    return model.eval()


@pytest.fixture(scope="module")
def rank0(work):
    td = open_training(TRAINING)
    prompts = [
        Prompt(input_ids=tuple(td[i].input_ids.tolist()[:24]), source_id=f"heldout:{i}")
        for i in HELDOUT
    ]
    engine = get_engine("reference", EngineConfig(target=TARGET, drafter=DRAFTER))
    out = work / "rank0.zarr"
    res = engine.record(prompts, out, RecordOptions(max_new_tokens=8, show_progress=False))
    assert res.ok
    return out


def two_ranks(rank0: Path, out: Path, static0: dict, static1: dict, rank1=None) -> Path:
    fp.write(fp.read(rank0), out, rank=0, rank_static=static0)
    fp.write(rank1 if rank1 is not None else fp.read(rank0), out, rank=1, rank_static=static1)
    return out


@pytest.fixture(scope="module")
def clean(rank0, work):
    return replay_trace(two_ranks(rank0, work / "clean.zarr", SHARED, SHARED), TRAINING)


@pytest.fixture(scope="module")
def local(rank0, work, drafter):
    vocab = drafter.cfg.draft_vocab_size
    r1 = fp.read(rank0)
    keys = sorted({k for e in r1.of("draft_extend") for k in e.keys})
    for key in keys:
        fp.redraft(r1, key, drafter, shard=(vocab // 2, vocab))
    path = two_ranks(rank0, work / "local.zarr", SHARED, SHARED, rank1=r1)
    return replay_trace(path, TRAINING), vocab


def test_replicated_ranks_replay_clean_with_every_rank_covered(clean):
    assert clean.verdict.code == "no-wiring-fault", [f.to_json() for f in clean.findings]
    ranks = clean.to_json()["metrics"]["ranks"]
    assert ranks["ranks"] == [0, 1]
    cov = ranks["coverage"]
    assert cov["0"] == cov["1"] and cov["0"]["draft_rows"] > 0 and cov["0"]["aux_rows"] > 0
    assert cov["0"]["steps"]["draft_extend"] > 0 and cov["0"]["steps"]["target"] > 0
    c = ranks["compared"]["1"]
    assert c["requests_shared"] == len(HELDOUT)
    assert c["aux"]["rows"] == cov["0"]["aux_rows"] and c["aux"]["within_bf16"]
    assert c["aux"]["max_abs_diff"] == 0.0
    assert c["draft"]["rows"] == cov["0"]["draft_rows"] == c["draft"]["top1_equal"]
    assert c["acceptance"]["verify_rounds"] == cov["0"]["verify_rows"]
    assert "embed_head" in c["load_audit"]["load_audit_items"]
    assert ranks["divergences"] == []
    # every output says what each rank covered
    console = Console(record=True, width=200, file=io.StringIO())
    render_terminal(clean, console)
    text, md = console.export_text(), render_markdown(clean)
    rows = cov["0"]["draft_rows"]
    for out in (text, md):
        assert "rank 1" in out and f"top-1 equal {rows}/{rows}" in out, out[-3000:]
        assert "within bf16" in out


def test_rank_taking_its_argmax_over_its_shard_is_named(local):
    result, vocab = local
    assert result.verdict.code == "rank-divergence", [f.to_json() for f in result.findings]
    assert result.exit_code == 1
    f = next(f for f in result.findings if f.code == "rank-divergence")
    ev = f.evidence
    assert ev["ranks"] == [0, 1]
    first = ev["first"]
    # rank 1 drafts other ids than rank 0 at the first step whose rank-0 top-1 lies outside
    # rank 1's half; the aux states are still replicated (the divergence is in the head)
    assert first["what"] == "draft ids" and first["rank"] == 1 and first["against"] == 0
    assert first["request"].startswith("heldout:") and isinstance(first["step"], int)
    assert first["top1"]["0"] < vocab // 2 <= first["top1"]["1"]
    assert ev["compared"]["aux"]["within_bf16"]
    shards = ev["vocab_shards"]
    assert (shards["1"]["start"], shards["1"]["end"]) == (vocab // 2, vocab)
    assert shards["1"]["always_in_own_shard"] and shards["1"]["top1_in_own_shard"] == 1.0
    assert not shards["0"]["always_in_own_shard"]
    assert ev["local_argmax"] is True
    assert f"[{vocab // 2}, {vocab})" in f.summary and "local argmax" in f.summary
    assert "all-gather" in f.fix and "#16440" in f.fix
    # the rows still agree where rank 0's top-1 is in rank 1's half: the rest differ
    d = ev["compared"]["draft"]
    assert 0 < d["top1_equal"] < d["rows"]
    # the JSON carries it whole
    js = json.loads(json.dumps(result.to_json()))
    assert js["verdict"]["code"] == "rank-divergence"


def test_ranks_that_built_different_drafters_are_named(rank0, work):
    path = two_ranks(rank0, work / "unshared.zarr", SHARED, UNSHARED)
    result = replay_trace(path, TRAINING)
    assert result.verdict.code == "rank-divergence", [f.to_json() for f in result.findings]
    f = result.verdict
    first = f.evidence["first"]
    assert first["what"] == "load audit" and first["item"] == "embed_head"
    assert first["differs_at"] == ["embed_shared_with_target", "has_own_embed_tokens"]
    assert first["values"]["embed_shared_with_target"] == {"0": True, "1": False}
    assert "embed_head differ between rank 0 and rank 1" in f.fix
    # every row agrees: only the audits differ
    c = f.evidence["compared"]
    assert c["draft"]["rows"] == c["draft"]["top1_equal"] > 0
    assert [d["what"] for d in f.evidence["divergences"]] == ["load audit"]
