"""The one registry of finding codes (`hstrace.findings.REGISTRY`): every code declared there,
documented in docs/findings.md, emitted only by the checks it names, built only through it."""

from __future__ import annotations

import ast
import importlib
import re
import string
from pathlib import Path

import pytest

from hstrace.diagnose import CHECKS
from hstrace.findings import (
    FACTS,
    HYPOTHESES,
    REGISTRY,
    SEVERITIES,
    STAGES,
    Finding,
    finding,
    from_fact,
)
from hstrace.rules import RULES

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hstrace"
DOC = ROOT / "docs" / "findings.md"
# The check of `diagnose` that runs the rule table (`hstrace check`'s rules on the checkpoint).
RULE_RUNNER = "diagnose.config:checkpoint_findings"


def _doc_sections() -> dict[str, str]:
    """`### \\`code\\`` heading -> its section text."""
    text = DOC.read_text()
    parts = re.split(r"^### `([a-z0-9-]+)`\s*$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def _check_name(fn) -> str:
    return f"{fn.__module__.removeprefix('hstrace.')}:{fn.__name__}"


def test_every_registered_code_has_its_section_in_the_doc_under_its_stage():
    sections = _doc_sections()
    missing = [c for c in REGISTRY if c not in sections]
    assert not missing, f"registered codes without a section in docs/findings.md: {missing}"
    undeclared = [c for c in sections if c not in REGISTRY]
    assert not undeclared, f"docs/findings.md documents codes the registry lacks: {undeclared}"
    text = DOC.read_text()
    for code, c in REGISTRY.items():
        stage_at = text.index(f"## Stage `{c.stage}`")
        assert stage_at < text.index(f"### `{code}`"), code
        assert c.anchor == f"docs/findings.md#{code}"
        assert c.stage in STAGES and c.severity in SEVERITIES, code


def test_a_code_the_registry_lacks_cannot_be_emitted():
    with pytest.raises(ValueError, match="declare it in hstrace.findings.REGISTRY"):
        Finding("made-up-code", "x")
    with pytest.raises(ValueError, match="declare it in hstrace.findings.REGISTRY"):
        finding("made-up-code", "x")
    with pytest.raises(ValueError, match="unknown audit fact"):
        from_fact({"fact": "made-up-fact", "summary": "x"})


def test_fix_templates_fill_from_the_registry():
    f = finding("aux-layer-shift", "s", {"shift": 1}, train_hf=[2, 4], engine_ids="X: [1, 3]")
    assert f.severity == "fault" and f.stage == "target-capture"
    assert "(HF hidden_states [2, 4]): in the draft config.json set X: [1, 3]; or" in f.fix
    assert finding("metric-overstates", "s").severity == "warning"
    assert finding("no-wiring-fault", "s").severity == "info"
    with pytest.raises(KeyError, match="no fix variant"):
        finding("target-drift", "s", variant="nope")
    # Every template of every code formats with the fields its emitters pass (no stray braces).
    for code, c in REGISTRY.items():
        for variant, template in c.fix.items():
            names = {f for _, f, _, _ in string.Formatter().parse(template) if f}
            assert c.fix_text(variant, **{n: 1 for n in names}), (code, variant)


def test_every_diagnose_check_is_named_by_the_codes_it_may_emit():
    declared = {name for c in REGISTRY.values() for name in c.checks}
    for fn in CHECKS:
        name = _check_name(fn)
        assert name == RULE_RUNNER or name in declared, f"{name} is in CHECKS, no code names it"
    in_checks = {_check_name(fn) for fn in CHECKS}
    for code, c in REGISTRY.items():
        for name in c.checks:
            if name.startswith("diagnose."):
                module, _, fn = name.partition(":")
                assert callable(getattr(importlib.import_module(f"hstrace.{module}"), fn)), name
                if fn != "no_wiring_fault":  # the closing check, run when nothing diverges
                    assert name in in_checks, f"{code}: {name} is not in diagnose.CHECKS"


def _emitted(path: Path) -> list[tuple[str, str, int]]:
    """(function, code, line) for every `finding("code", ...)` / `Finding("code", ...)` call with
    a literal code in a module."""
    tree = ast.parse(path.read_text())
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name | ast.Attribute)
                and (node.func.id if isinstance(node.func, ast.Name) else node.func.attr)
                in ("finding", "Finding", "Reading")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                out.append((fn.name, node.args[0].value, node.lineno))
    return out


def test_codes_are_emitted_only_in_the_rooms_of_checks():
    """No module outside the registry, the checks (diagnose, the rule table, `hstrace check
    --against`'s slot checks) and the result's fallback verdict names a code when it builds a
    finding; the engines state facts, the what-if search names hypotheses."""
    allowed = ("diagnose/", "evaluation/slots.py", "findings.py", "replay/result.py")
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        found = _emitted(path)
        if not rel.startswith(allowed):
            assert not found, f"hstrace/{rel} builds findings of codes {found}"
        for _, code, line in found:
            assert code in REGISTRY, f"hstrace/{rel}:{line} emits {code!r}, the registry lacks it"


