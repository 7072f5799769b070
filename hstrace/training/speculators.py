"""speculators offline data, v0.5+ (`scripts/prepare_data.py` + vLLM `extract_hidden_states`):

    {root}/  HF datasets save_to_disk: columns input_ids [T], loss_mask [T], seq_len
    {root}/hidden_states/hs_{i}.safetensors   {"token_ids": [T], "hidden_states": [T, L, Ht]}

Row i of the dataset goes with `hs_{i}`; `token_ids` must equal the row's `input_ids` (speculators
checks it too). The training library splits `hidden_states[:, :-1]` → aux and
`hidden_states[:, -1]` → the teacher's state: the stream after all N layers, BEFORE the final
norm. The loss mask lives only in the arrow dataset.

Without pyarrow the reader degrades: token ids and states still come from the safetensors files,
the loss mask is all ones, and `provenance["loss_mask_source"]` says so (a warning is issued once).

Layer ids are not stored in the data dir; the datagen default is [2, N//2, N-3] plus N (final),
in the before-layer convention (vLLM `aux_hidden_state_layers`).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch

from hstrace.errors import TrainingDataError
from hstrace.training._build import checked_sample
from hstrace.training.arrow_table import ArrowColumns, data_files, have_pyarrow
from hstrace.training.conventions import BEFORE_LAYER
from hstrace.training.safe_load import load_safetensors, require_dict, require_tensor
from hstrace.training.sample import TrainingData, TrainingSample

_HS = re.compile(r"^hs_(\d+)\.safetensors$")


def hs_files(root: Path) -> dict[int, Path]:
    d = root / "hidden_states"
    if not d.is_dir():
        return {}
    return {int(m.group(1)): f for f in d.iterdir() if (m := _HS.match(f.name))}


class SpeculatorsData(TrainingData):
    format = "speculators"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.hs = hs_files(root)
        self.table: ArrowColumns | None = None
        if data_files(root) and have_pyarrow():
            self.table = ArrowColumns(root, ("input_ids", "loss_mask"))
            self.loss_mask_source = "arrow dataset column loss_mask"
        else:
            why = "pyarrow not installed" if data_files(root) else "no arrow dataset in the dir"
            self.loss_mask_source = f"absent ({why}); all ones assumed"
            warnings.warn(f"{root}: loss mask unavailable, {self.loss_mask_source}", stacklevel=3)

    def __len__(self) -> int:
        if self.table is not None:
            return len(self.table)
        return max(self.hs) + 1 if self.hs else 0

    def _load(self, i: int) -> TrainingSample:
        path = self.hs.get(i, self.root / "hidden_states" / f"hs_{i}.safetensors")
        d = require_dict(load_safetensors(path), path, ("token_ids", "hidden_states"))
        ids = require_tensor(d["token_ids"], path, "token_ids", 1)
        hs = require_tensor(d["hidden_states"], path, "hidden_states", 3)
        if hs.shape[1] < 2:
            raise TrainingDataError(
                f"{path}: hidden_states {list(hs.shape)} has {hs.shape[1]} slot(s); "
                "expected aux slots plus the final state"
            )
        if self.table is not None:
            row_ids = self.table.get("input_ids", i)
            if not torch.equal(row_ids, ids.to(torch.int64)):
                raise TrainingDataError(
                    f"{path}: token_ids (len {ids.shape[0]}) differ from dataset row {i} "
                    f"input_ids (len {row_ids.shape[0]})"
                )
            mask = self.table.get("loss_mask", i)
        else:
            mask = torch.ones_like(ids, dtype=torch.bool)
        return checked_sample(
            path=path,
            index=i,
            input_ids=ids,
            loss_mask=mask,
            aux=hs[:, :-1],
            last=hs[:, -1],
            last_norm="pre",
            slot_layer_ids=None,
            provenance={
                "format": self.format,
                "file": str(path),
                "loss_mask_source": self.loss_mask_source,
                "layer_ids_source": "not stored in speculators>=0.5 data; the datagen default "
                "is [2, N//2, N-3] for the aux slots plus N for the last",
                "layer_id_convention": BEFORE_LAYER,
                "last": "hidden_states[:, -1]: stream after all layers, before the final norm",
            },
        )
