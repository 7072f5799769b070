"""`target-drift` judged against the target's own precision gap (issue 11 item 8).

A DeepSeek-V3-style MoE target served in bf16 moves its hidden states away from its fp32 self
through routing flips alone; training data generated in fp32 then sits at cos 0.996-0.9993 from
the serving capture (the host's kernels decide how many routings flip) although nothing is
miswired. Replay runs the reference target in fp32 and in the
serving dtype on the same rows and calls drift only when a side is clearly further from fp32
than the target's own bf16 run is.

The world: the second world's DeepSeek-V3 target (traces/second-world/target) with near-tied
router logits (every routed expert's gate row the mean row plus 1e-5 of its own deviation, no
score-correction bias) and routed experts' outputs x10, so bf16 flips many routings (the stored
target flips 9 of 4800: cos >= 0.99998, routing_drift.py); training data regenerated from that
target in fp32 in speculators' layout; serving recorded in bf16 through the second world's
third-party producer (public TraceWriter only). The drift case serves the stored target with its
weights perturbed (another checkpoint) against the stored training data: the same serving cosines
as the tied target's bf16 noise, and drift there, because that target barely moves in bf16.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers.second_world import producer

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
WORLD = ROOT / "traces" / "second-world"
SERVED = [16, 17, 18, 19]
AUX = [2, 3, 4]  # HF hidden_states indices the speculators drafter was trained on


def _target(out: Path, tied: bool, perturb: float = 0.0) -> Path:
    from transformers import DeepseekV3ForCausalLM

    m = DeepseekV3ForCausalLM.from_pretrained(WORLD / "target", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(20261211)
    with torch.no_grad():
        for layer in m.model.layers if tied else []:
            if hasattr(layer.mlp, "gate"):
                w = layer.mlp.gate.weight
                mean = w.mean(0, keepdim=True)
                w.copy_(mean + 1e-5 * (w - mean))
                layer.mlp.gate.e_score_correction_bias.zero_()
                layer.mlp.experts.down_proj.mul_(10.0)
        if perturb:  # another checkpoint: every decoder weight moved by `perturb` of its scale
            for p in m.model.layers.parameters():
                p.add_(perturb * p.std() * torch.randn(p.shape, generator=g))
    m.save_pretrained(out)
    return out


@torch.no_grad()
def _training(out: Path, target_dir: Path) -> Path:
    """speculators v0.5+ layout from the given target in fp32: HF [2, 3, 4] + the pre-norm
    final state (as the stored training-speculators, ids [2, 3, 4, 7])."""
    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM

    from hstrace.training import open_training

    src = WORLD / "training-speculators"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("hidden_states"))
    (out / "hidden_states").mkdir()
    m = DeepseekV3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    td = open_training(src)
    for i in range(len(td)):
        ids = td[i].input_ids.long()
        pre: list[torch.Tensor] = []
        hook = m.model.norm.register_forward_pre_hook(lambda _m, a, pre=pre: pre.append(a[0]))
        try:
            hs = m(ids[None], output_hidden_states=True).hidden_states
        finally:
            hook.remove()
        states = torch.stack([hs[k][0] for k in AUX] + [pre[0][0]], dim=1)
        save_file(
            {"token_ids": ids.clone(), "hidden_states": states.to(torch.bfloat16).contiguous()},
            str(out / "hidden_states" / f"hs_{i}.safetensors"),
        )
    return out


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    pytest.importorskip("speculators.models.eagle3", reason="the producer serves speculators")
    from hstrace.training import open_training

    d = tmp_path_factory.mktemp("tied")
    target = _target(d / "target", tied=True)
    training = _training(d / "training", target)
    td = open_training(training)
    prompts = [td[i].input_ids.tolist() for i in SERVED]
    return target, training, prompts, d


def _replay(trace: Path, training: Path, target: Path) -> dict:
    from hstrace import replay_trace

    return replay_trace(trace, training, target_path=target).to_json()


def _redacted(trace: Path, out: Path) -> Path:
    from hstrace.bundle import BundleOptions, make_bundle

    make_bundle(trace, out, BundleOptions(redact=("hidden",)))
    return out


def _codes(doc: dict) -> list[str]:
    return [f["code"] for f in doc["findings"]]


def test_bf16_routing_flips_are_not_drift(tied):
    """Served in bf16, the near-tied MoE is at cos 0.996-0.9993 from the fp32 training data on
    every aux slot (how many routings bf16 flips depends on the host's kernels: ~0.996 where
    this was written, 0.9990-0.9992 on an AVX-512 host with AMX), as far as the old fixed
    0.999 or further: the target's own bf16 run is as far, so no drift."""
    target, training, prompts, d = tied
    trace = producer().record(
        d / "clean.zarr", target, WORLD / "drafter-speculators", prompts, layers=AUX
    )
    doc = _replay(trace, training, target)
    fp = doc["fingerprints"]
    # layer identification still works on the drifting numbers
    assert fp["serving_layers"]["layer"] == AUX == fp["training_layers"]["layer"]
    serving_cos = fp["serving_layers"]["cos"]
    # the scenario is what it claims: bf16 moves this target well away from its fp32 self
    # (the stored, untied target stays at cos >= 0.99998), into the band the old fixed 0.999
    # judged by
    assert max(serving_cos) < 0.9995, serving_cos
    assert min(serving_cos) > 0.99, serving_cos
    assert "target-drift" not in _codes(doc), doc["findings"]
    assert not [f for f in doc["findings"] if f.get("stage") == "target-capture"], doc["findings"]
    # a `--redact hidden` bundle: judged from the per-slot sketches, the same answer
    doc = _replay(_redacted(trace, d / "clean.h.zip"), training, target)
    assert not [f for f in doc["findings"] if f.get("stage") == "target-capture"], doc["findings"]


