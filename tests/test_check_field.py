"""`hstrace check` never guesses (issue 11 item 7), on the tiny world's real artifacts:

a. no accuracy from a random embedding: a drafter saved without one and no --target gets every
   accuracy marked skipped, with no value;
b. t2d inconsistent with d2t (the set {i + d2t[i]} must equal t2d's true entries);
c. aux layer ids SGLang ignores (top-level, no eagle_config), judged against SGLang's defaults
   for the target's layer count;
d. a training slot that IS the token embedding, found with --against and no target (the seed
   incident: [embed, L3, L31, L59] stored, [2, 30, 58] served);
e. SpecForge's norm_output before/after PR #879: ambiguous without data, decided (or honestly
   not) from the training tensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.check import codes, run_check
from helpers.drafters import load_module
from safetensors.torch import load_file, save_file

from hstrace.drafter import load_drafter, save_drafter

WORLD = Path(__file__).resolve().parents[1] / "traces" / "tiny-world"

pytestmark = pytest.mark.skipif(
    not (WORLD / "MANIFEST.json").is_file(),
    reason="the tiny world is not built (python traces/tiny-world/build.py)",
)


def _copy(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(WORLD / name, dst)
    return dst


def _edit_config(ck: Path, fn) -> None:
    p = ck / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.write_text(json.dumps(cfg))


def _edit_weights(ck: Path, fn) -> None:
    f = ck / "model.safetensors"
    save_file(fn(load_file(str(f))), str(f), metadata={"format": "pt"})


def _finding(doc: dict, code: str) -> dict:
    found = [f for f in doc["findings"] if f["code"] == code]
    assert found, (code, codes(doc))
    return found[0]


# --- a. no accuracy from a random embedding -----------------------------------------------------


@pytest.mark.parametrize("dialect", ["specforge", "speculators-no-embed"])
def test_no_accuracy_without_an_embedding(tmp_path, capsys, monkeypatch, dialect):
    if dialect == "specforge":
        ck = _copy(tmp_path, "drafter-specforge")  # SpecForge saves no embedding
    else:  # a speculators checkpoint whose embedding was left out
        model, _ = load_drafter(WORLD / "drafter-speculators")
        ck = save_drafter(model, tmp_path / "ck", dialect="speculators", include_embed=False)
    data = str(WORLD / "training-specforge")
    rc, doc, _ = run_check(capsys, str(ck), "--json", "--against", data)
    train = doc["metrics"]["training"]
    # speculators normally saves the embedding: its absence is reported, accuracy is skipped
    assert rc == (0 if dialect == "specforge" else 1) and "--target" in train["skipped"]
    for name in ("acc0_teacher", "acc0_target", "acc0_data", "teacher_agrees_with_data"):
        assert train[name]["value"] is None and train[name]["skipped"] is True, name
    assert train["per_position"] == {"skipped": True}
    assert train["accept_len"]["value"] is None
    # the slot checks still ran; with no embedding the embedding-slot test asks whether a slot
    # is a function of the token alone: none of these is
    test = train["embedding_slot_test"]
    assert test["embedding_source"].startswith("none") and test["slots"]
    assert all(not t["is_embedding"] and t["rel_error"] > 0.1 for t in test["slots"])
    monkeypatch.setenv("COLUMNS", "240")
    rc, out, _ = run_check(capsys, str(ck), "--against", data)
    assert "metrics skipped" in out and "accept_len" not in out and "acc0_data" not in out
    # with the target's embedding the same drafter is measured
    rc, doc, _ = run_check(
        capsys, str(ck), "--json", "--against", data, "--target", str(WORLD / "target")
    )
    assert doc["metrics"]["training"]["acc0_target"]["value"] >= 0.6


# --- b. t2d vs d2t -------------------------------------------------------------------------------


def test_t2d_inconsistent_with_d2t(tmp_path, capsys):
    ck = _copy(tmp_path, "drafter-specforge")
    sd = load_file(str(ck / "model.safetensors"))
    reached = (torch.arange(sd["d2t"].numel()) + sd["d2t"]).tolist()
    dropped = reached[7]  # a target id a draft id maps to, cleared in t2d
    added = next(t for t in range(sd["t2d"].numel()) if t not in set(reached))  # never reached

    def edit(sd):
        t2d = sd["t2d"].clone()
        t2d[dropped], t2d[added] = False, True
        return {**sd, "t2d": t2d}

    _edit_weights(ck, edit)
    # SpecForge's own consistency check is the oracle: it accepts the clean buffers and
    # rejects these (if installed)
    try:
        from specforge.core.compact_teacher import validate_vocab_mapping_consistency
    except ImportError:
        validate_vocab_mapping_consistency = None
    if validate_vocab_mapping_consistency is not None:
        validate_vocab_mapping_consistency(sd["t2d"], sd["d2t"])
        with pytest.raises(ValueError, match="inconsistent"):
            validate_vocab_mapping_consistency(edit(sd)["t2d"], sd["d2t"])
    rc, doc, _ = run_check(capsys, str(ck), "--json")
    f = _finding(doc, "vocab-map-inconsistent")
    assert rc == 1 and codes(doc) == ["vocab-map-inconsistent"] and f["stage"] == "vocab-map"
    ev = f["evidence"]
    assert ev["only_in_d2t"] == [dropped] and ev["only_in_t2d"] == [added]
    assert ev["t2d_true"] == ev["d2t_distinct_targets"] == 256
    # SpecForge's buffer default: t2d all true, d2t real (written without its t2d)
    _edit_weights(ck, lambda sd: {**sd, "t2d": torch.ones_like(sd["t2d"])})
    rc, doc, _ = run_check(capsys, str(ck), "--json")
    ev = _finding(doc, "vocab-map-inconsistent")["evidence"]
    assert ev["t2d_true"] == 512 and ev["n_only_in_t2d"] == 512 - 256 and ev["n_only_in_d2t"] == 0


# --- c. aux ids SGLang ignores --------------------------------------------------------------------


def _top_level_ids(ck: Path, ids: list[int]) -> None:
    def edit(c):
        c.pop("eagle_config", None)
        c["eagle_aux_hidden_state_layer_ids"] = ids

    _edit_config(ck, edit)


def test_top_level_aux_ids_sglang_ignores(tmp_path, capsys):
    ck = _copy(tmp_path, "drafter-specforge")
    target = str(WORLD / "target")
    # [2, 4, 6] output-of-layer = HF [3, 5, 7]; SGLang's default for N = 8 is HF [2, 4, 5]
    _top_level_ids(ck, [2, 4, 6])
    rc, doc, _ = run_check(capsys, str(ck), "--json", "--target", target)
    f = _finding(doc, "aux-layers-default")
    assert rc == 1 and f["severity"] == "fault" and f["applies_to"] == "sglang<=0.5.23"
    ev = f["evidence"]
    assert ev["top_level_ids"] == [2, 4, 6] and ev["trained_hf_indices"] == [3, 5, 7]
    assert ev["sglang_default_hf_indices"] == [2, 4, 5] and ev["target_layers"] == 8
    assert ev["read_by_sglang"] is None and ev["eagle_config"] is None
    # without the target: SGLang's own flat format with the ids where SGLang never reads them
    # is a fault for SGLang (exit 1), naming what --target would decide
    rc, doc, _ = run_check(capsys, str(ck), "--json")
    f = _finding(doc, "aux-layers-default")
    assert rc == 1 and f["severity"] == "fault" and "--target" in f["summary"]
    assert f["applies_to"] == "sglang<=0.5.23" and f["engines"] == ["sglang"]
    assert f["evidence"]["top_level_ids"] == [2, 4, 6] and f["evidence"]["read_by_sglang"] is None
    assert doc["judged_for"] == "sglang==0.5.23, vllm==0.33.0" and doc["not_loadable"] == {}
    # judged for vLLM alone: vLLM reads the top-level ids, nothing to report
    rc, doc, _ = run_check(capsys, str(ck), "--json", "--engine", "vllm")
    assert rc == 0 and "aux-layers-default" not in codes(doc)
    # the ids SGLang's default happens to capture: harmless, nothing to report
    _top_level_ids(ck, [1, 3, 4])
    rc, doc, _ = run_check(capsys, str(ck), "--json", "--target", target)
    assert rc == 0 and "aux-layers-default" not in codes(doc)
    # ids where SGLang reads them: never flagged
    rc, doc, _ = run_check(capsys, str(WORLD / "drafter-specforge"), "--json")
    assert "aux-layers-default" not in codes(doc)


# --- d. a training slot that is the token embedding (the seed incident) --------------------------


def _incident_data(root: Path) -> Path:
    """speculators v0.5 layout from HF forwards of the tiny-world target, storing HF
    hidden_states [0 (the embedding), 3, 5] + the pre-norm final stream: the seed incident's
    [embed, L3, L31, L59] at 8 layers. The drafter's config serves HF [2, 4, 5]."""
    dumps = load_module(WORLD / "dumps.py")
    from transformers import LlamaForCausalLM

    from hstrace.training import open_training

    target = LlamaForCausalLM.from_pretrained(WORLD / "target", dtype=torch.float32).eval()
    clean = open_training(WORLD / "training-speculators")
    samples = [clean[i] for i in range(4)]
    ids = torch.stack([s.input_ids for s in samples])
    mask = torch.stack([s.loss_mask.long() for s in samples])
    out = root / "incident"
    (out / "hidden_states").mkdir(parents=True)
    for i in range(ids.shape[0]):
        c = dumps.capture(target, ids[i])
        hs = torch.stack([c["hs"][0], c["hs"][3], c["hs"][5], c["prenorm"]], dim=1)
        save_file(
            {"token_ids": ids[i].clone(), "hidden_states": hs.to(torch.bfloat16).contiguous()},
            str(out / "hidden_states" / f"hs_{i}.safetensors"),
        )
    dumps.write_hf_dataset(out, ids, mask)
    return out


