"""Traffic with no training twin is still judged (issue 26, item 3).

A served request whose tokens match no training sample gets a reference twin: the tiny world's
target (HF, fp32) run on the request's own served tokens, its states taken at the layers the
drafter config names, stored as bf16 as a training dump stores them
(`hstrace.replay.align.reference_twins`). Every replay stage then reads it as a sample.

On the bundled example traces (real traces recorded by the reference engine on the tiny world,
`traces/examples/make_examples.py`):

- the twin equals the training dump on the tokens both cover (the twin is what training fed);
- the training set stripped (no `--against`) and `--target` given: the same verdict as with
  `--against` (clean: `no-wiring-fault`; the one-layer shift: `aux-layer-shift` naming the same
  layers and the same fix);
- no target either: the draft inputs and the engine-vs-reference logits are still judged, and
  the capture layers are listed as not judged, for every request, with the reason;
- with `--against`, a trace mixing training prompts and our own: the first are judged against
  their samples, the others against their twins, one verdict over both.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.cli import EXAMPLES, REPO, TINY_WORLD, TRAINING, assert_one_line_error, run_main

from hstrace import replay_trace
from hstrace.reference.target import ReferenceTarget
from hstrace.replay.align import align, reference_twins
from hstrace.replay.read import read_serving
from hstrace.replay.result import COULD_NOT_JUDGE, ReplayResult
from hstrace.trace import open_trace
from hstrace.training import open_training

pytestmark = pytest.mark.skipif(not EXAMPLES.is_dir(), reason="example traces not built")

TARGET = TINY_WORLD / "target"
DRAFTER = TINY_WORLD / "drafter-speculators"
TRAINED_LAYERS = [2, 4, 5]  # HF indices of the speculators drafter's aux ids [2, 4, 5]
SHIFTED_LAYERS = [3, 5, 6]  # what the aux-layer-shift example's engine captured


@pytest.fixture(scope="module")
def replays() -> dict[tuple[str, str], ReplayResult]:
    """Each example replayed with the training set and with the target alone (one replay each,
    shared by the tests)."""
    out = {}
    for name in ("clean", "aux-layer-shift"):
        trace = EXAMPLES / f"{name}.zarr"
        out[name, "against"] = replay_trace(trace, TRAINING)
        out[name, "target"] = replay_trace(trace, None, target_path=TARGET)
    return out


def test_a_twin_is_what_training_stored_on_the_same_tokens() -> None:
    """The twin of each served request next to the training sample it shares its prompt
    with: on the common tokens both hold the same states, slot for slot, to bf16 rounding."""
    with open_trace(EXAMPLES / "clean.zarr") as tr:
        serving = read_serving(tr)
    td = open_training(TRAINING)
    samples = list(td.samples())
    matches, _ = align([r.tokens for r in serving.requests], [s.input_ids for s in samples])
    assert len(matches) == 8
    target = ReferenceTarget(TARGET)
    requests = [(m.serving, serving.requests[m.serving]) for m in matches]
    with torch.inference_mode():
        twins = reference_twins(requests, target, TRAINED_LAYERS, len(samples))
    for (i, twin, match), m in zip(twins, matches, strict=True):
        assert match.serving == i and match.kind == "target" and match.training == twin.index
        sample = samples[m.training]
        n = m.length
        assert torch.equal(twin.input_ids[:n], sample.input_ids[:n].long())
        assert twin.aux.dtype == sample.aux.dtype == torch.bfloat16
        a, b = twin.aux[:n].float(), sample.aux[:n].float()
        assert a.shape == b.shape == (n, 3, target.hidden_size)
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        assert cos.min() > 0.9999, (i, cos.min())
        # and not any layer would do: the neighbouring layers are clearly further
        other = target.forward(twin.input_ids).layers[:n, SHIFTED_LAYERS]
        assert torch.nn.functional.cosine_similarity(other, b, dim=-1).mean() < 0.999


def test_clean_is_clean_with_the_target_alone(replays) -> None:
    trained, alone = replays["clean", "against"], replays["clean", "target"]
    assert trained.verdict.code == alone.verdict.code == "no-wiring-fault"
    assert trained.exit_code == alone.exit_code == 0
    cov = alone.coverage
    assert cov["aligned_requests"] == 0 and cov["target_twins"] == 8
    assert trained.coverage["target_twins"] == 0  # every request had its training twin
    # every stage of the traffic judged, the capture against the target's forward only
    assert alone.judged["target-capture"]["against_target_forward"] == 8
    assert alone.judged["target-capture"]["against_training"] == 0
    assert set(alone.judged) == {"target-capture", "draft-input", "draft-logits"}
    assert alone.not_judged == []
    assert alone.inputs["reference_twins"]["layers"] == TRAINED_LAYERS
    assert alone.inputs["against"] is None and alone.inputs["against_kind"] == "target"
    fps = alone.fingerprints
    assert fps["serving_layers"]["layer"] == fps["training_layers"]["layer"] == TRAINED_LAYERS
    # the engine's own draft rows do not depend on the training side: the same comparison
    evr_a, evr_t = trained.metrics["engine_vs_reference"], alone.metrics["engine_vs_reference"]
    assert evr_a["rows"] == evr_t["rows"] > 0 and evr_t["top1_agreement"] >= 0.99
    summary = alone.verdict.summary
    assert "serving and the target's forward agree" in summary
    assert "8 request(s) judged against the target's forward" in summary


def test_aux_layer_shift_is_named_with_the_target_alone(replays) -> None:
    trained, alone = replays["aux-layer-shift", "against"], replays["aux-layer-shift", "target"]
    assert trained.verdict.code == alone.verdict.code == "aux-layer-shift"
    assert trained.exit_code == alone.exit_code == 1
    f_train = next(f for f in trained.findings if f.code == "aux-layer-shift")
    f_alone = next(f for f in alone.findings if f.code == "aux-layer-shift")
    for f in (f_train, f_alone):
        assert f.evidence["serving_layers"] == SHIFTED_LAYERS
        assert f.evidence["training_layers"] == TRAINED_LAYERS
    assert f_alone.fix == f_train.fix and "[2, 4, 5]" in f_alone.fix
    assert alone.judged["target-capture"]["against_target_forward"] == 8
    assert {f.code for f in alone.faults} == {f.code for f in trained.faults}


def _copied(tmp_path: Path, name: str) -> Path:
    """The example trace alone in a temporary dir: the target path it records (relative to
    the repository) no longer resolves, as on a machine without the target."""
    out = tmp_path / f"{name}.zarr"
    shutil.copytree(EXAMPLES / f"{name}.zarr", out)
    return out


def test_without_a_target_the_report_lists_what_was_not_judged(tmp_path) -> None:
    trace = _copied(tmp_path, "clean")
    md = tmp_path / "r.md"
    args = ["replay", str(trace), "--drafter", str(DRAFTER), "--json", "--markdown", str(md)]
    run = run_main(*args, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["inputs"]["target"] is None and data["coverage"]["target_twins"] == 0
    # the draft stages are the engine's own rows, judged without any target
    assert set(data["judged"]) == {"draft-input", "draft-logits"}
    assert data["metrics"]["engine_vs_reference"]["top1_agreement"] >= 0.99
    [item] = data["not_judged"]
    assert item["stage"] == "target-capture" and item["n_requests"] == 8
    assert "no training twin" in item["why"] and "--target" in item["why"]
    assert len(item["requests"]) == 8
    verdict = data["verdict"]
    assert (
        verdict["code"] == "no-wiring-fault"
        and "not judged: capture layers" in (verdict["summary"])
    )
    text = md.read_text()
    assert "## Not judged" in text and "capture layers" in text.split("## Not judged")[1]


def test_without_a_target_a_capture_fault_is_said_to_be_unjudged(tmp_path) -> None:
    """The shifted capture cannot be seen without the target or the training data; the
    terminal says so instead of calling it clean without a word."""
    trace = _copied(tmp_path, "aux-layer-shift")
    run = run_main("replay", str(trace), "--drafter", str(DRAFTER), cwd=tmp_path, columns=200)
    assert run.returncode == 0, run.stderr
    lines = [x for x in run.stdout.splitlines() if x.startswith("not judged:")]
    assert len(lines) == 1 and "[target-capture] on 8 request(s)" in lines[0], run.stdout
    assert "--target" in lines[0]


def test_training_prompts_and_our_own_in_one_trace(tmp_path) -> None:
    """Recorded by the reference engine with the aux-layer-shift knob: two training prompts
    and two of our own (token sequences no sample starts with). With `--against`, the first two
    are judged against their samples and the other two against their twins, and the one
    verdict names the same layers."""
    from hstrace.engines import EngineConfig, Prompt, RecordOptions, get_engine

    td = open_training(TRAINING)
    words = sorted({int(t) for i in range(8) for t in td[i].input_ids.tolist() if int(t) > 3})
    g = torch.Generator().manual_seed(26)
    own = [tuple(words[j] for j in torch.randint(0, len(words), (20,), generator=g)) for _ in "ab"]
    prompts = [
        Prompt(input_ids=tuple(td[40].input_ids[:24].tolist()), source_id="training:40"),
        Prompt(input_ids=own[0], source_id="own:0"),
        Prompt(input_ids=tuple(td[41].input_ids[:24].tolist()), source_id="training:41"),
        Prompt(input_ids=own[1], source_id="own:1"),
    ]
    out = tmp_path / "mixed.zarr"
    engine = get_engine(
        "reference",
        EngineConfig(
            target=TARGET, drafter=DRAFTER, extra={"capture_convention": "output_of_layer"}
        ),
    )
    result = engine.record(prompts, out, RecordOptions(max_new_tokens=12, show_progress=False))
    assert result.ok
    res = replay_trace(out, TRAINING, target_path=TARGET)
    assert res.coverage["aligned_requests"] == 2 and res.coverage["target_twins"] == 2
    capture = res.judged["target-capture"]
    assert capture["against_training"] == 2 and capture["against_target_forward"] == 2
    assert res.not_judged == []
    assert res.verdict.code == "aux-layer-shift" and res.exit_code == 1
    f = next(f for f in res.findings if f.code == "aux-layer-shift")
    assert f.evidence["serving_layers"] == SHIFTED_LAYERS
    assert f.evidence["training_layers"] == TRAINED_LAYERS


def test_a_target_too_shallow_for_the_drafter_is_bad_input(tmp_path) -> None:
    """A --target with fewer layers than the drafter's aux layers need (the wrong model): one
    line naming the target dir, its layer count and the drafter's layers, exit 2 (not an
    internal failure)."""
    target = tmp_path / "short-target"
    shutil.copytree(TARGET, target)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = 4
    (target / "config.json").write_text(json.dumps(config))
    trace = EXAMPLES / "clean.zarr"
    args = ["replay", str(trace), "--drafter", str(DRAFTER), "--target", str(target)]
    run = run_main(*args, cwd=tmp_path)
    assert_one_line_error(run, str(target))
    [line] = [x for x in run.stderr.splitlines() if x.startswith("hstrace: error:")]
    assert "4 layers" in line and str(TRAINED_LAYERS) in line and "wrong target?" in line
    assert "bug in hstrace" not in run.stderr


def test_nothing_judged_is_exit_3_never_clean() -> None:
    """No stage of the traffic judged (only the static audit ran): `could-not-judge`, exit 3,
    and `no-wiring-fault` is not claimed; a result that does not report `judged` (built by
    hand, an MTP replay) keeps its verdict."""
    from hstrace.findings import Finding

    why = [{"stage": "draft-logits", "what": "draft logits", "why": "no draft rows"}]
    clean = Finding("no-wiring-fault", "nothing diverges", severity="info")
    res = ReplayResult(findings=[clean], judged={}, not_judged=why)
    assert res.exit_code == 3 and res.verdict.code == COULD_NOT_JUDGE
    assert "no draft rows" in res.verdict.summary and "--target" in res.verdict.fix
    assert not any(f.code == "no-wiring-fault" for f in res.findings)
    assert res.to_json()["not_judged"] == why
    fault = Finding("aux-layer-shift", "shifted", severity="fault")
    assert ReplayResult(findings=[fault], judged={}).exit_code == 1  # a fault still is one
    assert ReplayResult(findings=[clean]).exit_code == 0
    judged = {"draft-logits": {"requests": 1, "rows": 3}}
    assert ReplayResult(findings=[clean], judged=judged).verdict.code == "no-wiring-fault"


def test_the_repository_root_is_where_the_examples_say() -> None:
    # (the copies above rely on the recorded paths being relative to this root)
    with open_trace(EXAMPLES / "clean.zarr") as tr:
        recorded = Path(tr.meta["static"]["target"]["path"])
    assert not recorded.is_absolute() and (REPO / recorded).is_dir()