def test_same_cosines_from_another_checkpoint_are_drift(tied, tmp_path):
    """The stored DeepSeek-V3 target (its own bf16 run: cos >= 0.99998 from fp32) served as
    another checkpoint (every decoder weight moved by 12% of its scale) in bf16, against its own
    fp32 training data: the serving slots sit in the same 0.99-0.999 band as the tied target's
    bf16 noise above, and here that is drift, named per slot with both cosines."""
    _, _, prompts, _ = tied
    other = _target(tmp_path / "other", tied=False, perturb=0.12)
    trace = producer().record(
        tmp_path / "drift.zarr", other, WORLD / "drafter-speculators", prompts, layers=AUX
    )
    doc = _replay(trace, WORLD / "training-speculators", WORLD / "target")
    drift = [f for f in doc["findings"] if f["code"] == "target-drift"]
    assert drift, doc["findings"]
    ev = drift[0]["evidence"]
    assert ev["serving_layers"] == AUX == ev["training_layers"]
    assert ev["drifted"] == "serving" and ev["serving_drift_slots"] == [0, 1, 2], ev
    assert ev["training_drift_slots"] == []
    assert ev["serving_dtype"] == "bfloat16"
    assert all(0.99 < c < 0.999 for c in ev["serving_vs_fp32_cos"]), ev
    assert min(ev["target_own_cos"]) > 0.9999, ev  # this target barely moves in bf16
    assert min(ev["training_vs_fp32_cos"]) > 0.9999, ev
    for i in ev["serving_drift_slots"]:
        assert ev["serving_vs_fp32_cos"][i] < ev["drift_below_cos"][i] < ev["target_own_cos"][i]
    i = ev["serving_drift_slots"][0]
    s = drift[0]["summary"]
    assert f"serving cos {ev['serving_vs_fp32_cos'][i]:.5f}" in s, s
    assert f"own bfloat16-vs-fp32 cos {ev['target_own_cos'][i]:.5f} on the same rows" in s, s
    doc = _replay(
        _redacted(trace, tmp_path / "drift.h.zip"), WORLD / "training-speculators", WORLD / "target"
    )
    ev = next(f for f in doc["findings"] if f["code"] == "target-drift")["evidence"]
    assert ev["serving_drift_slots"] == [0, 1, 2] and ev["drifted"] == "serving", ev
    assert ev["fingerprinted_from"].startswith("per-slot sketches"), ev