def test_a_literal_code_in_a_check_is_declared_for_that_check():
    """`finding("aux-order", ...)` inside `diagnose.capture:<fn>` needs `fn` (or, for the
    shared classification, one of the module's checks) in REGISTRY["aux-order"].checks."""
    for path in sorted((PACKAGE / "diagnose").glob("*.py")):
        module = f"diagnose.{path.stem}"
        for fn, code, line in _emitted(path):
            names = REGISTRY[code].checks
            assert f"{module}:{fn}" in names or any(n.startswith(f"{module}:") for n in names), (
                f"hstrace/diagnose/{path.name}:{line} ({fn}) emits {code!r}; registry: {names}"
            )


def test_rules_use_registered_codes_that_name_the_rule_table():
    for rule in RULES:
        assert rule.code in REGISTRY, rule.name
        assert "rules.checkpoint" in REGISTRY[rule.code].checks, (rule.name, rule.code)


def test_hypotheses_and_facts_map_to_registered_codes():
    assert set(HYPOTHESES) == {
        "norm-flag",
        "rope-theta",
        "sliding-window",
        "target-embedding",
        "token-shift",
        "aux-layer-shift",
        "no-fc",
    }
    for kind, code in HYPOTHESES.items():
        assert "what-if" in REGISTRY[code].fix, (kind, code)
    assert FACTS == {
        "weights-not-loaded": "weights-dropped",
        "aux-ids-ignored": "aux-layers-default",
        "spec-adjusted": "spec-params-adjusted",
    }
    f = from_fact({"fact": "spec-adjusted", "summary": "s", "evidence": {"topk": 1}})
    assert (f.code, f.severity, f.evidence) == ("spec-params-adjusted", "warning", {"topk": 1})
    assert "num_draft_tokens must be num_steps+1" in f.fix


def _string_literals(path: Path) -> set[str]:
    return {
        n.value
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


@pytest.mark.parametrize(
    "module",
    ["replay/whatif.py"]
    + sorted(str(p.relative_to(PACKAGE)) for p in (PACKAGE / "engines").rglob("*.py")),
)
def test_the_search_and_the_engines_name_no_codes(module):
    """The what-if search names hypothesis kinds, the engines audit facts; a string that is a
    code only (not also a kind, as `token-shift` is) would be a code born there."""
    literals = _string_literals(PACKAGE / module)
    born = sorted(c for c in REGISTRY if c in literals and c not in HYPOTHESES)
    assert not born, f"hstrace/{module} names codes {born}"


def test_the_checks_a_replay_runs_are_the_ones_the_registry_names_in_dataflow_order():
    """`diagnose.CHECKS` is read off the registry (a new code's check needs no second list),
    in the order findings were reported before it was (the batch check before the capture
    ones, the what-if search before the rule table). A new code's check may come in between."""
    names = [_check_name(c) for c in CHECKS]
    assert len(set(names)) == len(names)
    before = [
        "diagnose.measurement:acceptance_simulated",
        "diagnose.config:spec_params",
        "diagnose.config:static_load_findings",
        # issue 28: norm-flag-mismatch's fix is the what-if's (checked on the training
        # tensors), so the what-if checks precede the rule table in its precedence
        "diagnose.config:whatif_findings",
        "diagnose.config:fed_back_state",
        RULE_RUNNER,
        "diagnose.weights:weights_dropped",
        "diagnose.vocab:vocab_mapping",
        "diagnose.batch:batch_coupling",
        "diagnose.capture:aux_layers_default",
        "diagnose.capture:aux_layer_shift",
        "diagnose.capture:aux_order",
        "diagnose.capture:slot_layout",
        "diagnose.capture:hidden_corrupt",
        "diagnose.capture:target_drift",
        "diagnose.draft_input:fc_skipped",
        "diagnose.draft_input:token_shift",
        "diagnose.draft_input:chunk_boundary_token",
        "diagnose.cache:draft_kv_stale",
        "diagnose.training_side:teacher_norm",
        "diagnose.training_side:metric_overstates",
    ]
    assert [n for n in names if n in before] == before


def test_merge_keeps_the_first_check_of_the_codes_precedence_whatever_the_run_order():
    from hstrace.diagnose import config, draft_input, merge

    search = finding("fc-skipped", "by the search", {"what_if": "fc skipped"}, variant="what-if")
    width = finding("fc-skipped", "by the width", {"width": 8}, num_aux=3, fc_in=24)
    other = finding("token-shift", "t", {"shift": 1}, variant="positions")
    for found in (
        [(draft_input.fc_skipped, width), (config.whatif_findings, search)],
        [(config.whatif_findings, search), (draft_input.fc_skipped, width)],
    ):
        fresh = [(c, Finding(f.code, f.summary, dict(f.evidence), f.fix)) for c, f in found]
        (kept,) = merge(fresh)
        # REGISTRY["fc-skipped"].checks: the what-if search first, then the width check.
        assert kept.summary == "by the search"
        assert kept.evidence == {"what_if": "fc skipped", "width": 8}
    out = merge([(draft_input.token_shift, other), (config.whatif_findings, search)])
    assert [f.code for f in out] == ["fc-skipped", "token-shift"]  # CHECKS order
