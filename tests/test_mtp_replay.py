"""The MTP replay's pieces without an engine: the vLLM MTP load audit (target keys passed
over, weight files vLLM never opens), the fed-state decision, the pairing measure, and the
checks on evidence built from numbers.

Stand-ins, named: `_evidence` builds `MTPEvidence` around an empty `ServingData` with the
numbers a replay would measure (vLLM 0.32 always pairs h[t] with token t+1, so a served
pairing of t+0 cannot be recorded live; `mtp-token-pairing` is judged here on such numbers).
The live recordings are tests/test_vllm_mtp_live.py.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from hstrace.diagnose import mtp as checks
from hstrace.engines.load_audit import weights_facts
from hstrace.engines.vllm import audit
from hstrace.replay.mtp import (
    Fed,
    MTPEvidence,
    decide_state,
    pairing_shares,
    relative_errors,
    state_candidates,
    swap_halves,
)
from hstrace.replay.read import ServingData


def test_the_mtp_load_audit_passes_over_the_targets_keys_and_names_the_rest() -> None:
    spec = audit.MTP_LOAD
    assert spec.is_target_key("model.layers.3.mlp.up_proj.weight")
    assert spec.is_target_key("model.norm.weight")
    assert not spec.is_target_key("model.mtp_layers.0.input_proj.weight")
    assert not spec.is_target_key("model.mtp.layers.0.input_proj.weight")
    wa = spec.audit(["model.mtp_layers.4.input_proj.weight", "lm_head.weight"])
    wa.checkpoint_keys = {
        "lm_head.weight": {},
        "model.mtp.layers.0.input_proj.weight": {},
    }
    wa.consumed_by = {"lm_head.weight": ["lm_head.weight"]}
    wa.loaded_parameters = {"lm_head.weight"}
    wa.target_keys = ["model.layers.0.mlp.up_proj.weight"]
    assert wa.dropped_keys() == ["model.mtp.layers.0.input_proj.weight"]
    assert wa.unloaded_parameters() == ["model.mtp_layers.4.input_proj.weight"]
    (fact,) = weights_facts(wa, spec)
    assert fact["fact"] == "weights-not-loaded"
    assert fact["evidence"]["dropped_keys"] == ["model.mtp.layers.0.input_proj.weight"]
    assert "mtp_layers" in fact["fix"]
    assert wa.to_static()["target_keys_passed_over"] == 1


def test_weight_files_the_index_does_not_name_are_found_with_their_keys(tmp_path) -> None:
    assert audit.unread_weight_files(tmp_path) == {}  # no index: vLLM reads every file
    save_file({"a.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    save_file(
        {"model.mtp_layers.0.input_proj.weight": torch.zeros(2, 4), "x.bias": torch.zeros(1)},
        str(tmp_path / "mtp.safetensors"),
    )
    index = {"weight_map": {"a.weight": "model.safetensors"}}
    (tmp_path / audit.INDEX_FILE).write_text(json.dumps(index))
    assert audit.unread_weight_files(tmp_path) == {
        "mtp.safetensors": ["model.mtp_layers.0.input_proj.weight", "x.bias"]
    }


def test_mtp_record_states_heads_depths_scales_and_sharing() -> None:
    rec = audit.mtp_record(
        method="mtp",
        model_type="mimo_mtp",
        architectures=["MiMoMTPModel"],
        n_predict=1,
        num_speculative_tokens=3,
        draft_class="MiMoMTP",
        target_class="MiMoForCausalLM",
        target_layers=4,
        parameters=[
            "model.mtp_layers.4.input_proj.weight",
            "model.mtp_layers.4.input_proj.weight_scale",
            "lm_head.weight",
        ],
        embed_shared=True,
        head_shared=False,
    )
    assert rec["head_layer_ids"] == [4] and rec["depths_reuse_head_0"] is True
    assert rec["scale_parameters"] == ["model.mtp_layers.4.input_proj.weight_scale"]
    assert rec["embed_shared_with_target"] and not rec["lm_head_shared_with_target"]


def test_the_fed_state_is_decided_from_the_numbers() -> None:
    g = torch.Generator().manual_seed(0)
    layers = torch.randn(10, 5, 8, generator=g) * 3  # [T, N+1, H], N = 4
    post = torch.nn.functional.rms_norm(layers[:, 4], (8,))
    cands = state_candidates(layers, post)
    assert list(cands) == [
        "layer 1 input",
        "layer 2 input",
        "layer 3 input",
        "pre_final_norm",
        "post_final_norm",
    ]
    errs = relative_errors(post + 1e-5, cands)
    assert decide_state(errs, 1e-3) == "post_final_norm"
    assert decide_state(relative_errors(layers[:, 4].bfloat16(), cands), 2e-2) == "pre_final_norm"
    assert decide_state(relative_errors(torch.zeros(10, 8) + 7, cands), 2e-2) is None


def test_pairing_shares_and_halves() -> None:
    tokens = torch.arange(10)
    assert pairing_shares(tokens[1:], tokens)[1] == 1.0
    assert pairing_shares(tokens, tokens) == {0: 1.0, 1: 0.0, 2: 0.0}
    w = torch.arange(8.0).reshape(1, 8)
    assert swap_halves(w).tolist() == [[4, 5, 6, 7, 0, 1, 2, 3]]
    assert torch.equal(swap_halves(swap_halves(w)), w)


def _evidence(**kw) -> MTPEvidence:
    serving = ServingData(requests=[], meta={"static": {"mtp": {"method": "mtp"}}})
    kw.setdefault("head_report", {"layer_prefixes": ["model.mtp_layers.0."]})
    return MTPEvidence(serving=serving, **kw)


def test_token_pairing_is_judged_against_the_shift_the_head_scores_best_with() -> None:
    acc = {"as_loaded": 0.2, "halves_exchanged": 0.02}
    acc.update({"pairing_shift_0": 0.1, "pairing_shift_1": 0.86, "pairing_shift_2": 0.05})
    served_t0 = {"serving_share_by_shift": {"0": 0.99, "1": 0.1, "2": 0.1}}
    (f,) = checks.token_pairing(_evidence(pairing=served_t0, training_accuracy=acc))
    assert f.code == "mtp-token-pairing" and f.stage == "draft-input"
    assert f.evidence["trained_shift"] == 1 and "t+0" in f.summary
    served_t1 = {"serving_share_by_shift": {"0": 0.1, "1": 1.0, "2": 0.1}}
    assert checks.token_pairing(_evidence(pairing=served_t1, training_accuracy=acc)) == []


def test_input_order_and_hidden_source_need_their_numbers() -> None:
    flipped = {"as_loaded": 0.03, "halves_exchanged": 0.9, "rows": 800}
    (f,) = checks.input_order(_evidence(training_accuracy=flipped))
    assert f.code == "mtp-input-order" and f.evidence["eh_proj_key"].endswith("input_proj.weight")
    assert (
        checks.input_order(
            _evidence(training_accuracy={"as_loaded": 0.9, "halves_exchanged": 0.05})
        )
        == []
    )
    fed = Fed("pre_final_norm", "post_final_norm", {}, {}, 1e-3, 2e-2, 100, 100)
    (h,) = checks.hidden_source(_evidence(fed=fed))
    assert h.code == "mtp-hidden-source" and "post_final_norm" in h.fix
    same = Fed("pre_final_norm", "pre_final_norm", {}, {}, 1e-3, 2e-2, 100, 100)
    assert checks.hidden_source(_evidence(fed=same)) == []
    undecided = Fed("pre_final_norm", None, {}, {}, 1e-3, 2e-2, 100, 0)
    assert checks.hidden_source(_evidence(fed=undecided)) == []


def test_mtp_checks_ignore_other_evidence_and_close_only_when_nothing_diverges() -> None:
    for check in (checks.input_order, checks.hidden_source, checks.token_pairing):
        assert check(object()) == []
    clean = _evidence(training_accuracy={"as_loaded": 0.9, "halves_exchanged": 0.05})
    j = checks.diagnose_mtp(clean)
    assert [f.code for f in j.findings] == ["no-wiring-fault"] and not j.failed
    faulty = _evidence(training_accuracy={"as_loaded": 0.05, "halves_exchanged": 0.9})
    assert [f.code for f in checks.diagnose_mtp(faulty).findings] == ["mtp-input-order"]


def test_a_head_the_checkpoint_does_not_fill_is_weights_dropped() -> None:
    ev = _evidence(
        head_report={"missing": ["layers.0.eh_proj.weight"], "path": "t", "layer_prefixes": []}
    )
    (f,) = checks.head_not_in_checkpoint(ev)
    assert f.code == "weights-dropped" and f.severity == "fault"
    assert f.evidence["unloaded_parameters"] == ["layers.0.eh_proj.weight"]
    assert checks.head_not_in_checkpoint(_evidence()) == []


def test_a_recorded_dropped_key_on_an_mtp_trace_stays_weights_dropped() -> None:
    """The load-time fact of an MTP trace (a saved `input_proj.bias` vLLM skips) is kept as it
    is: the norm-flag filter, an EAGLE-3 drafter's, has nothing to explain on MTP evidence
    (which has no `drafter`) and must not fail on it (the live bias test's exit 3, CI)."""
    from hstrace.diagnose.config import static_load_findings

    key = "model.mtp_layers.0.input_proj.bias"
    fact = {
        "code": "weights-dropped",
        "summary": "1 key dropped",
        "evidence": {"dropped_keys": [key]},
    }
    serving = ServingData(
        requests=[],
        meta={"static": {"weights": {"dropped_keys": [key]}, "findings_load": [fact]}},
    )
    ev = MTPEvidence(serving=serving, head_report={"layer_prefixes": ["model.mtp_layers.0."]})
    (f,) = static_load_findings(ev)
    assert f.code == "weights-dropped" and f.evidence["dropped_keys"] == [key]
