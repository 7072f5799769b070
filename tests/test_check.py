"""`hstrace check`: each static finding from a deliberately broken checkpoint, a clean one exits 0,
bad input exits 2 with one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.check import codes, run_check, specforge_data
from helpers.check import edit_config as _edit_config
from helpers.check import edit_weights as _edit_weights
from helpers.drafters import tiny_model as _model

from hstrace.drafter import save_drafter
from hstrace.findings import Finding
from hstrace.rules import applies


def test_clean_specforge_checkpoint_exits_0(tmp_path, capsys):
    save_drafter(_model(), tmp_path / "ck", dialect="specforge")
    rc, doc, _ = run_check(capsys, str(tmp_path / "ck"), "--json")
    assert rc == 0 and doc["findings"] == [] and doc["dialect"] == "specforge"
    assert doc["load_report"]["missing"] == ["embed_tokens.weight"]
    rc, out, _ = run_check(capsys, str(tmp_path / "ck"))
    assert rc == 0 and "no findings" in out


def test_unmapped_keys_and_unloaded_parameters(tmp_path, capsys):
    ck = tmp_path / "ck"
    save_drafter(_model(), ck, dialect="specforge")
    _edit_weights(
        ck, lambda sd: {k.replace("midlayer.", "transformer.h.0."): v for k, v in sd.items()}
    )
    rc, doc, _ = run_check(capsys, str(ck), "--json")
    assert rc == 1
    dropped = [f for f in doc["findings"] if f["code"] == "weights-dropped"]
    assert "transformer.h.0.self_attn.q_proj.weight" in dropped[0]["evidence"]["unmapped_keys"]
    assert "layers.0.self_attn.q_proj.weight" in dropped[1]["evidence"]["parameters_not_loaded"]


def test_layers0_prefix_applies_to_old_sglang_only(tmp_path, capsys):
    ck = tmp_path / "ck"
    save_drafter(_model(), ck, dialect="speculators")
    rc, doc, _ = run_check(capsys, str(ck), "--json", "--sglang-version", "0.5.11")
    f = [f for f in doc["findings"] if f["code"] == "weights-dropped"]
    assert rc == 1 and f[0]["applies_to"] == "sglang<0.5.12"
    rc, doc, _ = run_check(capsys, str(ck), "--json", "--sglang-version", "0.5.12")
    assert "weights-dropped" not in codes(doc)


def test_d2t_direct_table(tmp_path, capsys):
    ck = tmp_path / "ck"
    m = _model()
    save_drafter(m, ck, dialect="specforge")
    direct = m.d2t + torch.arange(61)  # absolute target ids stored where offsets belong
    _edit_weights(ck, lambda sd: {**sd, "d2t": direct})
    rc, doc, _ = run_check(capsys, str(ck), "--json")
    assert rc == 1 and codes(doc) == ["d2t-direct-table"]
    ev = doc["findings"][0]["evidence"]
    assert ev["offset_target_max"] >= 97 and ev["d2t_equals_t2d_ids"] is True


def test_vocab_map_missing_and_zero(tmp_path, capsys):
    ck = tmp_path / "ck"
    save_drafter(_model(), ck, dialect="specforge")
    _edit_weights(ck, lambda sd: {k: v for k, v in sd.items() if k not in ("d2t", "t2d")})
    rc, doc, _ = run_check(capsys, str(ck), "--json")
    assert rc == 1 and codes(doc) == ["vocab-map-missing"]
    _edit_weights(ck, lambda sd: {**sd, "d2t": torch.zeros(61, dtype=torch.long)})
    rc, doc, _ = run_check(capsys, str(ck), "--json")
    assert codes(doc) == ["vocab-map-missing"] and "all zeros" in doc["findings"][0]["summary"]


def test_flags_the_engine_ignores_with_versions(tmp_path, capsys):
    ck = tmp_path / "ck"
    save_drafter(
        _model(norm_before_fc=True, norm_before_residual=True, sliding_window=8),
        ck,
        dialect="speculators",
    )
    rc, doc, _ = run_check(capsys, str(ck), "--json", "--all-versions")
    by = {(f["code"], f["applies_to"]) for f in doc["findings"]}
    assert ("norm-flag-mismatch", "sglang<0.5.17") in by
    assert ("norm-flag-mismatch", "sglang<=0.5.23") in by
    assert ("attention-window", "sglang<=0.5.23") in by
    rc, doc, _ = run_check(capsys, str(ck), "--json", "--sglang-version", "0.5.17")
    assert not any(f["applies_to"] == "sglang<0.5.17" for f in doc["findings"])
    assert doc["judged_for"] == "sglang==0.5.17" and doc["findings_for_other_versions"] >= 1
    # By default: judged for the engines that can load the checkpoint as it is. SGLang cannot
    # load a speculators layout without conversion: said once, and judged for vLLM only.
    rc, doc, _ = run_check(capsys, str(ck), "--json")
    assert doc["judged_for"] == "vllm==0.33.0"
    assert list(doc["not_loadable"]) == ["sglang"]
    assert "speculators" in doc["not_loadable"]["sglang"]
    assert "Eagle3DraftModel" in doc["not_loadable"]["sglang"]
    assert all(f["engines"] == ["vllm"] for f in doc["findings"])
    assert ("norm-flag-mismatch", "sglang<=0.5.23") not in {
        (f["code"], f["applies_to"]) for f in doc["findings"]
    }
    # --engine sglang: judged for the pinned SGLang (none is installed in this environment)
    rc, doc, _ = run_check(capsys, str(ck), "--json", "--engine", "sglang")
    assert doc["judged_for"] == "sglang==0.5.23"
    assert ("norm-flag-mismatch", "sglang<=0.5.23") in {
        (f["code"], f["applies_to"]) for f in doc["findings"]
    }
    assert ("norm-flag-mismatch", "sglang<0.5.17") not in {
        (f["code"], f["applies_to"]) for f in doc["findings"]
    }


def test_specforge_norm_output_meaning_and_missing_draft_vocab(tmp_path, capsys):
    ck = tmp_path / "ck"
    save_drafter(_model(), ck, dialect="specforge")
    _edit_config(
        ck, lambda c: c.update(norm_output=True) or c.pop("draft_vocab_size")
    )  # an Eagle 3.1 config
    _edit_weights(
        ck, lambda sd: {k: v for k, v in sd.items() if k not in ("lm_head.weight", "d2t", "t2d")}
    )
    rc, doc, _ = run_check(capsys, str(ck), "--json")
    got = codes(doc)
    assert "norm-flag-mismatch" in got and "embed-head-source" in got


def test_eagle_rope_theta(tmp_path, capsys):
    ck = tmp_path / "ck"
    save_drafter(_model(), ck, dialect="eagle")
    _edit_config(ck, lambda c: c.update(rope_theta=500000.0))
    rc, doc, _ = run_check(capsys, str(ck), "--json")
    assert rc == 1 and codes(doc) == ["rope-mismatch"]


def test_slot_layout_from_config(tmp_path, capsys):
    ck = tmp_path / "ck"
    save_drafter(_model(aux_layer_ids=[2, 16, 29]), ck, dialect="speculators")
    _edit_config(
        ck, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 2, 16, 29])
    )  # embedding slot claimed
    rc, doc, _ = run_check(capsys, str(ck), "--json", "--sglang-version", "0.5.23")
    # speculators writes the ids at the top level; SGLang 0.5.23 cannot load that layout
    # without conversion, so no aux-layers-default about ids it would never read: said once
    assert rc == 1 and codes(doc) == ["slot-layout"]
    assert doc["findings"][0]["evidence"]["aux_layer_ids"] == [0, 2, 16, 29]
    assert doc["judged_for"] == "sglang==0.5.23" and list(doc["not_loadable"]) == ["sglang"]
    assert "cannot load a speculators-format drafter" in doc["not_loadable"]["sglang"]
    # the text output says it once
    rc, out, _ = run_check(capsys, str(ck), "--sglang-version", "0.5.23")
    assert rc == 1 and out.count("not loadable by sglang as it is") == 1
    assert "aux-layers-default" not in out


@pytest.mark.parametrize(
    "breakage",
    ["missing", "not-json", "corrupt-weights", "shape"],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, breakage):
    ck = tmp_path / "ck"
    save_drafter(_model(), ck, dialect="speculators")
    if breakage == "missing":
        ck = tmp_path / "nothing"
    elif breakage == "not-json":
        (ck / "config.json").write_text("{")
    elif breakage == "corrupt-weights":
        (ck / "model.safetensors").write_bytes(b"garbage")
    else:
        _edit_config(ck, lambda c: c["transformer_layer_config"].update(hidden_size=40))
    rc, _, err = run_check(capsys, str(ck), "--json")
    assert rc == 2
    assert err.startswith("hstrace: error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_applies_to_parser():
    f = Finding("norm-flag-mismatch", "x", applies_to="sglang>=0.5.23, vllm")
    assert (
        applies(f, "sglang", "0.5.23")
        and not applies(f, "sglang", "0.5.22")
        and applies(f, "vllm", "0.11")
    )
    assert applies(Finding("rope-mismatch", "x"), "sglang", "0.4.0")


def test_against_training_data(tmp_path, capsys):
    ck = tmp_path / "ck"
    save_drafter(_model(), ck, dialect="specforge", include_embed=True)
    specforge_data(tmp_path / "ok", width=32)
    rc, doc, _ = run_check(capsys, str(ck), "--json", "--against", str(tmp_path / "ok"))
    train = doc["metrics"]["training"]
    assert rc == 0 and train["format"] == "specforge" and train["steps"] == 3
    assert "acc0_teacher" not in train and "--target" in train["teacher"]  # no target given
    acc0, pp, al = train["acc0_data"], train["per_position"], train["accept_len"]
    assert acc0["total"] == 2 * (10 - 2) and acc0["convention"] and "t+2" in acc0["convention"]
    assert len(pp["uncond"]) == len(pp["full"]) == 3 and "stored token" in pp["reference"]
    # without a target the chain is scored against the stored tokens: step 0 is acc0_data
    assert pp["full"][0] == pytest.approx(acc0["value"]) == pytest.approx(pp["uncond"][0])
    assert all(b <= a + 1e-12 for a, b in zip(pp["full"], pp["full"][1:], strict=False))
    assert al["bonus_counted"] is True and "bonus" in al["convention"]
    assert al["value"] == pytest.approx(1 + sum(pp["full"]))
    assert al["value_without_bonus"] == pytest.approx(al["value"] - 1)
    specforge_data(tmp_path / "wide", width=40)
    rc, doc, _ = run_check(capsys, str(ck), "--json", "--against", str(tmp_path / "wide"))
    assert rc == 1 and codes(doc) == ["slot-layout"]
    assert doc["findings"][0]["evidence"]["stored_width"] == 40


def test_against_without_embedding_says_how(tmp_path, capsys):
    ck = tmp_path / "ck"
    save_drafter(_model(), ck, dialect="specforge")  # SpecForge saves no embedding
    specforge_data(tmp_path / "ok", width=32)
    rc, doc, _ = run_check(capsys, str(ck), "--json", "--against", str(tmp_path / "ok"))
    assert rc == 0 and "--target" in doc["metrics"]["training"]["skipped"]
    rc, out, _ = run_check(capsys, str(ck), "--against", str(tmp_path / "ok"))
    assert rc == 0 and "metrics skipped" in out and "--target" in out


def test_against_bad_target_exits_2(tmp_path, capsys):
    ck = tmp_path / "ck"
    save_drafter(_model(), ck, dialect="specforge")
    specforge_data(tmp_path / "ok", width=32)
    (tmp_path / "tgt").mkdir()
    rc, _, err = run_check(
        capsys, str(ck), "--against", str(tmp_path / "ok"), "--target", str(tmp_path / "tgt")
    )
    assert rc == 2 and err.startswith("hstrace: error: ") and err.count("\n") == 1


WORLD = Path(__file__).resolve().parents[1] / "traces" / "tiny-world"


def _world_check(capsys, dialect: str, fmt: str, *extra: str):
    return run_check(
        capsys,
        str(WORLD / f"drafter-{dialect}"),
        "--against",
        str(WORLD / f"training-{fmt}"),
        "--target",
        str(WORLD / "target"),
        "--sglang-version",
        "0.5.23",
        *extra,
    )


@pytest.mark.slow
def test_tiny_world_dialects_and_formats_agree(capsys):
    if not (WORLD / "MANIFEST.json").is_file():
        pytest.skip("the tiny world is not built (python traces/tiny-world/build.py)")
    acc: dict[tuple[str, str], dict] = {}
    for dialect in ("speculators", "specforge"):
        for fmt in ("speculators", "speculators-legacy", "specforge"):
            rc, doc, _ = _world_check(capsys, dialect, fmt, "--json")
            train = doc["metrics"]["training"]
            assert rc == 0 and train["format"] == fmt, (dialect, fmt, doc["findings"])
            acc[dialect, fmt] = train
            for name in ("acc0_teacher", "acc0_target", "acc0_data"):
                assert train[name]["value"] >= 0.6, (dialect, fmt, name, train[name])
            if fmt == "speculators-legacy":  # its datagen stores the outputs of layers 2,4,5
                f = [f for f in doc["findings"] if f["code"] == "slot-layout"]
                assert f and f[0]["evidence"]["stored_hf_indices"] == [3, 5, 6]
                assert f[0]["evidence"]["config_hf_indices"] == [2, 4, 5]
            else:
                assert doc["findings"] == [], (dialect, fmt)
    # the same physical slots (HF 2,4,5) in two formats, the same bf16 weights in two dialects:
    # identical step-0 accuracy, up to the formats' own storage precision (both bf16 here)
    same = [
        acc[d, f]["acc0_teacher"]["value"]
        for d in ("speculators", "specforge")
        for f in ("speculators", "specforge")
    ]
    assert max(same) - min(same) <= 0.01, same
    same_t = [
        acc[d, f]["acc0_target"]["value"]
        for d in ("speculators", "specforge")
        for f in ("speculators", "specforge")
    ]
    assert max(same_t) - min(same_t) <= 0.01, same_t
    # the dialects load the same drafter: exactly the same numbers on the same data
    for f in ("speculators", "speculators-legacy", "specforge"):
        assert acc["speculators", f]["per_position"] == acc["specforge", f]["per_position"]


@pytest.mark.slow
def test_tiny_world_rich_output_reads(capsys, monkeypatch):
    if not (WORLD / "MANIFEST.json").is_file():
        pytest.skip("the tiny world is not built (python traces/tiny-world/build.py)")
    monkeypatch.setenv("COLUMNS", "240")  # one line per row, so the text can be matched
    rc, out, _ = _world_check(capsys, "specforge", "specforge")
    assert rc == 0 and "no findings" in out
    for text in ("acc0_teacher", "acc0_target", "acc0_data", "per-position full", "accept_len"):
        assert text in out
    assert "bonus token counted" in out and "speculators full_acc_0" in out
    assert "loss_mask[t+1]" in out  # brackets survive rich markup
