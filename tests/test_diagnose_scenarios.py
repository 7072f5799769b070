"""One scenario per finding code, from the tiny world, each with exactly that fault.

The reference engine records a trace with one fault knob set (or the training side is
rebuilt with one defect: a dump with the wrong norm form, an embedding slot, another layer set);
`hstrace replay` against the tiny world's training data must name exactly that code as its
verdict. A clean scenario must give `no-wiring-fault` (no false alarm). All stores are real
Zarr traces and real training dumps on disk.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hstrace import replay_trace
from hstrace.drafter import load_drafter, save_drafter
from hstrace.engines import EngineConfig, Prompt, RecordOptions, get_engine
from hstrace.reference.target import ReferenceTarget
from hstrace.training import open_training

WORLD = Path(__file__).resolve().parent.parent / "traces" / "tiny-world"
TARGET = WORLD / "target"
DRAFTER = WORLD / "drafter-speculators"
TRAINING = WORLD / "training-speculators"
HELDOUT = range(40, 44)  # the tiny world's held-out samples
PROMPT_TOKENS = 24
NEW_TOKENS = 8

pytestmark = pytest.mark.skipif(not TARGET.is_dir(), reason="tiny world not built")


@pytest.fixture(scope="session")
def samples():
    td = open_training(TRAINING)
    return [td[i] for i in HELDOUT]


@pytest.fixture(scope="session")
def prompts(samples):
    return [
        Prompt(
            input_ids=tuple(s.input_ids[:PROMPT_TOKENS].tolist()), source_id=f"heldout:{s.index}"
        )
        for s in samples
    ]


@pytest.fixture(scope="session")
def target():
    return ReferenceTarget(TARGET)


@pytest.fixture(scope="session")
def scenario_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("scenarios")


def record(out: Path, prompts, drafter: Path = DRAFTER, **knobs) -> Path:
    engine = get_engine("reference", EngineConfig(target=TARGET, drafter=drafter, extra=knobs))
    engine.check_supported()
    result = engine.record(
        prompts, out, RecordOptions(max_new_tokens=NEW_TOKENS, show_progress=False)
    )
    assert result.ok and result.prompts_completed == len(prompts)
    return out


def verdict(trace: Path, against: Path = TRAINING, **kw):
    result = replay_trace(trace, against, **kw)
    return result.verdict.code, result


# -- scenarios the reference engine produces with one knob -----------------------------------
KNOB_SCENARIOS = {
    "no-wiring-fault": {},
    "spec-params-adjusted": {"num_steps": 3, "topk": 1, "num_draft_tokens": 8},
    "norm-flag-mismatch": {"norm_flags": {"norm_before_residual": True}},
    "attention-window": {"sliding_window": 8},
    "rope-mismatch": {"rope_theta": 500000.0},
    "weights-dropped": {"drop_weights": "layers.0."},
    "d2t-direct-table": {"d2t_as_table": True},
    "vocab-map-missing": {"no_vocab_map": True},
    # The speculators drafter's ids [2, 4, 5] are "before layer k"; read as SGLang's "output of
    # layer k" they capture one layer deeper.
    "aux-layer-shift": {"capture_convention": "output_of_layer"},
    "aux-order": {"aux_order": [2, 0, 1]},
    "hidden-corrupt": {"corrupt": "zeros"},
    "target-drift": {"target_noise": 0.1},
    "fc-skipped": {"skip_fc": True},
    "token-shift": {"token_shift": -1},
}


@pytest.mark.parametrize("code", list(KNOB_SCENARIOS))
def test_knob_scenario_names_its_fault(code, prompts, scenario_dir):
    trace = record(scenario_dir / f"{code}.zarr", prompts, **KNOB_SCENARIOS[code])
    got, result = verdict(trace)
    assert got == code, [f.to_json() for f in result.findings]
    if code == "no-wiring-fault":
        assert result.exit_code == 0 and not result.faults
        assert result.metrics["engine_vs_reference"]["within_noise"]
    else:
        assert result.verdict.fix, "every finding carries a concrete fix"
        assert result.verdict.evidence, "every finding carries its evidence"


def test_fed_back_state_is_caught_at_draft_steps(prompts, scenario_dir):
    """The engine feeds norm(h) back (speculators `norm_output`) to a drafter trained on h:
    step 0 is untouched, only the recorded chain steps k >= 1 show it."""
    trace = record(scenario_dir / "feed-normed.zarr", prompts, norm_flags={"feed_normed": True})
    got, result = verdict(trace)
    assert got == "norm-flag-mismatch", [f.to_json() for f in result.findings]
    ev = result.verdict.evidence
    assert ev["flag"] == "feed_normed" and ev["engine_behaves_as"] is True
    assert [p["draft_step"] for p in ev["by_draft_step_as_trained"]] == [1, 2]
    assert max(p["max_logit_diff"] for p in ev["by_draft_step_as_trained"]) > ev["tolerance"]
    assert all(p["max_logit_diff"] <= ev["tolerance"] for p in ev["by_draft_step_flipped"])
    evr = result.metrics["engine_vs_reference"]
    assert evr["within_noise"]  # step 0 alone finds nothing
    assert [p["draft_step"] for p in evr["by_draft_step"]] == [1, 2]


@pytest.mark.parametrize("kind", ["constant", "other-request"])
def test_other_corruptions_are_hidden_corrupt(kind, prompts, scenario_dir):
    trace = record(scenario_dir / f"corrupt-{kind}.zarr", prompts, corrupt=kind)
    got, result = verdict(trace)
    assert got == "hidden-corrupt", [f.to_json() for f in result.findings]


def test_position_offset_alone_is_not_a_fault(prompts, scenario_dir):
    """RoPE is relative: a constant position offset changes no logit; replay notes it only."""
    trace = record(scenario_dir / "position-offset.zarr", prompts, position_shift=1)
    got, result = verdict(trace)
    assert got == "no-wiring-fault"
    assert result.metrics["draft_position_base"] == 1


def test_whatif_names_the_flag_and_its_value(prompts, scenario_dir):
    trace = record(scenario_dir / "flag.zarr", prompts, norm_flags={"norm_before_residual": True})
    _, result = verdict(trace)
    evidence = result.verdict.evidence
    assert evidence["what_if"] == "norm_before_residual=True"
    assert evidence["max_logprob_diff_with_it"] <= evidence["tolerance"]
    assert evidence["max_logprob_diff_without_it"] > evidence["tolerance"]
    assert '"norm_before_residual": false' in result.verdict.fix


# -- scenarios built on the training side / the checkpoint ------------------------------------
def write_speculators_dump(root: Path, samples, states) -> Path:
    """speculators v0.5+ layout: hidden_states/hs_{i}.safetensors {token_ids, hidden_states}."""
    (root / "hidden_states").mkdir(parents=True)
    for i, (s, hs) in enumerate(zip(samples, states, strict=True)):
        save_file(
            {"token_ids": s.input_ids.clone(), "hidden_states": hs.to(torch.bfloat16).contiguous()},
            str(root / "hidden_states" / f"hs_{i}.safetensors"),
        )
    return root


def write_specforge_dump(root: Path, samples, aux, last) -> Path:
    """SpecForge layout: rows_0-N/data_{i}.ckpt {input_ids, loss_mask, aux_hidden_state,
    hidden_state (documented as post-norm)}."""
    rows = root / f"rows_0-{len(samples)}"
    rows.mkdir(parents=True)
    for i, s in enumerate(samples):
        torch.save(
            {
                "input_ids": s.input_ids.clone(),
                "loss_mask": s.loss_mask.long(),
                "aux_hidden_state": aux[i].flatten(1)[None].to(torch.bfloat16),
                "hidden_state": last[i][None].to(torch.bfloat16),
            },
            rows / f"data_{i}.ckpt",
        )
    return root


def test_field_incident_embedding_slot(samples, prompts, target, scenario_dir):
    """Training stored [embedding, L3, L5, final] (the tiny world's [embed, L3, L31, L59]) and
    the library read [:-1] as aux, while serving captured the configured layers [2, 4, 5]."""
    states = [target.forward(s.input_ids).layers[:, [0, 3, 5, 8]] for s in samples]
    dump = write_speculators_dump(scenario_dir / "incident-training", samples, states)
    trace = record(scenario_dir / "incident.zarr", prompts)
    with pytest.warns(UserWarning, match="loss mask"):
        got, result = verdict(trace, dump)
    assert got == "slot-layout", [f.to_json() for f in result.findings]
    assert result.verdict.evidence["training_layers"][0] == 0  # the embedding
    assert result.verdict.evidence["serving_layers"] == [2, 4, 5]
    assert result.exit_code == 1


def test_aux_layers_default(samples, prompts, target, scenario_dir):
    """The drafter was trained on layers [1, 3, 6]; the engine captured its defaults [2, 4, 5]."""
    layers = [1, 3, 6]
    fwd = [target.forward(s.input_ids) for s in samples]
    dump = write_specforge_dump(
        scenario_dir / "custom-layers-training",
        samples,
        [f.layers[:, layers] for f in fwd],
        [f.post_norm for f in fwd],
    )
    model, _ = load_drafter(DRAFTER)
    model.cfg.aux_layer_ids = layers
    drafter = scenario_dir / "drafter-custom-layers"
    save_drafter(model, drafter, dialect="speculators")
    honest = record(scenario_dir / "custom-layers-ok.zarr", prompts, drafter=drafter)
    assert verdict(honest, dump)[0] == "no-wiring-fault"  # configured ids applied: no fault
    trace = record(
        scenario_dir / "custom-layers-default.zarr", prompts, drafter=drafter, default_layers=True
    )
    got, result = verdict(trace, dump)
    assert got == "aux-layers-default", [f.to_json() for f in result.findings]
    assert result.verdict.evidence["training_layers"] == layers


def test_teacher_norm(samples, prompts, target, scenario_dir):
    """A SpecForge dump whose `hidden_state` is the pre-norm final state (SpecForge documents
    and reads it as the post-norm lm_head input)."""
    fwd = [target.forward(s.input_ids) for s in samples]
    dump = write_specforge_dump(
        scenario_dir / "prenorm-teacher",
        samples,
        [f.layers[:, [2, 4, 5]] for f in fwd],
        [f.layers[:, -1] for f in fwd],  # pre-norm final
    )
    trace = record(scenario_dir / "teacher.zarr", prompts)
    got, result = verdict(trace, dump)
    assert got == "teacher-norm", [f.to_json() for f in result.findings]
    assert result.metrics["teacher_state"] == {
        **result.metrics["teacher_state"],
        "claimed": "post",
        "measured": "pre",
    }
    # The same dump with the right form is clean.
    ok = write_specforge_dump(
        scenario_dir / "postnorm-teacher",
        samples,
        [f.layers[:, [2, 4, 5]] for f in fwd],
        [f.post_norm for f in fwd],
    )
    assert verdict(trace, ok)[0] == "no-wiring-fault"


def test_embed_head_source(prompts, scenario_dir):
    """The drafter trained its own embedding; the engine replaced it with the target's."""
    model, _ = load_drafter(DRAFTER)
    g = torch.Generator().manual_seed(7)
    w = model.embed_tokens.weight.data
    w.add_(torch.randn(w.shape, generator=g) * w.std() * 0.5)
    drafter = scenario_dir / "drafter-own-embedding"
    save_drafter(model, drafter, dialect="speculators")
    trace = record(scenario_dir / "embed.zarr", prompts, drafter=drafter, embed_from_target=True)
    got, result = verdict(trace)
    assert got == "embed-head-source", [f.to_json() for f in result.findings]


def test_metric_overstates(samples, prompts, target, scenario_dir):
    """A draft vocab that misses the tokens the target picks most: the library's accuracy
    (teacher restricted to the draft vocab) stays high while greedy serving cannot accept."""
    model, _ = load_drafter(DRAFTER)
    used = torch.arange(model.cfg.draft_vocab_size) + model.d2t
    picks = torch.cat([target.forward(s.input_ids).logits.argmax(-1) for s in samples])
    common = torch.bincount(picks, minlength=model.cfg.vocab_size).argsort(descending=True)
    drop = [int(t) for t in common[:6] if bool(torch.isin(t, used))]
    keep = [int(t) for t in used if int(t) not in drop]
    spare = [t for t in range(model.cfg.vocab_size) if t not in set(used.tolist())][: len(drop)]
    new_used = sorted(keep + spare)
    rows = {int(t): i for i, t in enumerate(used.tolist())}
    head = torch.zeros_like(model.lm_head.weight.data)
    for i, t in enumerate(new_used):
        if t in rows:
            head[i] = model.lm_head.weight.data[rows[t]]
    model.lm_head.weight.data.copy_(head)
    model.d2t.copy_(torch.tensor(new_used) - torch.arange(len(new_used)))
    model.t2d.zero_()
    model.t2d[torch.tensor(new_used)] = True
    drafter = scenario_dir / "drafter-small-vocab"
    save_drafter(model, drafter, dialect="speculators")
    trace = record(scenario_dir / "small-vocab.zarr", prompts, drafter=drafter)
    got, result = verdict(trace)
    assert got == "metric-overstates", [f.to_json() for f in result.findings]
    m = result.metrics
    assert m["acc0_training_teacher"] - m["acc0_training_full_vocab"] > 0.1


def test_against_a_second_trace(prompts, scenario_dir):
    """`--against` also takes a trace: the reference engine's clean trace as the baseline."""
    clean = record(scenario_dir / "baseline.zarr", prompts)
    shifted = record(
        scenario_dir / "vs-trace-shift.zarr", prompts, capture_convention="output_of_layer"
    )
    assert verdict(clean, clean)[0] == "no-wiring-fault"
    got, result = verdict(shifted, clean)
    assert got == "aux-layer-shift", [f.to_json() for f in result.findings]
    assert result.coverage["exact"] == len(prompts)


def test_json_has_documented_keys(prompts, scenario_dir):
    trace = record(scenario_dir / "json.zarr", prompts, d2t_as_table=True)
    data = json.loads(json.dumps(replay_trace(trace, TRAINING).to_json()))
    assert {"schema_version", "verdict", "findings", "metrics", "coverage"} <= set(data)
    assert data["verdict"]["code"] == "d2t-direct-table"
    assert {"code", "stage", "summary", "fix"} <= set(data["verdict"])
    assert all(
        {"code", "stage", "severity", "summary", "evidence", "fix"} <= set(f)
        for f in data["findings"]
    )
    assert data["coverage"]["aligned_requests"] == len(prompts)


@pytest.fixture(autouse=True, scope="session")
def _cleanup(scenario_dir):
    yield
    shutil.rmtree(scenario_dir, ignore_errors=True)