def test_embedding_slot_found_without_target(tmp_path, capsys):
    data = _incident_data(tmp_path)
    ck = str(WORLD / "drafter-speculators")  # ids [2, 4, 5], the embedding saved
    rc, doc, _ = run_check(capsys, ck, "--json", "--against", str(data))
    f = _finding(doc, "slot-layout")
    assert rc == 1 and f["severity"] == "fault"
    ev = f["evidence"]
    assert ev["embedding_slots"] == [0]
    assert ev["stored_layout"] == ["embed", "layer?", "layer?", "last (teacher)"]
    assert ev["config_hf_indices"] == [2, 4, 5] and ev["config_layer_ids"] == [2, 4, 5]
    assert ev["embedding_source"] == "the drafter checkpoint's embed_tokens"
    assert ev["slot_rel_errors"]["0"] < 1e-2 < min(ev["slot_rel_errors"][k] for k in "12")
    # the clean data: every slot is far from the embedding, no finding
    rc, doc, _ = run_check(capsys, ck, "--json", "--against", str(WORLD / "training-speculators"))
    test = doc["metrics"]["training"]["embedding_slot_test"]
    assert rc == 0 and "slot-layout" not in codes(doc)
    assert [t["slot"] for t in test["slots"]] == [0, 1, 2, "last"]
    assert all(not t["is_embedding"] and t["rel_error"] > 0.1 for t in test["slots"])
    # a SpecForge drafter has no embedding; the target's finds the same slot
    rc, doc, _ = run_check(
        capsys,
        str(WORLD / "drafter-specforge"),
        "--json",
        "--against",
        str(data),
        "--target",
        str(WORLD / "target"),
    )
    ev = _finding(doc, "slot-layout")["evidence"]
    assert (
        ev["embedding_slots"] == [0] and ev["embedding_source"] == "the target's model.embed_tokens"
    )
    assert ev["config_layer_ids"] == [1, 3, 4] and ev["config_hf_indices"] == [2, 4, 5]


