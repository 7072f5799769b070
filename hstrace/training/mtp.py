"""MTP training dumps (hstrace's documented format; `traces/mtp-world/build.py` writes one):

    {root}/mtp_training.json     {"format": "hstrace-mtp", "version": 1, "hidden_source":
                                  "pre_final_norm" | "post_final_norm", "hidden_layer": N, ...}
    {root}/samples/sample_{i:05d}.safetensors
        input_ids      [T] int64   the sequence, unshifted
        loss_mask      [T] uint8   as stored (unshifted)
        hidden_states  [T, H]      the target state of token t the head was fed (bf16 as dumped)

Pairing (stated in the json as `pairing`): hidden row t goes with the embedding of token t+1
and the head's label at row t is token t+2 (or the target's own prediction there). A sample
is handed out as one aux slot (`aux` [T, 1, H]) and the same state as `last`, whose
`last_norm` is "pre" for `pre_final_norm` and "post" for `post_final_norm`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from hstrace.errors import TrainingDataError
from hstrace.training._build import checked_sample
from hstrace.training.conventions import BEFORE_LAYER
from hstrace.training.safe_load import load_safetensors, require_dict, require_tensor
from hstrace.training.sample import FileListData, TrainingSample

FORMAT = "hstrace-mtp"
META = "mtp_training.json"
SOURCES = {"pre_final_norm": "pre", "post_final_norm": "post"}
_SAMPLE = re.compile(r"^sample_(\d+)\.safetensors$")


def find_files(root: Path) -> list[Path]:
    """The sample files in index order, or [] when `root` is not an MTP dump."""
    if not (root / META).is_file():
        return []
    d = root / "samples"
    found = (
        {int(m.group(1)): f for f in d.iterdir() if (m := _SAMPLE.match(f.name))}
        if d.is_dir()
        else {}
    )
    return [found[i] for i in sorted(found)]


def read_meta(root: Path) -> dict[str, Any]:
    path = root / META
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise TrainingDataError(f"{path}: unreadable MTP training metadata ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise TrainingDataError(
            f"{path}: not {FORMAT!r} metadata (format {meta.get('format') if isinstance(meta, dict) else None!r})"
        )
    if meta.get("hidden_source") not in SOURCES:
        raise TrainingDataError(
            f"{path}: hidden_source {meta.get('hidden_source')!r}; expected one of {sorted(SOURCES)}"
        )
    return meta


class MTPData(FileListData):
    format = FORMAT

    def __init__(self, root: Path, files: list[Path]) -> None:
        super().__init__(root, files)
        self.meta = read_meta(root)
        missing = sorted(
            set(range(len(files))) - {int(_SAMPLE.match(f.name).group(1)) for f in files}
        )  # type: ignore[union-attr]
        if missing:
            raise TrainingDataError(
                f"{root}/samples: sample_{missing[0]:05d}.safetensors is missing"
            )

    def _load(self, i: int) -> TrainingSample:
        path = self.files[i]
        d = require_dict(load_safetensors(path), path, ("input_ids", "loss_mask", "hidden_states"))
        ids = require_tensor(d["input_ids"], path, "input_ids", 1)
        mask = require_tensor(d["loss_mask"], path, "loss_mask", 1)
        hs = require_tensor(d["hidden_states"], path, "hidden_states", 2)
        return checked_sample(
            path=path,
            index=i,
            input_ids=ids,
            loss_mask=mask,
            aux=hs[:, None],
            last=hs,
            last_norm=SOURCES[self.meta["hidden_source"]],  # type: ignore[arg-type]
            # the fed state has no HF output_hidden_states index when pre-norm; the json's
            # hidden_layer / hidden_source say which it is
            slot_layer_ids=None,
            provenance={
                "format": self.format,
                "file": str(path),
                "layer_id_convention": BEFORE_LAYER,
                "hidden_source": self.meta["hidden_source"],
                "pairing": self.meta.get("pairing", "hidden row t with token t+1"),
                "last": f"the state the MTP head was fed ({self.meta['hidden_source']})",
                "mtp": {k: v for k, v in self.meta.items() if k not in ("format", "version")},
            },
        )
