"""Reading tensors out of an HF target checkpoint dir, for the judge (check, replay): the token
embedding that drafters saved without one (SpecForge, EAGLE) are served with. The target's
final norm and lm_head (the teacher) are read by `hstrace.metrics.TargetHead`."""

from __future__ import annotations

from pathlib import Path

import torch

from hstrace.errors import CheckpointError


def load_target_embedding(path: str | Path) -> torch.Tensor:
    """`model.embed_tokens.weight` of an HF target dir (SpecForge/EAGLE drafters carry none)."""
    from safetensors import SafetensorError, safe_open

    root = Path(path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        raise CheckpointError(f"{root}: not a target checkpoint dir (no *.safetensors)")
    for f in files:
        try:
            with safe_open(str(f), "pt") as st:
                if "model.embed_tokens.weight" in st.keys():
                    return st.get_tensor("model.embed_tokens.weight").float()
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{f}: cannot read tensors ({exc})") from None
    raise CheckpointError(f"{root}: target checkpoint lacks model.embed_tokens.weight")
