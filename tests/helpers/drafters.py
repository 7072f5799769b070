"""Small reference drafters for tests: the 32-wide config, random weights (norms too, so a
skipped or misplaced norm changes the logits) and a d2t/t2d built as the libraries build them."""

from __future__ import annotations

import importlib.util
import sys
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


def train_world_drafter(out: Path, **flags) -> Path:
    """The tiny world's EAGLE-3 drafter trained again as `traces/tiny-world/build.py` trains
    it (its seeds, steps, learning rate, training samples and `drafter.py`), with `flags`
    changed (e.g. `norm_before_fc=True`), saved by `save_drafter` in the speculators dialect
    (bf16, aux ids [2, 4, 5]) at `out`. One CPU thread while it trains (the builder's setting;
    restored after). The d2t / t2d and the frozen embedding are the world's own."""
    from dataclasses import replace

    from hstrace.drafter import load_drafter, save_drafter
    from hstrace.metrics import TargetHead
    from hstrace.training import open_training

    world = Path(__file__).resolve().parents[2] / "traces" / "tiny-world"
    saved_path = list(sys.path)
    build = load_module(world / "build.py")  # (it puts its own directory on sys.path)
    sys.path[:] = saved_path
    trainer = load_module(world / "drafter.py")
    shipped, _ = load_drafter(world / "drafter-speculators")
    samples = list(open_training(world / "training-speculators").samples())
    head = TargetHead.from_pretrained(world / "target")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(build.SEED + 3)
        model = Eagle3Drafter(replace(shipped.cfg, **flags)).float()
        with torch.no_grad():
            model.embed_tokens.weight.copy_(shipped.embed_tokens.weight)
            model.d2t.copy_(shipped.d2t)
            model.t2d.copy_(shipped.t2d)
        train = slice(0, build.N_SAMPLES - build.N_HELDOUT)
        trainer.train(model, samples[train], head, shipped.t2d, build.DRAFTER_STEPS,
                      build.SEED + 4, build.DRAFTER_LR)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    save_drafter(model.eval(), out, dialect="speculators", dtype=torch.bfloat16)
    return out
