"""What each fault costs (issue 28 item 1): the impact stage (`hstrace.replay.impact`).

The arithmetic is checked on counts written by hand; the stage on real traces the reference
engine records from the tiny world with one or two fault knobs (each an engine behaviour:
`d2t` read as a table, slots concatenated in another order, another RoPE base), replayed
against the tiny world's training data. Nothing is injected into hstrace.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from hstrace.findings import Finding
from hstrace.replay.impact import (
    Chains,
    Counts,
    compare,
    impacts,
    realized_counts,
    verdict_phrase,
)
from hstrace.report.replay import render_markdown
from hstrace.training import open_training

WORLD = Path(__file__).resolve().parent.parent / "traces" / "tiny-world"
TRAINING = WORLD / "training-speculators"


# -- the arithmetic ------------------------------------------------------------------------------
def test_counts_accept_length_and_per_position_by_hand():
    # two requests: 4 steps (drafts accepted 3,1,0,2 -> by position 3,2,1), 2 steps (0,0)
    c = realized_counts([[3, 1, 0, 2], [0, 0]], k=3)
    assert c.steps.tolist() == [4, 2]
    assert c.accepted.tolist() == [[3, 2, 1], [0, 0, 0]]
    assert c.accept_length() == pytest.approx(1 + 6 / 6)
    # per position: the fraction of all steps whose draft i was accepted (not conditional)
    assert c.per_position() == pytest.approx([3 / 6, 2 / 6, 1 / 6])


def test_gain_inside_its_spread_is_not_measurable_and_says_so():
    served = Counts(np.array([10.0, 10.0, 10.0]), np.array([[5.0, 2, 1], [6, 3, 1], [4, 2, 0]]))
    same = compare(served, served, None, k=3, topk=1, tokens=60)
    assert same["gain"] == 0 and not same["measurable"] and same["realized"] is None
    assert "nothing measurable" in verdict_phrase(same) and "low priority" in verdict_phrase(same)
    better = Counts(served.steps, served.accepted + np.array([[4.0, 4, 4]]))
    up = compare(served, better, None, k=3, topk=1, tokens=60)
    assert up["measurable"] and up["gain"] == pytest.approx(1.2)
    assert up["gain_ci"][0] > 0
    lo, hi = up["fixed"]["ci"]
    assert lo <= up["fixed"]["accept_length"] <= hi
    assert verdict_phrase(up).startswith("fixing this raises the expected accept length")


def test_a_fault_the_replay_cannot_rebuild_has_no_impact_and_says_why():
    c = Counts(np.array([5.0]), np.array([[1.0, 0, 0]]))
    chains = Chains(k=3, counts={(False, True, True): c, (True, True, True): c},
                    served={"aux": "the serving capture", "model": None, "vocab": None})  # fmt: skip
    got = impacts([Finding("weights-dropped", "x"), Finding("rope-mismatch", "y")], chains)
    assert got.by_finding == [None, None]
    assert "weights-dropped" in got.unavailable[0]
    assert "no config misreading" in got.unavailable[1]
    assert got.all is None


# -- the stage, on traces the reference engine records ---------------------------------------
@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    from test_diagnose_scenarios import HELDOUT, PROMPT_TOKENS, record

    from hstrace.engines import Prompt

    td = open_training(TRAINING)
    prompts = [
        Prompt(input_ids=tuple(td[i].input_ids[:PROMPT_TOKENS].tolist()), source_id=f"h:{i}")
        for i in HELDOUT
    ]
    out = tmp_path_factory.mktemp("impact")
    knobs = {
        "clean": {},
        "d2t": {"d2t_as_table": True},
        "d2t+order": {"d2t_as_table": True, "aux_order": [2, 0, 1]},
        "rope+order": {"rope_theta": 500000.0, "aux_order": [2, 0, 1]},
    }
    return {name: record(out / f"{name}.zarr", prompts, **k) for name, k in knobs.items()}


def replayed(trace):
    from hstrace import replay_trace

    return replay_trace(trace, TRAINING)


def test_clean_trace_has_no_fault_and_no_impact(traces):
    result = replayed(traces["clean"])
    j = result.to_json()
    assert result.exit_code == 0 and j["verdict"]["impact_line"] is None
    assert all("impact" not in f for f in j["findings"]) and "impact_all" not in j


def test_d2t_table_costs_the_chain_and_its_fix_restores_it(traces):
    result = replayed(traces["d2t"])
    j = result.to_json()
    f = j["findings"][0]
    assert f["code"] == "d2t-direct-table"
    imp = f["impact"]
    assert imp["metric"] == "expected_accept_length"
    assert (imp["num_speculative_tokens"], imp["topk"]) == (3, 1)  # as the trace served
    assert len(imp["served"]["per_position"]) == 3 == len(imp["fixed"]["per_position"])
    # ids read from the table are other tokens: as served the target accepts no draft
    assert imp["served"]["accept_length"] < 1.1 and imp["served"]["per_position"][0] < 0.1
    assert imp["fixed"]["accept_length"] >= imp["served"]["accept_length"] + 1
    assert imp["measurable"] and imp["gain_ci"][0] > 0
    # the trace's own accept lengths next to the estimate: serving accepted next to nothing too
    assert imp["realized"]["accept_length"] < 1.1 and imp["estimate_agrees"] is True
    assert imp["fix"] == f["fix"] and "i + d2t[i]" in imp["fix"]
    s, x = imp["served"]["accept_length"], imp["fixed"]["accept_length"]
    assert j["verdict"]["impact_line"] == (
        f"fixing this raises the expected accept length {s:.2f} → {x:.2f}"
    )
    md = render_markdown(result)
    assert f"**Impact:** fixing this raises the expected accept length {s:.2f} → {x:.2f}" in md
    assert "## Impact" in md and "realized in the trace" in md


def test_two_faults_each_alone_and_all_names_the_one_eating_acceptance(traces):
    j = replayed(traces["d2t+order"]).to_json()
    by = {f["code"]: f for f in j["findings"] if f["severity"] == "fault"}
    assert set(by) == {"d2t-direct-table", "aux-order"}
    d2t, order = by["d2t-direct-table"]["impact"], by["aux-order"]["impact"]
    # fixing the slot order alone leaves the ids wrong: nothing measurable
    assert not order["measurable"] and order["fixed"]["accept_length"] < 1.1
    assert d2t["measurable"] and d2t["gain"] >= 1
    every = j["impact_all"]
    assert every["parts_fixed"] == ["aux", "vocab"] and "fix" not in every
    assert every["served"] == d2t["served"] == order["served"]
    assert every["fixed"]["accept_length"] >= every["served"]["accept_length"] + 1


def test_config_fault_is_rebuilt_from_the_whatif(traces):
    j = replayed(traces["rope+order"]).to_json()
    by = {f["code"]: f for f in j["findings"] if f["severity"] == "fault"}
    assert {"rope-mismatch", "aux-order"} <= set(by)
    for code in ("rope-mismatch", "aux-order"):
        imp = by[code]["impact"]
        assert imp is not None, by[code].get("impact_unavailable")
        assert imp["steps"] > 0 and imp["served"]["accept_length"] >= 1
    assert sorted(j["impact_all"]["parts_fixed"]) == ["aux", "model"]


# -- the fix is checked (issue 28 item 2) ----------------------------------------------------
def test_norm_flag_fix_is_the_value_that_reproduces_training(tmp_path):
    """The engine serves norm_before_residual=True to a drafter trained with False (the
    reference engine's norm-flag knob, as vLLM does when the key is absent): the fix names the
    flag and the trained value, checked on the training tensors, and what it is worth."""
    from test_diagnose_scenarios import HELDOUT, PROMPT_TOKENS, record

    from hstrace.engines import Prompt

    td = open_training(TRAINING)
    prompts = [
        Prompt(input_ids=tuple(td[i].input_ids[:PROMPT_TOKENS].tolist()), source_id=f"h:{i}")
        for i in HELDOUT
    ]
    trace = record(tmp_path / "nbr.zarr", prompts, norm_flags={"norm_before_residual": True})
    result = replayed(trace)
    v = result.verdict
    assert v.code == "norm-flag-mismatch", v.summary
    assert '"norm_before_residual": false' in v.fix
    check = v.evidence["fix_checked_on_training"]
    # training minimised the loss with the trained value: it fits the training tensors better
    assert check["nll_as_trained"] < check["nll_as_served"] and check["rows"] > 0
    imp = result.to_json()["findings"][0]["impact"]
    assert imp["fix"] == v.fix and imp["served"]["accept_length"] >= 1


# -- hstrace check --against (issue 28 item 5) -----------------------------------------------
def test_check_against_tries_the_norm_flag_fix_on_the_training_tensors(tmp_path):
    """The speculators drafter (trained with norm_before_residual False) shipped without the
    key, as a user would: vLLM reads True. `check --against` scores both values on the training
    tensors and names the one training used."""
    import json
    import shutil
    import subprocess
    import sys

    drafter = tmp_path / "drafter"
    shutil.copytree(WORLD / "drafter-speculators", drafter)
    config = json.loads((drafter / "config.json").read_text())
    assert config.pop("norm_before_residual") is False
    (drafter / "config.json").write_text(json.dumps(config))
    out = subprocess.run(
        [sys.executable, "-m", "hstrace", "check", str(drafter), "--against", str(TRAINING),
         "--engine", "vllm", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    doc = json.loads(out.stdout)
    f = next(f for f in doc["findings"] if f["code"] == "norm-flag-mismatch")
    got = f["evidence"]["on_training"]
    assert got["flag"] == "norm_before_residual" and got["value_that_fits_training"] is False
    fixed = got["with the fix (norm_before_residual=False)"]
    served = got["as the engine reads it (norm_before_residual=True)"]
    assert fixed["loss"] < served["loss"] and fixed["rows"] == served["rows"] > 0
    assert fixed["acc0_data"] > served["acc0_data"]
    assert "True for drafters trained" not in f["fix"]  # the rule no longer guesses the value


def test_checkpoint_exported_without_d2t_is_vocab_map_missing_with_its_price(traces, tmp_path):
    """The README demo's fault, on the reference engine: a parameters-only export drops the
    buffers d2t / t2d; an engine loading it keeps a zero map (draft id i -> target id i, as
    vLLM's Eagle3LlamaForCausalLM.load_weights does). Replay takes training's d2t for the
    drafter as trained, names vocab-map-missing (not weights-dropped) and prices its fix."""
    from safetensors.torch import load_file, save_file
    from test_diagnose_scenarios import HELDOUT, PROMPT_TOKENS, record

    from hstrace.engines import Prompt

    drafter = tmp_path / "drafter"
    shutil.copytree(WORLD / "drafter-speculators", drafter)
    weights = drafter / "model.safetensors"
    sd = load_file(weights)
    save_file({k: v for k, v in sd.items() if k not in ("d2t", "t2d")}, weights)
    td = open_training(TRAINING)
    prompts = [
        Prompt(input_ids=tuple(td[i].input_ids[:PROMPT_TOKENS].tolist()), source_id=f"h:{i}")
        for i in HELDOUT
    ]
    result = replayed(record(tmp_path / "no-d2t.zarr", prompts, drafter=drafter))
    j = result.to_json()
    codes = [f["code"] for f in j["findings"] if f["severity"] == "fault"]
    assert codes == ["vocab-map-missing"], codes
    f = j["findings"][0]
    # the numbers: the engine's target ids are its draft ids, training's map explains few
    readings = f["evidence"]["agreement_by_reading"]
    assert readings["no mapping"] >= 0.99 > 0.5 > readings["offsets"]
    assert "d2t" in f["fix"]
    imp = f["impact"]
    assert imp["fixed"]["accept_length"] >= imp["served"]["accept_length"] + 1
    assert imp["measurable"] and imp["gain_ci"][0] > 0
    # the trace realized the served side: next to nothing accepted beyond the bonus token
    assert imp["realized"]["accept_length"] < imp["fixed"]["accept_length"] - 1
    assert "the reference drafter uses the training data's" in json.dumps(j)


# -- the bundled examples (issue 28 item 3) --------------------------------------------------
EXAMPLES = WORLD.parent / "examples"


def test_bundled_fault_example_shows_a_fix_worth_a_token_with_both_numbers():
    """`traces/examples/vocab-map-missing.zarr` (the README's fault example, made by
    make_examples.py from the drafter exported without d2t / t2d): the fix is worth at least
    one accepted token per verify step, and the verdict prints both numbers."""
    from hstrace.report import render_terminal

    result = replayed(EXAMPLES / "vocab-map-missing.zarr")
    j = result.to_json()
    assert result.exit_code == 1
    assert [f["code"] for f in j["findings"] if f["severity"] == "fault"] == ["vocab-map-missing"]
    imp = j["findings"][0]["impact"]
    s, x = imp["served"]["accept_length"], imp["fixed"]["accept_length"]
    assert x >= s + 1 and imp["measurable"] and imp["gain_ci"][0] >= 1
    assert imp["estimate_agrees"] is True  # the trace's own acceptance next to the estimate
    line = f"fixing this raises the expected accept length {s:.2f} → {x:.2f}"
    assert j["verdict"]["impact_line"] == line
    from rich.console import Console

    console = Console(record=True, width=200)
    render_terminal(result, console)
    printed = console.export_text()
    assert line in printed and "d2t" in printed
