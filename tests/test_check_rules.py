"""The static checks as a table of rules (`hstrace.rules`): the table is well-formed, and an
engine version outside a rule's `applies_to` drops that rule (named), for `hstrace check` and
for replay's config stage alike."""

from __future__ import annotations

import pytest
from helpers.check import edit_config
from helpers.drafters import tiny_model
from packaging.specifiers import SpecifierSet

from hstrace.drafter import load_drafter, save_drafter
from hstrace.findings import CODES, SEVERITIES
from hstrace.rules import (
    RULES,
    format_applies_to,
    parse_applies_to,
    run_static,
)

KNOWN_ENGINES = {"sglang", "vllm"}


def test_the_table_is_well_formed():
    names = [r.name for r in RULES]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for rule in RULES:
        assert rule.code in CODES, rule.name
        assert rule.severity in SEVERITIES, rule.name
        assert callable(rule.when) and callable(rule.evidence), rule.name
        if rule.applies_to is None:
            continue
        assert set(rule.applies_to) <= KNOWN_ENGINES, (rule.name, rule.applies_to)
        for engine, spec in rule.applies_to.items():
            assert isinstance(spec, SpecifierSet), (rule.name, engine)
            SpecifierSet(str(spec))  # parses back
        # the string a finding carries reads back as the same specifiers
        text = format_applies_to(rule.applies_to)
        assert parse_applies_to(text) == dict(rule.applies_to), (rule.name, text)


def test_applies_to_strings_round_trip():
    assert format_applies_to(parse_applies_to("sglang>=0.5.23, vllm")) == "sglang>=0.5.23, vllm"
    both = parse_applies_to("sglang>=0.5.12,<0.5.17, vllm")
    assert both == {"sglang": SpecifierSet(">=0.5.12,<0.5.17"), "vllm": SpecifierSet("")}
    assert parse_applies_to(None) is None
    with pytest.raises(ValueError, match="cannot read"):
        parse_applies_to(">=0.5")


def _run(ck, **kwargs):
    model, rep = load_drafter(ck)
    run, _ = run_static(rep, model, advisory=True, **kwargs)
    return run


def test_a_version_outside_applies_to_drops_the_rule(tmp_path):
    ck = tmp_path / "ck"
    # speculators saves `layers.0.*` (SGLang < 0.5.12 drops it) and writes no
    # norm_before_residual (vLLM's default differs); norm_before_fc matters below SGLang 0.5.17
    save_drafter(tiny_model(norm_before_fc=True), ck, dialect="speculators")
    edit_config(ck, lambda c: c.pop("norm_before_residual"))
    everything = _run(ck)
    assert {"layers0-prefix", "norm-before-fc-old-sglang"} <= set(everything.rules)
    assert "speculators-norm-before-residual-default" in everything.rules

    old = _run(ck, engine="sglang", version="0.5.11")
    assert {"layers0-prefix", "norm-before-fc-old-sglang"} <= set(old.rules)

    mid = _run(ck, engine="sglang", version="0.5.12")
    assert "layers0-prefix" not in mid.rules and "norm-before-fc-old-sglang" in mid.rules
    assert "layers0-prefix" in [r.name for r, _ in mid.other_versions]

    new = _run(ck, engine="sglang", version="0.5.17")
    assert not {"layers0-prefix", "norm-before-fc-old-sglang"} & set(new.rules)
    assert "speculators-norm-before-residual-default" not in new.rules  # a vLLM rule

    vllm = _run(ck, engine="vllm", version="0.32.0+cpu")
    assert "speculators-norm-before-residual-default" in vllm.rules
    assert "layers0-prefix" not in vllm.rules
    # a post/dev build is judged as its release
    assert "layers0-prefix" in _run(ck, engine="sglang", version="0.5.11.post1").rules
    # every finding kept still says where it applies, in the same words as before the table
    f = dict(zip(old.rules, old.findings, strict=True))
    assert f["layers0-prefix"].applies_to == "sglang<0.5.12"
    assert f["norm-before-fc-old-sglang"].applies_to == "sglang<0.5.17"


def test_advisory_rules_only_when_asked(tmp_path):
    ck = tmp_path / "ck"
    save_drafter(tiny_model(aux_layer_ids=[2, 16, 29]), ck, dialect="specforge")

    moved: list[int] = []

    def top_level(c):  # SGLang's own flat format, the ids where SGLang never reads them
        moved.extend(c.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"])
        c["eagle_aux_hidden_state_layer_ids"] = moved

    edit_config(ck, top_level)
    model, rep = load_drafter(ck)
    asked, _ = run_static(rep, model, advisory=True)
    assert "aux-ids-top-level" in asked.rules
    (found,) = [f for r, f in asked.found if r.name == "aux-ids-top-level"]
    assert found.severity == "fault" and found.evidence["top_level_ids"] == moved == [2, 16, 29]
    replayed, _ = run_static(rep, model)  # replay's config stage
    assert "aux-ids-top-level" not in replayed.rules
    with_target, _ = run_static(rep, model, n_layers=8, advisory=True)  # default [2, 4, 5]
    assert "aux-ids-top-level-vs-default" in with_target.rules
    assert "aux-ids-top-level" not in with_target.rules
    # speculators writes the ids at the top level too, but SGLang cannot load that layout as
    # it is: no finding about ids it would never read (`hstrace check` says why, once)
    spec_ck = tmp_path / "spec"
    save_drafter(tiny_model(aux_layer_ids=[2, 16, 29]), spec_ck, dialect="speculators")
    model, rep = load_drafter(spec_ck)
    assert rep.config["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]
    asked, _ = run_static(rep, model, advisory=True)
    assert not {"aux-ids-top-level", "aux-ids-top-level-vs-default"} & set(asked.rules)


def test_norm_before_fc_absent_from_config_is_named_from_its_weight(tmp_path):
    """The key lost from config.json: the rule says what the engines do with the tensor (skip
    it), names the key, and the fix is the flag (not a rename)."""
    ck = tmp_path / "ck"
    save_drafter(tiny_model(norm_before_fc=True), ck, dialect="speculators")
    edit_config(ck, lambda c: c.pop("norm_before_fc"))
    run = _run(ck, engine="vllm", version="0.32.0+cpu")
    assert "norm-before-fc-absent" in run.rules and "unmapped-keys" not in run.rules
    (found,) = [f for r, f in run.found if r.name == "norm-before-fc-absent"]
    assert found.code == "norm-flag-mismatch"
    assert found.evidence["skipped_key"] == "input_norm.weight"
    assert '"norm_before_fc": true' in found.fix and "rename" not in found.fix.lower()
    # written explicitly (either value), the rule has nothing to say
    edit_config(ck, lambda c: c.update(norm_before_fc=True))
    assert "norm-before-fc-absent" not in _run(ck, engine="vllm", version="0.32.0+cpu").rules
