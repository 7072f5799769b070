"""`open_training(path)`: recognise a training-data directory by its files, open it lazily."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hstrace.errors import TrainingDataError
from hstrace.training import mtp, specforge, speculators, speculators_legacy
from hstrace.training.safe_load import load_torch, require_dict, require_tensor
from hstrace.training.sample import TrainingData


def _describe(root: Path, limit: int = 8) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir())
    if not names:
        return "an empty directory"
    more = f", ... ({len(names)} entries)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def open_training(path: str | Path, vocab_size: int | None = None) -> TrainingData:
    """Open speculators v0.5+, speculators v0.2-v0.4, SpecForge offline data or an MTP dump
    (`hstrace.training.mtp`), by layout.

    Raises `TrainingDataError` naming what was found when the layout is none of these, or
    when it holds no sample. `vocab_size` (the drafter's): samples with token ids past it are
    refused as they are read.
    """
    td = _open(Path(path))
    if len(td) == 0:
        raise TrainingDataError(f"{td.root}: {td.format} training data with no samples (empty)")
    td.vocab_size = vocab_size
    return td


def _open(root: Path) -> TrainingData:
    if not root.exists():
        raise TrainingDataError(f"{root}: training-data directory does not exist")
    if not root.is_dir():
        raise TrainingDataError(f"{root}: expected a training-data directory, found a file")

    if (root / mtp.META).is_file():
        return mtp.MTPData(root, mtp.find_files(root))
    if speculators.hs_files(root):
        return speculators.SpeculatorsData(root)
    sf_files = specforge.find_files(root)
    if sf_files:
        return _specforge_or_ge_data(root, sf_files)
    legacy = speculators_legacy.find_files(root)
    if legacy:
        return speculators_legacy.SpeculatorsLegacyData(root, legacy)
    raise TrainingDataError(
        f"{root}: unknown training-data layout (found {_describe(root)}); expected "
        "hidden_states/hs_*.safetensors (speculators >= 0.5), data_*.pt (speculators 0.2-0.4) "
        "rows_*/data_*.ckpt[.gz] (SpecForge) or mtp_training.json + samples/ (hstrace MTP dump)"
    )


def _specforge_or_ge_data(root: Path, files: list[Path]) -> TrainingData:
    # EAGLE-1/2 ge_data also writes data_*.ckpt; it has a post-norm `hidden_state` and no aux
    # slots, so it cannot feed an EAGLE-3 drafter. Peek at one file to tell them apart.
    first = load_torch(files[0])
    if isinstance(first, dict) and "hidden_state" in first and "aux_hidden_state" not in first:
        raise TrainingDataError(
            f"{files[0]}: EAGLE-1/2 ge_data (hidden_state only, no aux_hidden_state); "
            "it cannot train or replay an EAGLE-3 drafter"
        )
    return specforge.SpecForgeData(root, files)


def training_d2t(path: str | Path) -> torch.Tensor | None:
    """The draft->target map (offsets, int64 [Vd]) the training data was built with: speculators
    `d2t.npy`, SpecForge `vocab_mapping/vocab_mapping.pt` ({"d2t", "t2d"}); None when the
    directory carries none. Read without pickle (numpy `allow_pickle=False`, torch
    `weights_only=True`)."""
    root = Path(path)
    npy, pt = root / "d2t.npy", root / "vocab_mapping" / "vocab_mapping.pt"
    if npy.is_file():
        try:
            values = np.load(npy, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise TrainingDataError(f"{npy}: not a numpy int array ({exc})") from None
        d2t = torch.from_numpy(np.asarray(values))
    elif pt.is_file():
        d2t = require_tensor(require_dict(load_torch(pt), pt, ("d2t",))["d2t"], pt, "d2t", 1)
    else:
        return None
    if d2t.dim() != 1 or d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise TrainingDataError(f"{root}: d2t is {d2t.dtype} {list(d2t.shape)}, not 1-d integer")
    return d2t.to(torch.int64)
