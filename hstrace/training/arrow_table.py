"""Reads the columns of an HF `datasets` `save_to_disk` directory with pyarrow alone.

The layout `datasets` writes: `state.json` (`_data_files: [{"filename": ...}]`, in order),
`dataset_info.json`, and each data file an Arrow IPC *stream*. Reading it needs `pyarrow` (an
optional dependency, extra `hstrace[training]`); `datasets` itself is not needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hstrace.errors import TrainingDataError
from hstrace.training.safe_load import read_small_text, require_regular


def have_pyarrow() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def data_files(root: Path) -> list[Path]:
    state = root / "state.json"
    if state.is_file():
        try:
            names = [f["filename"] for f in json.loads(read_small_text(state))["_data_files"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise TrainingDataError(f"{state}: not an HF datasets state file ({exc})") from exc
        return [root / n for n in names]
    return sorted(root.glob("*.arrow"))


class ArrowColumns:
    """The integer list columns of the dataset, one torch tensor per row, loaded on first use."""

    def __init__(self, root: Path, columns: tuple[str, ...]) -> None:
        self.root = root
        self.columns = columns
        self._rows: dict[str, list[list[int]]] | None = None

    def _read(self) -> dict[str, list[list[int]]]:
        import pyarrow as pa

        files = data_files(self.root)
        if not files:
            raise TrainingDataError(f"{self.root}: no .arrow files of an HF dataset")
        out: dict[str, list[list[int]]] = {c: [] for c in self.columns}
        for f in files:
            require_regular(f)  # a FIFO would block memory_map forever
            try:
                with pa.memory_map(str(f)) as src:
                    table = pa.ipc.open_stream(src).read_all()
            except (OSError, pa.ArrowInvalid) as exc:
                raise TrainingDataError(f"{f}: not an Arrow IPC stream ({exc})") from exc
            missing = [c for c in self.columns if c not in table.column_names]
            if missing:
                raise TrainingDataError(
                    f"{f}: dataset lacks columns {missing}; found {table.column_names}"
                )
            for c in self.columns:
                out[c].extend(table.column(c).to_pylist())
        return out

    def __len__(self) -> int:
        return len(self.rows[self.columns[0]])

    @property
    def rows(self) -> dict[str, list[list[int]]]:
        if self._rows is None:
            self._rows = self._read()
        return self._rows

    def get(self, column: str, i: int) -> torch.Tensor:
        return torch.tensor(self.rows[column][i], dtype=torch.int64)
