"""Cross-check against the real speculators 0.9.0 `Eagle3DraftModel` on the same weights:
hstrace saves the checkpoint in the speculators dialect, speculators builds its model from that
config.json, and both run TTT in fp32. Logits must agree to 1e-5 on every valid row of every step."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from helpers.drafters import randomized, tiny_cfg
from safetensors.torch import load_file

from hstrace.drafter import Eagle3Drafter, load_drafter, save_drafter

eagle3 = pytest.importorskip(
    "speculators.models.eagle3", reason="speculators==0.9.0 (scripts/test.sh installs it)"
)


def _speculators_logits(ckpt, aux, ids, steps):
    cfg_dict = json.loads((ckpt / "config.json").read_text())
    cfg_dict["transformer_layer_config"]["_attn_implementation"] = "eager"
    config = eagle3.Eagle3SpeculatorConfig(
        **{k: v for k, v in cfg_dict.items() if k != "torch_dtype"}
    )
    config.transformer_layer_config._attn_implementation = "eager"
    model = eagle3.Eagle3DraftModel(config).float().eval()
    missing, unexpected = model.load_state_dict(
        load_file(str(ckpt / "model.safetensors")), strict=False
    )
    assert unexpected == []
    assert set(missing) <= {"verifier_norm.weight", "verifier_lm_head.weight"}, missing
    captured = []
    model.lm_head.register_forward_hook(lambda mod, inp, out: captured.append(out.detach()))
    T = ids.shape[0]
    with torch.no_grad():
        model(
            hidden_states=aux[None],
            input_ids=ids[None],
            document_ids=torch.zeros(1, T, dtype=torch.long),
            ttt_steps=steps,
        )
    return [c[0] for c in captured]


FLAGS = [
    dict(norm_before_residual=r, norm_before_fc=f, feed_normed=o)
    for r, f, o in itertools.product([False, True], repeat=3)
]
FLAGS += [
    dict(fc_norm=True, feed_normed=True),
    dict(qk_norm=True, norm_before_residual=True),
    dict(sliding_window=3, num_hidden_layers=2),
]


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_logits_match_speculators(tmp_path, flags):
    torch.manual_seed(0)
    ours = randomized(Eagle3Drafter(tiny_cfg(**flags)), seed=11)
    save_drafter(ours, tmp_path / "ck", dialect="speculators")
    ours, report = load_drafter(tmp_path / "ck")  # and through our own loader
    assert report.missing == [] and report.unmapped == []
    T, steps = 12, 4
    ids = torch.randint(0, 97, (T,))
    aux = torch.randn(T, 96)
    theirs = _speculators_logits(tmp_path / "ck", aux, ids, steps)
    mine = ours.ttt(
        ids, aux, steps=steps, positions=torch.arange(T) + 1
    )  # speculators positions start at 1
    assert len(theirs) == steps
    for k in range(steps):
        diff = (theirs[k][: T - k] - mine[k].logits[: T - k].detach()).abs().max().item()
        assert diff <= 1e-5, f"step {k}: max abs diff {diff}"
    # and a flipped flag would have been caught
    if "norm_before_residual" in flags:
        flipped = randomized(
            Eagle3Drafter(
                tiny_cfg(**{**flags, "norm_before_residual": not flags["norm_before_residual"]})
            ),
            seed=11,
        )
        assert (
            flipped.ttt(ids, aux, steps=1, positions=torch.arange(T) + 1)[0].logits - theirs[0]
        ).abs().max() > 1e-3
