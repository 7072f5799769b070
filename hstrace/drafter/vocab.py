"""The readings of `d2t`, in one place: how a draft id becomes a target id.

Every library stores `d2t` as offsets and every engine reads it that way: target = i + d2t[i]
(speculators, SpecForge, SGLang's `hot_token_id = d2t + arange`, vLLM's `compute_logits`).
Two misreadings are seen in the field: a converter that wrote absolute ids into `d2t` (read as
a direct table, target = d2t[i]) and an engine that applies no map (target = i). The drafter,
the reference engine, `hstrace check` and `diagnose` all map ids through `map_draft_ids`, so
"the same reading" means the same code.

`checkpoint_reading` answers the static question (what does a checkpoint's `d2t` hold?) from
the tensors alone; `map_draft_ids` answers the dynamic one (what does a reading turn these
ids into?).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

OFFSETS = "offsets"
DIRECT_TABLE = "direct table"
NO_MAP = "no mapping"
# The names are part of replay's evidence (`agreement_by_reading`): keep them.
D2T_READINGS = (OFFSETS, DIRECT_TABLE, NO_MAP)


def map_draft_ids(
    ids: Tensor, d2t: Tensor, reading: str = OFFSETS, vocab_size: int | None = None
) -> Tensor:
    """Target ids for draft ids `ids` (any shape) under one reading of `d2t` [Vd]:
    `OFFSETS` i + d2t[i]; `DIRECT_TABLE` d2t[i] (clamped into [0, vocab_size) when given, as an
    engine indexing its vocab with it would); `NO_MAP` i itself (a copy)."""
    if reading == OFFSETS:
        return ids + d2t[ids]
    if reading == DIRECT_TABLE:
        out = d2t[ids]
        return out.clamp(0, vocab_size - 1) if vocab_size is not None else out
    if reading == NO_MAP:
        return ids.clone()
    raise ValueError(f"unknown d2t reading {reading!r}; known: {D2T_READINGS}")


def draft_vocab_targets(d2t: Tensor, reading: str = OFFSETS) -> Tensor:
    """[Vd] the target id of every draft id under `reading` (the draft vocab in target ids)."""
    return map_draft_ids(torch.arange(d2t.numel(), device=d2t.device), d2t, reading)


@dataclass
class CheckpointD2T:
    """What a checkpoint's vocab map holds, decided from its tensors (`checkpoint_reading`).

    `state`: "same-vocab" (Vd >= V: no map needed), "missing" (no d2t), "zeros" (all-zero
    d2t: read as offsets it maps onto ids 0..Vd-1), "direct-table" (the values are target ids:
    read as offsets they leave the vocab, or t2d marks exactly d2t's values and not i + d2t[i]),
    "inconsistent" (offsets, but t2d marks another id set), "unsorted" (offsets that decrease:
    no library builds them so) or "offsets" (as every engine reads it). `info` is what
    `hstrace check` reports under metrics.vocab; `mismatch` the t2d-vs-d2t evidence."""

    state: str
    info: dict[str, Any] = field(default_factory=dict)
    mismatch: dict[str, Any] | None = None


def checkpoint_reading(
    d2t: Tensor, t2d: Tensor, vocab_size: int, has_d2t: bool, has_t2d: bool
) -> CheckpointD2T:
    Vd = int(d2t.numel())
    info: dict[str, Any] = {
        "vocab_size": vocab_size,
        "draft_vocab_size": Vd,
        "d2t_present": has_d2t,
        "t2d_present": has_t2d,
    }
    if Vd >= vocab_size:
        return CheckpointD2T("same-vocab", info)
    if not has_d2t:
        return CheckpointD2T("missing", info)
    if not bool(d2t.any()):
        return CheckpointD2T("zeros", info)
    target = draft_vocab_targets(d2t)
    info |= {
        "d2t_min": int(d2t.min()),
        "d2t_max": int(d2t.max()),
        "offset_target_max": int(target.max()),
    }
    t2d_ids = torch.nonzero(t2d).flatten() if has_t2d else None
    as_table = t2d_ids is not None and torch.equal(t2d_ids, torch.sort(d2t).values)
    if (
        int(target.max()) >= vocab_size
        or int(target.min()) < 0
        or (as_table and not torch.equal(t2d_ids, target))
    ):
        info["d2t_equals_t2d_ids"] = as_table
        return CheckpointD2T("direct-table", info)
    mismatch = _t2d_vs_offsets(t2d_ids, target) if t2d_ids is not None else None
    if mismatch is not None:
        return CheckpointD2T("inconsistent", info, mismatch)
    if bool((d2t[1:] < d2t[:-1]).any()):
        return CheckpointD2T("unsorted", info)
    return CheckpointD2T(OFFSETS, info)


def _t2d_vs_offsets(t2d_ids: Tensor, target: Tensor) -> dict[str, Any] | None:
    """The set {i + d2t[i]} must equal t2d's true entries (both libraries build them from one
    sorted id list); None when it does."""
    d2t_ids = torch.unique(target)
    if torch.equal(d2t_ids, t2d_ids):
        return None
    only_d2t = d2t_ids[~torch.isin(d2t_ids, t2d_ids)]
    only_t2d = t2d_ids[~torch.isin(t2d_ids, d2t_ids)]
    return {
        "t2d_true": int(t2d_ids.numel()),
        "d2t_distinct_targets": int(d2t_ids.numel()),
        "d2t_duplicate_targets": int(target.numel() - d2t_ids.numel()),
        "n_only_in_d2t": int(only_d2t.numel()),
        "n_only_in_t2d": int(only_t2d.numel()),
        "only_in_d2t": only_d2t[:10].tolist(),
        "only_in_t2d": only_t2d[:10].tolist(),
    }
