"""speculators offline data, v0.2-v0.4 (custom vLLM worker, `data_generation_offline.py`):

    {root}/data_{idx}.pt   torch dict {input_ids [T], hidden_states: list of L [T, Ht],
                                       loss_mask [T]}
    {root}/data_config.json  {"hidden_states": {"layer_ids": [...]}, ...}   (optional)

The worker captured each slot AFTER `layer(idx)` ran, so ids are in the output-of-layer
convention; the default ids [2, N//2, N-3, N-1] are HF hs[3], hs[N//2+1], hs[N-2] and the
pre-norm final stream, one layer deeper than vLLM's default serving capture. The training
library uses `hidden_states[:-1]` as aux and `hidden_states[-1]` for the teacher.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from hstrace.errors import TrainingDataError
from hstrace.training._build import checked_sample
from hstrace.training.conventions import OUTPUT_OF_LAYER
from hstrace.training.safe_load import (
    load_torch,
    read_small_text,
    require_dict,
    require_tensor,
)
from hstrace.training.sample import FileListData, TrainingSample

_FILE = re.compile(r"^data_(\d+)\.pt$")
KEYS = ("input_ids", "hidden_states", "loss_mask")


def find_files(root: Path) -> list[Path]:
    # Directly in the root (the datagen's layout): a recursive search would mix in every other
    # dataset below, e.g. copies of this one.
    found = [(int(m.group(1)), f) for f in root.glob("data_*.pt") if (m := _FILE.match(f.name))]
    return [f for _, f in sorted(found)]


def read_layer_ids(root: Path) -> list[int] | None:
    cfg = root / "data_config.json"
    if not cfg.is_file():
        return None
    try:
        ids = json.loads(read_small_text(cfg))["hidden_states"]["layer_ids"]
    except (ValueError, KeyError, TypeError) as exc:
        raise TrainingDataError(f"{cfg}: no hidden_states.layer_ids ({exc})") from exc
    if not isinstance(ids, list) or not all(isinstance(x, int) for x in ids):
        raise TrainingDataError(f"{cfg}: hidden_states.layer_ids is not a list of ints: {ids}")
    return ids


class SpeculatorsLegacyData(FileListData):
    format = "speculators-legacy"

    def __init__(self, root: Path, files: list[Path]) -> None:
        super().__init__(root, files)
        self.layer_ids = read_layer_ids(root)

    def _load(self, i: int) -> TrainingSample:
        path = self.files[i]
        d = require_dict(load_torch(path), path, KEYS)
        slots = d["hidden_states"]
        if not isinstance(slots, list | tuple) or len(slots) < 2:
            found = (
                f"a tensor of shape {list(slots.shape)}"
                if isinstance(slots, torch.Tensor)
                else type(slots).__name__
            )
            raise TrainingDataError(
                f"{path}: hidden_states should be a list of >= 2 [T, H] tensors "
                f"(speculators v0.2-v0.4), found {found}"
            )
        slots = [require_tensor(s, path, f"hidden_states[{j}]", 2) for j, s in enumerate(slots)]
        if len({tuple(s.shape) for s in slots}) != 1:
            shapes = [list(s.shape) for s in slots]
            raise TrainingDataError(f"{path}: hidden_states slots differ in shape: {shapes}")
        if self.layer_ids is not None and len(self.layer_ids) != len(slots):
            raise TrainingDataError(
                f"{path}: {len(slots)} hidden_states slots but data_config.json lists "
                f"{len(self.layer_ids)} layer ids {self.layer_ids}"
            )
        return checked_sample(
            path=path,
            index=i,
            input_ids=require_tensor(d["input_ids"], path, "input_ids", 1),
            loss_mask=require_tensor(d["loss_mask"], path, "loss_mask", 1),
            aux=torch.stack(slots[:-1], dim=1),
            last=slots[-1],
            last_norm="pre",
            slot_layer_ids=self.layer_ids[:-1] if self.layer_ids else None,
            provenance={
                "format": self.format,
                "file": str(path),
                "layer_ids_source": "data_config.json hidden_states.layer_ids"
                if self.layer_ids
                else "not stored (no data_config.json); the datagen default is "
                "[2, N//2, N-3] for the aux slots plus N-1 for the last",
                "last_layer_id": self.layer_ids[-1] if self.layer_ids else None,
                "layer_id_convention": OUTPUT_OF_LAYER,
                "last": "hidden_states[-1]: output of the last layer, before the final norm",
            },
        )
