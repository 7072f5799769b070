"""What every training-data reader hands out: one `TrainingSample` per stored sequence."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from hstrace.errors import TrainingDataError

LastNorm = Literal["pre", "post"]


@dataclass(frozen=True)
class TrainingSample:
    """One training sequence, exactly as the library stored it (no shifting, no re-ordering).

    - `input_ids` [T] int64, unshifted: `aux[t]` is the target's state at position t, whose
      EAGLE-3 pairing is with token `input_ids[t + 1]`.
    - `loss_mask` [T] bool, as stored (unshifted; the libraries shift it at train time).
    - `aux` [T, n_slots, Ht]: the drafter's aux input slots in stored order (ascending layer
      index in every library), dtype as stored (usually bf16).
    - `last` [T, Ht] or None: the state the library derives its teacher from;
      `last_norm` says whether it is before ("pre") or after ("post") the target's final norm.
    - `slot_layer_ids`: the layer ids of the aux slots where the data says so, else None; their
      meaning is `provenance["layer_id_convention"]` (see `hstrace.training.conventions`).
    """

    index: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    last: torch.Tensor | None
    last_norm: LastNorm | None
    slot_layer_ids: list[int] | None
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def aux_concat(self) -> torch.Tensor:
        """`aux` as the drafter's fc consumes it: [T, n_slots * Ht], slots concatenated."""
        return self.aux.flatten(1)


class TrainingData(ABC):
    """A lazily read training-data directory: nothing but an index is loaded at open."""

    format: str  # e.g. "speculators", "speculators-legacy", "specforge"

    def __init__(self, root: Path) -> None:
        self.root = root
        # (n_slots, Ht, file) of the first sample read: every sample of one dataset shares them.
        self._shape: tuple[int, int, str] | None = None
        # The consumer's vocabulary (`open_training(vocab_size=)`): token ids at or past it are
        # refused when a sample is read, before a drafter indexes its embedding with them.
        self.vocab_size: int | None = None

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def _load(self, i: int) -> TrainingSample: ...

    def _checked(self, i: int) -> TrainingSample:
        s = self._load(i)
        n_slots, ht = int(s.aux.shape[1]), int(s.aux.shape[2])
        where = str(s.provenance.get("file") or s.provenance.get("path") or f"sample {i}")
        vocab = getattr(self, "vocab_size", None)
        if vocab is not None and s.num_tokens and int(s.input_ids.max()) >= vocab:
            j = int(torch.argmax((s.input_ids >= vocab).to(torch.uint8)))
            raise TrainingDataError(
                f"{where}: input_ids[{j}] = {int(s.input_ids[j])} is outside the vocabulary of "
                f"{vocab} ids (corrupt, or training data of another target)"
            )
        if getattr(self, "_shape", None) is None:  # (a subclass may skip our __init__)
            self._shape = (n_slots, ht, where)
        elif self._shape[:2] != (n_slots, ht):
            first_slots, first_ht, first = self._shape
            raise TrainingDataError(
                f"{where}: hidden width {ht} x {n_slots} aux slots differs from the rest of the "
                f"dataset ({first}: width {first_ht} x {first_slots} slots); one dataset is "
                "dumped from one target"
            )
        return s

    def __getitem__(self, i: int) -> TrainingSample:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples in {self.root}")
        return self._checked(i % n)

    def samples(self) -> Iterator[TrainingSample]:
        for i in range(len(self)):
            yield self._checked(i)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} format={self.format!r} n={len(self)} root={self.root}>"


class FileListData(TrainingData):
    """A dataset of one file per sample, listed in sample-index order at open."""

    def __init__(self, root: Path, files: list[Path]) -> None:
        super().__init__(root)
        self.files = files

    def __len__(self) -> int:
        return len(self.files)
