"""A reference forward of the target model (HF transformers, fp32 on CPU) for fingerprints.

`layers(ids)` gives the residual stream after k decoder layers for k = 0..N (0 = embeddings,
N = the final state *before* the final norm, which HF's own tuple does not expose), so a stored
or recorded slot can be named by the physical layer it holds. `post_norm(ids)` is the input of
lm_head, for the teacher test. `layers_in(ids, dtype)` is the same forward with the weights
in the serving dtype (bf16 by default): how far the target's own low-precision run is from its
fp32 self (MoE routing flips, MLA in bf16) is what `target-drift` is judged against.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hstrace.errors import HstraceError


@dataclass
class TargetForward:
    layers: torch.Tensor  # [T, N+1, H]
    post_norm: torch.Tensor  # [T, H]
    logits: torch.Tensor  # [T, V]


class ReferenceTarget:
    def __init__(self, path: Path) -> None:
        try:
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging
        except ImportError as exc:
            raise HstraceError(
                "the target forward needs transformers (pip install 'hstrace[reference]')"
            ) from exc
        if not (Path(path) / "config.json").is_file():
            raise HstraceError(f"target model dir {path} has no config.json")
        hf_logging.disable_progress_bar()  # hstrace draws its own; keep stderr to one line
        try:
            self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        except (OSError, ValueError, KeyError) as exc:
            raise HstraceError(f"cannot load the target model from {path}: {exc}") from exc
        self.model.eval()
        self.path = Path(path)
        self.num_layers = int(self.model.config.num_hidden_layers)
        self.hidden_size = int(self.model.config.hidden_size)
        self.rope_theta = _rope_theta(self.model.config)
        self._cache: dict[bytes, TargetForward] = {}
        self._lowp: dict[torch.dtype, torch.nn.Module] = {}

    @property
    def embed(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @property
    def norm(self) -> torch.nn.Module:
        return self.model.model.norm

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> TargetForward:
        key = ids.numpy().tobytes()
        if key in self._cache:
            return self._cache[key]
        result = _run(self.model, ids)
        if len(self._cache) >= 8:  # the engine asks again for the same sequence right away
            self._cache.pop(next(iter(self._cache)))
        self._cache[key] = result
        return result

    @torch.inference_mode()
    def layers_in(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[T, N+1, H] (as fp32 numbers) from the target loaded in `dtype`, loaded the way an
        engine loads it (`from_pretrained(dtype=...)`, so modules HF keeps in fp32 stay fp32)."""
        if dtype == torch.float32:
            return self.forward(ids).layers
        model = self._lowp.get(dtype)
        if model is None:
            from transformers import AutoModelForCausalLM

            try:
                model = AutoModelForCausalLM.from_pretrained(str(self.path), dtype=dtype).eval()
            except (OSError, ValueError, KeyError) as exc:
                raise HstraceError(f"cannot load the target in {dtype}: {exc}") from exc
            self._lowp[dtype] = model
        return _run(model, ids).layers


def _run(model: torch.nn.Module, ids: torch.Tensor) -> TargetForward:
    captured: dict[str, torch.Tensor] = {}
    hook = model.model.norm.register_forward_hook(
        lambda _m, inp, out: captured.update(pre=inp[0], post=out)
    )
    try:
        out = model(ids.long()[None], output_hidden_states=True)
    finally:
        hook.remove()
    n = int(model.config.num_hidden_layers)
    states = list(out.hidden_states[:n]) + [captured["pre"]]
    return TargetForward(
        layers=torch.stack([s[0] for s in states], dim=1).float(),
        post_norm=captured["post"][0].float(),
        logits=out.logits[0].float(),
    )


def _rope_theta(config: object) -> float | None:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        params = getattr(config, "rope_parameters", None) or {}
        theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta) if theta is not None else None
