"""SpecForge offline data (`scripts/prepare_hidden_states.py`):

    {root}/rows_{a}-{b}/data_{idx}.ckpt[.gz]   torch dict {
        input_ids [T] int64, loss_mask [T],
        aux_hidden_state [1, T, n*Ht]   SGLang aux capture, slots concatenated (ascending layer),
        hidden_state     [1, T, Ht]  }  SGLang "last_hidden_states" = lm_head input = POST norm
    {root}/vocab_mapping/vocab_mapping.pt      {"d2t", "t2d"} (optional)

Layer ids are not stored; SpecForge captures `eagle_config.eagle_aux_hidden_state_layer_ids` or
its default [1, N//2-1, N-4], both in the output-of-layer convention (SGLang adds +1).
"""

from __future__ import annotations

import re
from pathlib import Path

from hstrace.errors import TrainingDataError
from hstrace.training._build import checked_sample
from hstrace.training.conventions import OUTPUT_OF_LAYER
from hstrace.training.safe_load import load_torch, require_dict, require_tensor
from hstrace.training.sample import FileListData, TrainingSample

_ROWS = re.compile(r"^rows_(\d+)-(\d+)$")
_FILE = re.compile(r"^data_(\d+)\.ckpt(\.gz)?$")
KEYS = ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state")


def find_files(root: Path) -> list[Path]:
    """Data files under `rows_*` groups (or directly under root), in sample-index order."""
    found: list[tuple[int, int, Path]] = []
    groups = [d for d in root.iterdir() if d.is_dir() and _ROWS.match(d.name)]
    for d in [*groups, root]:
        for f in d.iterdir():
            m = _FILE.match(f.name)
            if m and f.is_file():
                start = int(_ROWS.match(d.name).group(1)) if d is not root else 0
                found.append((int(m.group(1)), start, f))
    found.sort(key=lambda x: (x[0], x[1]))
    return [f for _, _, f in found]


class SpecForgeData(FileListData):
    format = "specforge"

    def _load(self, i: int) -> TrainingSample:
        path = self.files[i]
        d = require_dict(load_torch(path), path, KEYS)
        aux = require_tensor(d["aux_hidden_state"], path, "aux_hidden_state", 3)
        last = require_tensor(d["hidden_state"], path, "hidden_state", 3)
        ht = last.shape[-1]
        if aux.shape[0] != 1 or last.shape[0] != 1 or ht == 0 or aux.shape[-1] % ht:
            raise TrainingDataError(
                f"{path}: aux_hidden_state {list(aux.shape)} is not [1, T, n*Ht] for "
                f"hidden_state {list(last.shape)}"
            )
        t = aux.shape[1]
        return checked_sample(
            path=path,
            index=i,
            input_ids=require_tensor(d["input_ids"], path, "input_ids", 1),
            loss_mask=require_tensor(d["loss_mask"], path, "loss_mask", 1),
            aux=aux[0].reshape(t, aux.shape[-1] // ht, ht),
            last=last[0],
            last_norm="post",
            slot_layer_ids=None,
            provenance={
                "format": self.format,
                "file": str(path),
                "layer_ids_source": "not stored in SpecForge data; the capture used the draft "
                "config's eagle_config.eagle_aux_hidden_state_layer_ids or the default "
                "[1, N//2-1, N-4]",
                "layer_id_convention": OUTPUT_OF_LAYER,
                "last": "hidden_state: SGLang last_hidden_states, after the final norm",
            },
        )
