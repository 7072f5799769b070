"""The committed MTP world (traces/mtp-world/) and the reference MTP head: the files match the
manifest, the training dump reads through `open_training`, the head inside the target loads
from `model.mtp_layers.0.*` with every key mapped, and it predicts the target's own next-next
token on held-out samples (re-evaluated here, not read from the manifest). The wiring knobs of
`MTPConfig` (concat order, hidden source) each change what the head predicts."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch

from hstrace.drafter.mtp import HIDDEN_FIRST, MTP_KEYS, MTPHead
from hstrace.drafter.mtp_checkpoint import load_mtp_head
from hstrace.training import open_training

WORLD = Path(__file__).resolve().parents[1] / "traces" / "mtp-world"
MANIFEST = json.loads((WORLD / "MANIFEST.json").read_text())
N_HELDOUT = MANIFEST["sizes"]["heldout_samples"]


@pytest.fixture(scope="module")
def loaded():
    return load_mtp_head(WORLD / "target")


@pytest.fixture(scope="module")
def target():
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.from_pretrained(WORLD / "target", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def heldout(target):
    """(ids for row t = token t+1, fed hidden t, the target's greedy token at t+1, rows)."""
    td = open_training(WORLD / "training")
    samples = [td[i] for i in range(len(td) - N_HELDOUT, len(td))]
    ids = torch.stack([s.input_ids for s in samples])
    with torch.no_grad():
        greedy = target(input_ids=ids).logits.argmax(-1)
    hidden = torch.stack([s.last for s in samples]).float()
    mask = torch.stack([s.loss_mask for s in samples])
    rows = torch.cat([mask[:, 2:], mask.new_zeros(len(samples), 1)], 1)
    return ids[:, 1:], hidden[:, :-1], greedy[:, 1:], rows, ids


def test_committed_files_match_the_manifest():
    for rel, digest in MANIFEST["files"].items():
        assert hashlib.sha256((WORLD / rel).read_bytes()).hexdigest() == digest, rel


def test_target_config_is_vllms_mimo_layout():
    cfg = json.loads((WORLD / "target" / "config.json").read_text())
    assert cfg["architectures"] == ["MiMoForCausalLM"]
    assert cfg["num_nextn_predict_layers"] == 1
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 32  # vLLM CPU attention


def test_training_dump_reads_as_the_state_the_head_was_fed():
    td = open_training(WORLD / "training")
    assert td.format == "hstrace-mtp" and len(td) == MANIFEST["sizes"]["samples"]
    s = td[0]
    assert s.aux.shape == (MANIFEST["sizes"]["seq_len"], 1, MANIFEST["sizes"]["hidden"])
    assert s.aux.dtype == torch.bfloat16 and torch.equal(s.aux[:, 0], s.last)
    assert s.last_norm == "pre" and s.provenance["hidden_source"] == "pre_final_norm"
    assert s.loss_mask.any() and not s.loss_mask.all()


def test_training_hidden_is_the_targets_pre_norm_last_state(target):
    """The dump holds the last layer's residual stream before the final norm (what vLLM's
    MiMoModel hands the proposer), not HF's post-norm hidden_states[-1]."""
    s = open_training(WORLD / "training")[1]
    with torch.no_grad():
        hs = target(input_ids=s.input_ids[None], output_hidden_states=True).hidden_states
    post = hs[-1][0]
    pre = s.last.float()
    assert torch.allclose(target.model.norm(pre), post, atol=3e-2, rtol=3e-2)
    assert not torch.allclose(pre, post, atol=3e-2, rtol=3e-2)


def test_every_mtp_key_fills_a_head_parameter(loaded):
    head, report = loaded
    assert report.layout == "mimo" and report.n_predict == 1
    assert report.layer_prefixes == ["model.mtp_layers.0."]
    assert report.unmapped == [] and report.missing == [] and report.scales == []
    for key, role in MTP_KEYS["mimo"].items():
        assert report.key_map[f"model.mtp_layers.0.{key}"] == f"layers.0.{role}"
    assert report.key_map["model.mtp_layers.0.self_attn.q_proj.bias"] == (
        "layers.0.self_attn.q_proj.bias"
    )
    assert (report.embed_source, report.head_source) == (
        "model.embed_tokens.weight",
        "lm_head.weight",
    )
    assert head.cfg.concat_order == HIDDEN_FIRST and head.cfg.feed_normed


def test_head_predicts_the_targets_next_next_token(loaded, heldout):
    head, _ = loaded
    ids, hidden, want, rows, _ = heldout
    with torch.no_grad():
        got = head(ids, hidden).logits.argmax(-1)
    acc = float((got == want)[rows].float().mean())
    assert acc >= 0.75, acc
    assert acc == pytest.approx(MANIFEST["heldout"]["acc0"], abs=1e-6)


@pytest.mark.parametrize(
    "change",
    [
        {"concat_order": "embed_first"},  # the halves of eh_proj swapped (a converter bug)
        {"zero_embed_at_position0": False},
    ],
)
def test_wiring_knobs_change_the_prediction(loaded, heldout, change):
    head, _ = loaded
    ids, hidden, want, rows, _ = heldout
    other = MTPHead(dataclasses.replace(head.cfg, **change)).eval()
    other.load_state_dict(head.state_dict())
    with torch.no_grad():
        a, b = head(ids, hidden).logits, other(ids, hidden).logits
    if "concat_order" in change:
        acc = float((b.argmax(-1) == want)[rows].float().mean())
        assert acc < 0.5, acc  # swapped halves: the head no longer predicts
    else:  # only position 0 differs; attention carries it to later rows
        assert torch.equal(a[:, 0].argmax(-1), a[:, 0].argmax(-1))
        assert not torch.allclose(a[:, 0], b[:, 0])


def test_head_reads_the_hidden_but_not_which_layer_it_came_from(loaded, heldout, target):
    """The head uses the fed state (another sample's states cost most of its accuracy), but in
    this world accuracy cannot tell the trained pre-norm state from the post-norm one or from
    the layer before: `hnorm` is an RMSNorm (scale-invariant) and every late layer encodes
    token t, which is what the language's rule needs. `mtp-hidden-source` must be decided
    from the states themselves (fingerprints), not from accuracy. Measured, all printed."""
    head, _ = loaded
    ids, hidden, want, rows, full = heldout
    with torch.no_grad():
        earlier = target(input_ids=full, output_hidden_states=True).hidden_states[-2][:, :-1]
        accs = {
            name: float((head(ids, h).logits.argmax(-1) == want)[rows].float().mean())
            for name, h in (
                ("trained (pre-norm)", hidden),
                ("post-norm", target.model.norm(hidden)),
                ("layer L-1", earlier),
                ("another sample's", hidden.roll(1, 0)),
            )
        }
    print(accs)
    assert accs["another sample's"] < accs["trained (pre-norm)"] - 0.2, accs
    for name in ("post-norm", "layer L-1"):
        assert abs(accs[name] - accs["trained (pre-norm)"]) < 0.05, accs


def test_serving_chain_depth0_equals_the_forward_and_depth1_reuses_layer0(loaded, heldout):
    head, _ = loaded
    ids, hidden, want, rows, _ = heldout
    with torch.no_grad():
        drafts, logits = head.draft_chain(ids, hidden, steps=2)
        out = head(ids, hidden)
        step = head.step(drafts[..., 0], out.hidden, out.cache, layer=0)
    assert torch.equal(logits[0], out.logits)
    assert torch.equal(logits[1], step.logits)
    # depth 1 predicts the target's token after depth 0's (a useful second draft)
    want1 = torch.cat([want[:, 1:], want[:, -1:]], 1)
    both = rows & torch.cat([rows[:, 1:], rows[:, -1:] & False], 1)
    acc1 = float(((drafts[..., 0] == want) & (drafts[..., 1] == want1))[both].float().mean())
    assert acc1 == pytest.approx(MANIFEST["heldout"]["chain_acc_depth1"], abs=1e-6)
    assert acc1 >= 0.5
