"""SpecForge 0.2.0's own training model, run on CPU for the cross-checks (test_drafter_vs_specforge,
test_second_world): import it (a stand-in `triton` only while `specforge.core.loss` imports),
build and warm-start a draft as SpecForge's trainer does, run `OnlineEagle3Model.forward`.

The one fake: `FakeCudaLogSoftmaxLoss` (SpecForge's loss is a CUDA-only Triton kernel; the fake
calls SpecForge's own torch reference `_compute_loss`). Logits never pass through it. Importing
this module raises ImportError when specforge 0.2.0 is not importable: tests
`pytest.importorskip("helpers.specforge")`.
"""

from __future__ import annotations

import importlib
import sys
import types

import specforge.modeling.draft.llama3_eagle as sf_draft  # noqa: F401 - the draft model's module
import torch


def _fake_cuda_triton() -> dict[str, types.ModuleType]:
    """FakeCudaTriton: just enough of `triton` for `specforge.core.loss` to import (decorators,
    `tl.constexpr` annotations). Its kernels are never launched: see FakeCudaLogSoftmaxLoss."""
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    triton.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    triton.next_power_of_2 = lambda n: 1 << (int(n) - 1).bit_length()
    language.constexpr = int
    triton.language = language
    return {"triton": triton, "triton.language": language}


def _import_online_model() -> types.ModuleType:
    """Import `specforge.algorithms.eagle3.model`; only `specforge.core.loss` needs Triton."""
    if "specforge.core.loss" not in sys.modules:
        try:
            importlib.import_module("triton")
        except ImportError:
            fakes = _fake_cuda_triton()
            saved = {k: sys.modules.get(k) for k in fakes}
            sys.modules.update(fakes)
            try:
                importlib.import_module("specforge.core.loss")
            finally:  # torch's own triton probes must not see the fake
                for k, v in saved.items():
                    if v is None:
                        sys.modules.pop(k, None)
                    else:
                        sys.modules[k] = v
    return importlib.import_module("specforge.algorithms.eagle3.model")


sf_model = _import_online_model()
from specforge.modeling.auto import AutoDraftModel  # noqa: E402 - after the triton stand-in
from specforge.training.model_loading import (  # noqa: E402
    load_draft_config_source,
    warm_start_draft_model,
)


class FakeCudaLogSoftmaxLoss:
    """SpecForge's `LogSoftmaxLoss` launches a Triton kernel (CUDA only); this computes the same
    loss with SpecForge's own torch reference `_compute_loss`. Only the loss passes through it."""

    @staticmethod
    def apply(logits: torch.Tensor, target_p: torch.Tensor, position_mask: torch.Tensor):
        return sys.modules["specforge.core.loss"]._compute_loss(logits, target_p, position_mask)


def specforge_model(ckpt, target_dir):
    """Build and load the draft the way SpecForge's trainer does for a warm start."""
    config = load_draft_config_source(str(ckpt))
    draft = AutoDraftModel.from_config(config, attention_backend="sdpa")
    report = warm_start_draft_model(
        draft, str(ckpt), draft_config=config, strategy="eagle3", allow_missing_embedding=True
    )
    assert report.missing_keys == ("embed_tokens.weight",), report
    draft.load_embedding(str(target_dir))
    return draft.float().eval()


def run_specforge(draft, aux, ids, target, loss_mask, steps):
    """`OnlineEagle3Model.forward` as the trainer calls it after `TargetHead.preprocess`:
    ids and target already shifted (row t: token t+1, target logits of position t+1);
    loss_mask [B, T, 1]. Returns per-step logits [T, Vd] and SpecForge's per-step accuracy."""
    online = sf_model.OnlineEagle3Model(draft, length=steps, attention_backend="sdpa")
    captured: list[torch.Tensor] = []
    hook = draft.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
    T = ids.shape[0]
    try:
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            out = online(
                input_ids=ids[None],
                attention_mask=torch.ones(1, T, dtype=torch.bool),
                target=target[None],
                loss_mask=loss_mask[None, :, None].float(),
                hidden_states=aux[None],
            )
    finally:
        hook.remove()
    acces = out[2]
    return [c[0] for c in captured], [float(a) for a in acces]