# --- e. SpecForge norm_output before/after PR #879 -----------------------------------------------


def _norm_output(tmp_path: Path, value: bool) -> Path:
    ck = tmp_path / f"norm-output-{value}"
    shutil.copytree(WORLD / "drafter-specforge", ck)
    _edit_config(ck, lambda c: c.update(norm_output=value))
    return ck


def test_norm_output_is_ambiguous_without_data(tmp_path, capsys):
    ck = _norm_output(tmp_path, True)
    rc, doc, _ = run_check(capsys, str(ck), "--json")
    f = _finding(doc, "norm-flag-mismatch")
    assert rc == 0 and f["severity"] == "warning" and "#879" in f["summary"]
    ev = f["evidence"]
    assert ev["reading"] == "unknown" and ev["tested_on_training_data"] == "not run"
    assert "next step gets h (EAGLE-3)" in ev["meaning_before_pr_879"]
    assert "next step gets norm(h) (EAGLE-3.1)" in ev["meaning_after_pr_879"]
    assert "--against" in f["fix"]
    # an absent norm_output means EAGLE-3 under both readings: nothing to ask
    rc, doc, _ = run_check(capsys, str(WORLD / "drafter-specforge"), "--json")
    assert "norm-flag-mismatch" not in codes(doc)


def test_norm_output_decided_from_training_data(tmp_path, capsys):
    """The tiny-world drafter was trained feeding h back (EAGLE-3). Written as `norm_output:
    true`, only the pre-#879 reading (feed h) fits its steps >= 1; that reading is a fault for
    SGLang 0.5.23, which feeds norm(h)."""
    ck = _norm_output(tmp_path, True)
    args = ("--against", str(WORLD / "training-specforge"), "--target", str(WORLD / "target"))
    rc, doc, _ = run_check(capsys, str(ck), "--json", *args)
    res = doc["metrics"]["norm_output_resolution"]
    assert res["reading"] == "before-specforge-pr-879"
    assert res["only_right_before_pr_879"] > res["only_right_after_pr_879"]
    a = res["accuracy"]
    assert a["before-specforge-pr-879"] > a["after-specforge-pr-879"]
    f = _finding(doc, "norm-flag-mismatch")
    assert rc == 1 and f["severity"] == "fault" and f["applies_to"] == "sglang>=0.5.23, vllm"
    assert f["evidence"]["reading"] == "before-specforge-pr-879"
    rc, out, _ = run_check(capsys, str(ck), *args)
    assert "SpecForge norm_output read as: before-specforge-pr-879" in out
    # `false`: the readings differ only in the norm before lm_head, which leaves every argmax of
    # this drafter unchanged; hstrace says it cannot tell instead of picking one
    ck = _norm_output(tmp_path, False)
    rc, doc, _ = run_check(capsys, str(ck), "--json", *args)
    res = doc["metrics"]["norm_output_resolution"]
    f = _finding(doc, "norm-flag-mismatch")
    assert res["reading"] is None and f["severity"] == "warning" and rc == 0
    assert f["evidence"]["tested_on_training_data"] == res["why"] and "not enough" in res["why"]


def test_norm_output_with_data_the_drafter_cannot_take(tmp_path, capsys):
    """Training slots of another layout than the drafter's fc: the reading is not tested (no
    crash), the slot-layout fault is reported."""
    from helpers.check import specforge_data

    ck = _norm_output(tmp_path, True)
    specforge_data(tmp_path / "wide", width=40)  # fc takes 3 x 64
    args = ("--against", str(tmp_path / "wide"), "--target", str(WORLD / "target"))
    rc, doc, _ = run_check(capsys, str(ck), "--json", *args)
    assert rc == 1 and "slot-layout" in codes(doc)
    res = doc["metrics"]["norm_output_resolution"]
    assert res["reading"] is None and "do not fit" in res["why"]
    rc, out, _ = run_check(capsys, str(ck), *args)
    assert rc == 1 and "reading not tested" in out
