"""Small reference drafters for tests: the 32-wide config, random weights (norms too, so a
skipped or misplaced norm changes the logits) and a d2t/t2d built as the libraries build them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import torch

from hstrace.drafter import DrafterConfig, Eagle3Drafter


def tiny_cfg(**flags) -> DrafterConfig:
    base = dict(
        hidden_size=32,
        vocab_size=97,
        draft_vocab_size=61,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    base.update(flags)
    return DrafterConfig(**base)


def randomized(model: Eagle3Drafter, seed: int) -> Eagle3Drafter:
    """Random norm weights too, so that a skipped or misplaced norm changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or "fc_norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model


def tiny_model(seed: int = 0, **flags) -> Eagle3Drafter:
    """A randomized tiny drafter whose d2t holds offsets to 61 sorted target ids of 97 (t2d
    marks the same ids), as speculators and SpecForge build the vocab map."""
    m = randomized(Eagle3Drafter(tiny_cfg(**flags)), seed=seed)
    used = torch.sort(torch.randperm(97, generator=torch.Generator().manual_seed(seed))[:61]).values
    m.d2t.copy_(used - torch.arange(61))
    m.t2d.zero_()
    m.t2d[used] = True
    return m


def load_module(path: Path) -> ModuleType:
    """Import one Python file by path (a builder's helpers, e.g. the tiny world's dumps.py),
    without putting its directory on sys.path."""
    spec = importlib.util.spec_from_file_location(f"_hstrace_test_{path.stem}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
