"""The check list's order changes no result (issue 13 item 3): the evidence is built once,
before any check runs, and checks only read it and return findings.

Each case builds the evidence once (`open_evidence`) and judges it with the checks in their
dataflow order, reversed and shuffled; the whole replay JSON (findings with their evidence,
skipped, metrics) must be identical. The cases are the bundled example traces against the
tiny world's training dump, and two recorded faults whose findings used to pass the what-if
search between checks through `ctx.metrics` (fc-skipped read it after the config stage,
weights-dropped's runtime fallback too): reversed, they used to lose that evidence.
"""

from __future__ import annotations

import functools
import json
import random
import shutil
from pathlib import Path

import pytest

from hstrace.diagnose import CHECKS, diagnose
from hstrace.engines import EngineConfig, Prompt, RecordOptions, get_engine
from hstrace.replay.run import judge, open_evidence
from hstrace.training import open_training

ROOT = Path(__file__).resolve().parent.parent
WORLD = ROOT / "traces" / "tiny-world"
EXAMPLES = ROOT / "traces" / "examples"
TRAINING = WORLD / "training-speculators"

pytestmark = pytest.mark.skipif(not (WORLD / "target").is_dir(), reason="tiny world not built")


def _orders() -> dict[str, tuple]:
    shuffled = list(CHECKS)
    random.Random(13).shuffle(shuffled)
    assert shuffled != list(CHECKS) and shuffled != list(reversed(CHECKS))
    return {"reversed": tuple(reversed(CHECKS)), "shuffled": tuple(shuffled)}


def _record(out: Path, **knobs) -> Path:
    td = open_training(TRAINING)
    prompts = [
        Prompt(input_ids=tuple(td[i].input_ids[:24].tolist()), source_id=f"heldout:{i}")
        for i in range(40, 43)
    ]
    engine = get_engine(
        "reference",
        EngineConfig(target=WORLD / "target", drafter=WORLD / "drafter-speculators", extra=knobs),
    )
    engine.check_supported()
    result = engine.record(prompts, out, RecordOptions(max_new_tokens=8, show_progress=False))
    assert result.ok
    return out


def _judged_in_every_order(trace: Path, against: Path = TRAINING) -> dict:
    ev, inputs = open_evidence(trace, against)
    default = judge(ev, inputs, diagnose).to_json()
    for name, order in _orders().items():
        other = judge(ev, inputs, functools.partial(diagnose, checks=order)).to_json()
        assert json.dumps(other, sort_keys=True) == json.dumps(default, sort_keys=True), name
        assert list(other["skipped"]) == list(default["skipped"]), name  # same order too
    return default


def test_clean_example_is_clean_in_every_order():
    doc = _judged_in_every_order(EXAMPLES / "clean.zarr")
    assert [f["code"] for f in doc["findings"]] == ["no-wiring-fault"]
    assert doc["metrics"]["whatif"] == {
        "ran": False,
        "reason": "engine matches the reference within the fp32-judged tolerance",
    }


def test_aux_layer_shift_example_in_every_order():
    doc = _judged_in_every_order(EXAMPLES / "aux-layer-shift.zarr")
    assert doc["verdict"]["code"] == "aux-layer-shift"
    f = next(f for f in doc["findings"] if f["code"] == "aux-layer-shift")
    assert f["evidence"]["serving_layers"] == [3, 5, 6]
    assert f["evidence"]["training_layers"] == [2, 4, 5]
    assert f["evidence"]["shift"] == 1


def test_against_a_second_trace_in_every_order():
    """A second trace as the training side: no final state, other skips; same in any order."""
    doc = _judged_in_every_order(EXAMPLES / "aux-layer-shift.zarr", EXAMPLES / "clean.zarr")
    assert doc["verdict"]["code"] == "aux-layer-shift"


def test_without_a_target_the_same_checks_are_skipped_in_every_order(tmp_path):
    """What is skipped is decided when the evidence is built: several pieces skip (no target),
    and `skipped` is the same, in the same order, whichever check runs first."""
    trace = tmp_path / "clean.zarr"
    shutil.copytree(EXAMPLES / "clean.zarr", trace)
    root = json.loads((trace / "zarr.json").read_text())
    root["attributes"]["hstrace"]["static"]["target"]["path"] = str(tmp_path / "gone")
    (trace / "zarr.json").write_text(json.dumps(root))
    doc = _judged_in_every_order(trace)
    assert doc["inputs"]["target"] is None
    assert doc["skipped"] == {
        "layer fingerprints": "no target model (give --target DIR)",
        "teacher test": "no target model (give --target DIR)",
    }
    assert doc["verdict"]["code"] == "no-wiring-fault"


def test_fc_skipped_keeps_the_whatif_evidence_in_every_order(tmp_path):
    doc = _judged_in_every_order(_record(tmp_path / "fc.zarr", skip_fc=True))
    f = next(f for f in doc["findings"] if f["code"] == "fc-skipped")
    # Reached by the what-if search (config stage) and read by the draft-input check.
    assert f["evidence"]["reproduced_by_reference_without_fc"] is True
    assert f["evidence"]["what_if"] == "fc skipped"
    assert doc["metrics"]["whatif"]["reproduced_by"] == "fc skipped"


def test_weights_dropped_fallback_reads_the_search_in_every_order(tmp_path):
    trace = _record(tmp_path / "w.zarr", drop_weights="layers.0.")
    # Without the static load audit only the draft logits can tell: the engine disagrees with
    # the reference and no single what-if reproduces it (the fallback reads the search).
    root = json.loads((trace / "zarr.json").read_text())
    assert root["attributes"]["hstrace"]["static"].pop("weights")
    (trace / "zarr.json").write_text(json.dumps(root))
    doc = _judged_in_every_order(trace)
    assert doc["verdict"]["code"] == "weights-dropped"
    search = doc["metrics"]["whatif"]
    assert search["ran"] is True and search["reproduced_by"] is None
    f = next(f for f in doc["findings"] if f["code"] == "weights-dropped")
    assert f["evidence"]["whatif_best"] == search["results"][0]
