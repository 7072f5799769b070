"""The committed tiny world (traces/tiny-world/): artifacts load, the three training dumps agree
where they store the same layers, and the drafter reaches >= 60% held-out step-0 accuracy when
re-evaluated here with hstrace.metrics (not read from the manifest)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.worlds import differing_files, same_kernels

from hstrace.drafter import load_drafter
from hstrace.metrics import (
    TargetHead,
    accuracy_draft_space,
    accuracy_target_space,
    reference_ids,
)
from hstrace.training import open_training

WORLD = Path(__file__).resolve().parents[1] / "traces" / "tiny-world"
MANIFEST = json.loads((WORLD / "MANIFEST.json").read_text())
N_HELDOUT = MANIFEST["sizes"]["heldout_samples"]


@pytest.fixture(scope="module")
def data():
    return {
        name: open_training(WORLD / name)
        for name in ("training-speculators", "training-speculators-legacy", "training-specforge")
    }


@pytest.fixture(scope="module")
def target():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(WORLD / "target", dtype=torch.float32).eval()


def test_committed_files_match_the_manifest():
    for rel, digest in MANIFEST["files"].items():
        assert hashlib.sha256((WORLD / rel).read_bytes()).hexdigest() == digest, rel


def test_target_and_tokenizer_load(target):
    from transformers import AutoTokenizer

    assert target.config.num_hidden_layers == 8
    tok = AutoTokenizer.from_pretrained(WORLD / "target")
    ids = tok("w4 w17 w300", add_special_tokens=False)["input_ids"]
    assert ids == [4, 17, 300]
    assert tok.decode(ids) == "w4 w17 w300"


def test_readers_detect_each_format(data):
    assert {n: td.format for n, td in data.items()} == {
        "training-speculators": "speculators",
        "training-speculators-legacy": "speculators-legacy",
        "training-specforge": "specforge",
    }
    assert len({len(td) for td in data.values()}) == 1


def test_formats_agree_where_they_store_the_same_layers(data):
    spec, legacy, sf = (
        data["training-speculators"],
        data["training-speculators-legacy"],
        data["training-specforge"],
    )
    for i in range(len(spec)):
        a, b, c = spec[i], legacy[i], sf[i]
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.input_ids, c.input_ids)
        assert torch.equal(a.loss_mask, b.loss_mask) and torch.equal(a.loss_mask, c.loss_mask)
        # speculators (before-layer 2,4,5) and SpecForge (output-of-layer 1,3,4): HF hs 2,4,5
        assert torch.equal(a.aux, c.aux)
        # legacy captures after layers 2,4,5 = HF hs 3,5,6: its slot 0 is hs[3]; slot 1 is hs[5]
        assert torch.equal(b.aux[:, 1], a.aux[:, 2])
        assert not torch.equal(b.aux[:, 0], a.aux[:, 0])
        # both speculators flavours store the pre-norm final stream last; SpecForge post-norm
        assert torch.equal(a.last, b.last)
        assert (a.last_norm, b.last_norm, c.last_norm) == ("pre", "pre", "post")
    assert legacy[0].slot_layer_ids == [2, 4, 5]


def test_stored_states_are_the_target_forward(data, target):
    s = data["training-speculators"][0]
    with torch.no_grad():
        hs = target(input_ids=s.input_ids[None], output_hidden_states=True).hidden_states
    for slot, h in enumerate((2, 4, 5)):
        torch.testing.assert_close(s.aux[:, slot].float(), hs[h][0], atol=2e-2, rtol=2e-2)
    sf = data["training-specforge"][0]
    torch.testing.assert_close(sf.last.float(), hs[8][0], atol=2e-2, rtol=2e-2)


def test_library_teachers_agree_with_the_real_target(data, target):
    head = TargetHead.from_pretrained(WORLD / "target")
    for name in ("training-speculators", "training-specforge"):
        s = data[name][3]
        with torch.no_grad():
            real = target(input_ids=s.input_ids[None]).logits[0].argmax(-1)
        teacher = head.teacher_logits(s.last, s.last_norm).argmax(-1)
        assert (teacher == real).float().mean() > 0.95, name


@pytest.mark.parametrize(
    "dialect, layer_ids", [("speculators", [2, 4, 5]), ("specforge", [1, 3, 4])]
)
def test_drafter_reaches_60_percent_heldout_step0(data, target, dialect, layer_ids):
    embed = target.model.embed_tokens.weight.detach()
    model, report = load_drafter(WORLD / f"drafter-{dialect}", target_embed=embed)
    assert report.dialect == dialect and not report.unmapped
    assert model.cfg.aux_layer_ids == layer_ids
    head = TargetHead.from_pretrained(WORLD / "target")
    td = data["training-speculators"]
    total_teacher = total_target = None
    for i in range(len(td) - N_HELDOUT, len(td)):
        s = td[i]
        next_ids = torch.cat([s.input_ids[1:], s.input_ids[:1] * 0])
        with torch.no_grad():
            logits = model(next_ids, s.aux_concat.float()).logits
            real = target(input_ids=s.input_ids[None]).logits[0]
        teacher = head.teacher_logits(s.last, s.last_norm)[:, model.t2d]
        a = accuracy_draft_space(logits, teacher, s.loss_mask)
        b = accuracy_target_space(
            model.draft_to_target(logits.argmax(-1)), reference_ids(real), s.loss_mask
        )
        total_teacher = a if total_teacher is None else total_teacher + a
        total_target = b if total_target is None else total_target + b
    assert total_teacher.total == MANIFEST["heldout"]["rows"]
    assert total_teacher.value >= 0.6
    assert total_target.value >= 0.6
    # the manifest's numbers were made by the fp32 drafter; the saved one is bf16
    assert abs(total_teacher.value - MANIFEST["heldout"]["acc0_teacher"]) < 0.05


@pytest.mark.slow
def test_rebuild_reproduces_the_world(tmp_path):
    """Same torch and CPU kernels (`helpers.worlds.same_kernels`: ATen's capability and the
    finer features MKL / oneDNN dispatch on): bit-identical files (HF configs but for the
    transformers version they are stamped with). Other kernels (an AVX2 machine rebuilding an
    AVX-512 world, the reverse, or an AVX-512 host with AMX rebuilding one built without) take
    other reduction orders, so the bits differ; there the rebuild must agree numerically: same
    sizes and held-out figures within a small margin."""
    res = subprocess.run(
        [sys.executable, str(WORLD / "build.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rebuilt = json.loads((tmp_path / "MANIFEST.json").read_text())
    assert rebuilt["sizes"] == MANIFEST["sizes"]
    if same_kernels(rebuilt, MANIFEST):  # HF configs compared without their transformers stamp
        assert differing_files(tmp_path, WORLD, rebuilt["files"], MANIFEST["files"]) == []
        assert rebuilt["heldout"] == MANIFEST["heldout"]
        return
    assert rebuilt["files"].keys() == MANIFEST["files"].keys()
    for key in ("acc0_teacher", "acc0_target"):
        assert abs(rebuilt["heldout"][key] - MANIFEST["heldout"][key]) < 0.03, key
    assert (
        abs(
            rebuilt["heldout"]["sim_accept_len_with_bonus"]
            - MANIFEST["heldout"]["sim_accept_len_with_bonus"]
        )
        < 0.2
    )
