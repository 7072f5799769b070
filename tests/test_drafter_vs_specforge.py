"""Cross-check against the real SpecForge 0.2.0 model on the same weights: hstrace saves the drafter
in the specforge dialect; SpecForge reads that config.json (`load_draft_config_source`), builds
`LlamaForCausalLMEagle3` (`AutoDraftModel.from_config`, attention backend "sdpa", which with a TTT
cache is SpecForge's explicit eager attention), warm-starts it from the checkpoint
(`warm_start_draft_model`), takes the embedding from a target dir (`load_embedding`), and runs
`OnlineEagle3Model.forward` (TTT, teacher forcing) in fp32. Every step's logits (captured at
`lm_head`) must agree with `Eagle3Drafter.ttt` to 1e-5 on every valid row, with `fc_norm` on and
off and `norm_output` (SpecForge: norm before lm_head) absent, true and false. SpecForge's own
per-step accuracy must equal `hstrace.metrics.accuracy_target_space` on the same rows.

The one fake: `FakeCudaLogSoftmaxLoss`. SpecForge's loss is a Triton (CUDA-only) kernel; the fake
calls SpecForge's own torch reference `_compute_loss` instead. A stand-in `triton` module
(`FakeCudaTriton`) exists only while `specforge.core.loss` is imported, so that its `@triton.jit`
decorators load; it is removed from `sys.modules` right after. Logits, the thing compared, never
pass through either fake. `torch.compile`d SpecForge functions run eagerly
(`torch.compiler.set_stance("force_eager")`): same math, no C++ toolchain needed.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from helpers.drafters import randomized, tiny_cfg
from safetensors.torch import save_file

from hstrace import metrics
from hstrace.drafter import Eagle3Drafter, load_drafter, save_drafter

sf = pytest.importorskip(
    "helpers.specforge",
    reason="specforge==0.2.0 not importable (scripts/test.sh installs it --no-deps)",
)


@pytest.fixture(autouse=True)
def _no_triton_kernels(monkeypatch):
    monkeypatch.setattr(sf.sf_model, "LogSoftmaxLoss", sf.FakeCudaLogSoftmaxLoss)


CASES = [
    dict(fc_norm=fc_norm, norm_output=norm_output)
    for fc_norm, norm_output in itertools.product([False, True], [None, True, False])
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"fc_norm={c['fc_norm']},norm_output={c['norm_output']}"
)
def test_logits_match_specforge(tmp_path, case):
    torch.manual_seed(0)
    norm_output = case["norm_output"]
    cfg = tiny_cfg(
        fc_norm=case["fc_norm"],
        logits_use_norm=norm_output is not False,
        target_hidden_size=40,  # aux slots wider than the drafter, as with real targets
    )
    built = randomized(Eagle3Drafter(cfg), seed=11)
    used = torch.sort(torch.randperm(97, generator=torch.Generator().manual_seed(3))[:61]).values
    built.d2t.copy_(used - torch.arange(61))
    built.t2d.zero_()
    built.t2d[used] = True
    ck, target_dir = tmp_path / "ck", tmp_path / "target"
    save_drafter(built, ck, dialect="specforge")
    if norm_output is not None:  # written explicitly, as Eagle 3.1 configs do
        c = json.loads((ck / "config.json").read_text())
        c["norm_output"] = norm_output
        (ck / "config.json").write_text(json.dumps(c))
    target_dir.mkdir()
    save_file(
        {"model.embed_tokens.weight": built.embed_tokens.weight.detach().clone()},
        str(target_dir / "model.safetensors"),
    )
    # ours goes through our own loader too (SpecForge saves no embedding: the target's)
    ours, report = load_drafter(ck, target_embed=built.embed_tokens.weight.detach())
    assert report.dialect == "specforge" and report.unmapped == []
    assert ours.cfg.logits_use_norm is (norm_output is not False)
    theirs_model = sf.specforge_model(ck, target_dir)
    assert theirs_model.norm_output is (norm_output is not False)

    T, steps = 12, 5
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 97, (T,), generator=g)
    aux = torch.randn(T, 3 * 40, generator=g)
    # per-position target logits (position p scores the token at p+1), and a loss mask with holes
    target_logits = torch.randn(T + 1, 97, generator=g)
    mask = torch.rand(T + 1, generator=g) > 0.2
    theirs, sf_acc = sf.run_specforge(
        theirs_model, aux, ids, target_logits[1:], mask[1:], steps
    )  # rows in our convention: row t -> target and mask of position t+1
    mine = ours.ttt(ids, aux, steps=steps)
    assert len(theirs) == steps
    for k in range(steps):
        diff = (theirs[k][: T - k] - mine[k].logits[: T - k].detach()).abs().max().item()
        assert diff <= 1e-5, f"step {k}: max abs diff {diff}"

    # SpecForge's accuracy (full-vocab teacher argmax, unconditional) is our target-space one
    ref_rows = target_logits.shape[0]
    for k in range(steps):
        pred = torch.full((ref_rows,), -1, dtype=torch.long)
        pred[: T - k] = ours.draft_to_target(mine[k].logits[: T - k].argmax(-1))
        acc = metrics.accuracy_target_space(pred, metrics.reference_ids(target_logits, k), mask, k)
        assert acc.total > 0 and abs(acc.value - sf_acc[k]) < 1e-6, (k, acc, sf_acc[k])

    # and the flag that differs between the libraries would have been caught
    flipped = randomized(
        Eagle3Drafter(
            tiny_cfg(
                fc_norm=case["fc_norm"],
                logits_use_norm=not cfg.logits_use_norm,
                target_hidden_size=40,
            )
        ),
        seed=11,
    )
    flipped.embed_tokens.weight.data.copy_(built.embed_tokens.weight)
    assert (flipped.ttt(ids, aux, steps=1)[0].logits - theirs[0]).abs().max() > 1e-3
