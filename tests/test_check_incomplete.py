"""Issue 24, item 1, for `hstrace check`: a rule or the training evaluation that raises
internally is never a clean result: exit 3 ("could not judge") naming it in one line (text and
--json); with a fault found by the other rules, exit 1 and the result says it is incomplete."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.check import codes, run_check
from helpers.check import edit_weights as _edit_weights
from helpers.cli import TRAINING
from helpers.drafters import tiny_model as _model

import hstrace.rules.checkpoint as checkpoint
from hstrace.drafter import save_drafter

DRAFTER = TRAINING.parent / "drafter-speculators"


def _break_rule(monkeypatch, name: str, message: str) -> None:
    def raises(facts):
        raise KeyError(message)

    rules = [dataclasses.replace(r, when=raises) if r.name == name else r for r in checkpoint.RULES]
    assert [r.name for r in rules] == [r.name for r in checkpoint.RULES]
    assert any(r.when is raises for r in rules), f"no rule {name}"
    monkeypatch.setattr(checkpoint, "RULES", rules)


def test_a_rule_that_raises_is_exit_3_not_clean(tmp_path, capsys, monkeypatch):
    ck = tmp_path / "ck"
    save_drafter(_model(), ck, dialect="specforge")
    rc, doc, _ = run_check(capsys, str(ck), "--json")
    assert rc == 0 and doc["complete"] is True and doc["failed"] == {}  # clean without the bug
    _break_rule(monkeypatch, "tied-embeddings", "lm_head")
    rc, doc, _ = run_check(capsys, str(ck), "--json")
    assert rc == 3, doc
    assert doc["complete"] is False and doc["exit_code"] == 3
    assert doc["failed"] == {"rule tied-embeddings": "KeyError: 'lm_head'"}
    rc, out, err = run_check(capsys, str(ck))
    assert rc == 3 and "Traceback" not in err
    assert "no findings (static" not in out  # the clean wording is not printed
    line = (
        "judgement incomplete: rule tied-embeddings failed internally: KeyError: 'lm_head' (exit 3)"
    )
    assert line in out.splitlines(), out


def test_a_fault_from_other_rules_exits_1_and_says_incomplete(tmp_path, capsys, monkeypatch):
    ck = tmp_path / "ck"
    save_drafter(_model(), ck, dialect="specforge")
    _edit_weights(  # weights-dropped: a key prefix no engine maps
        ck, lambda sd: {k.replace("midlayer.", "transformer.h.0."): v for k, v in sd.items()}
    )
    _break_rule(monkeypatch, "tied-embeddings", "lm_head")
    rc, doc, _ = run_check(capsys, str(ck), "--json")
    assert rc == 1 and "weights-dropped" in codes(doc)
    assert doc["complete"] is False and doc["exit_code"] == 1
    assert doc["failed"] == {"rule tied-embeddings": "KeyError: 'lm_head'"}
    rc, out, _ = run_check(capsys, str(ck))
    assert rc == 1 and "weights-dropped" in out
    assert (
        "judgement incomplete: rule tied-embeddings failed internally: KeyError: 'lm_head' (exit 1)"
        in out.splitlines()
    )


def test_training_evaluation_that_raises_is_exit_3(capsys, monkeypatch):
    import hstrace.evaluation as evaluation

    def broken(*a, **k):
        raise RuntimeError("shape mismatch in the TTT loop")

    monkeypatch.setattr(evaluation, "training_findings", broken)
    rc, doc, _ = run_check(capsys, str(DRAFTER), "--json", "--against", str(TRAINING))
    assert rc == 3, doc
    assert doc["failed"] == {"training evaluation": "RuntimeError: shape mismatch in the TTT loop"}
    assert "training" not in doc["metrics"]  # nothing made up in its place
    rc, out, _ = run_check(capsys, str(DRAFTER), "--against", str(TRAINING))
    assert rc == 3
    assert (
        "judgement incomplete: training evaluation failed internally: RuntimeError: shape "
        "mismatch in the TTT loop (exit 3)" in out.splitlines()
    )


def test_bad_input_inside_a_rule_is_still_exit_2(tmp_path, capsys, monkeypatch):
    from hstrace.errors import CheckpointError

    def bad(facts):
        raise CheckpointError("ck/config.json: rope_theta is not a number")

    rules = [
        dataclasses.replace(r, when=bad) if r.name == "eagle-rope-theta" else r
        for r in checkpoint.RULES
    ]
    monkeypatch.setattr(checkpoint, "RULES", rules)
    ck = tmp_path / "ck"
    save_drafter(_model(), ck, dialect="specforge")
    rc, _, err = run_check(capsys, str(ck), "--json")
    assert rc == 2 and err.strip() == "hstrace: error: ck/config.json: rope_theta is not a number"


@pytest.mark.parametrize("debug", ["1"])
def test_debug_raises_the_rule_failure(tmp_path, capsys, monkeypatch, debug):
    ck = tmp_path / "ck"
    save_drafter(_model(), ck, dialect="specforge")
    _break_rule(monkeypatch, "tied-embeddings", "lm_head")
    monkeypatch.setenv("HSTRACE_DEBUG", debug)
    with pytest.raises(KeyError, match="lm_head"):
        run_check(capsys, str(ck), "--json")
