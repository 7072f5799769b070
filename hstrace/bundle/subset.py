"""Write a chosen subset of a trace as a new, real trace through the store's own writer.

Nothing is copied array-to-array or truncated: every kept event is read back as a whole step
(or as whole requests inside it) and written again with `RankRecorder.write_step`, so the
subset has its own offsets and commit record and `open_trace` reads it like any trace.
Redaction happens here, on the way through.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hstrace import redaction as rd
from hstrace.bundle.select import STEP_AXIS, Event, slice_requests
from hstrace.trace.stepcache import WindowedSteps


@dataclass
class Redaction:
    ids: bool = False
    hidden: bool = False
    salt: bytes = b""

    @property
    def modes(self) -> list[str]:
        return [m for m in rd.REDACT_MODES if getattr(self, m)]


@dataclass
class SubsetStats:
    events: dict[str, int] = field(default_factory=dict)  # table -> events written
    engine_steps: dict[int, list[int]] = field(default_factory=dict)  # rank -> engine steps
    dropped_columns: list[str] = field(default_factory=list)


def as_tensor(a: Any) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().contiguous()
    return torch.from_numpy(np.ascontiguousarray(a))


def _redact_rows(
    table: str,
    rows: dict[str, dict[str, Any]],
    attrs: dict[str, dict[str, Any]],
    how: Redaction,
    dropped: set[str],
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, Any]]]:
    """Rows ready for `TraceWriter.write` (step-axis values as scalars), and column attrs."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    out_attrs: dict[str, dict[str, Any]] = {}
    for axis, cols in rows.items():
        out[axis] = {}
        for col, value in cols.items():
            key = f"{axis}/{col}"
            col_attrs = dict(attrs.get(key, {}))
            col_attrs.pop("hstrace_dtype", None)
            if how.hidden and col in rd.HIDDEN_COLUMNS:
                width = int(col_attrs.get("slot_width") or 0)
                t = (
                    value
                    if isinstance(value, torch.Tensor)
                    else torch.from_numpy(np.asarray(value))
                )
                t = t.reshape(t.shape[0], -1)
                if width <= 0:
                    width = t.shape[1]  # one slot: a draft hidden state
                stats, sketch = rd.slot_statistics(t, width)
                out[axis][f"{col}_stats"] = stats
                out[axis][f"{col}_sketch"] = sketch
                meta = {**col_attrs, "redacted_from": col, "slot_width": width}
                out_attrs[f"{axis}/{col}_stats"] = {**meta, "stats": list(rd.STATS)}
                out_attrs[f"{axis}/{col}_sketch"] = {
                    **meta,
                    "sketch_dim": rd.SKETCH_DIM,
                    "sketch_seed": rd.SKETCH_SEED,
                    "sketch": "x @ (randn(W, D, generator=manual_seed(seed + W)) / sqrt(D)), fp32",
                }
                dropped.add(f"{table}/{key}")
                continue
            t = as_tensor(value)
            domain = rd.id_domain(col) if how.ids else None
            if domain is not None:
                t = torch.from_numpy(rd.hash_token_ids(t, how.salt, domain))
                col_attrs["redacted"] = f"salted-hash-{domain}"
            # The writer gives step-axis values their one row itself.
            out[axis][col] = t[0] if axis == STEP_AXIS else t
            if col_attrs:
                out_attrs[key] = col_attrs
    return out, out_attrs


def write_subset(
    trace: Any,
    out_dir: str | os.PathLike[str],
    chosen: dict[int, list[tuple[Event, np.ndarray | None]]],
    how: Redaction,
    extra_static: dict[str, Any],
    column_attrs: Any,
) -> SubsetStats:
    """Write `chosen` events of `trace` (rank -> events) as a new trace at `out_dir`.

    `column_attrs(rank, table, axis, column) -> dict` gives a source column's attributes (the
    reader's business), so layer ids and slot widths travel with the data."""
    from hstrace.trace import TraceWriter, create_trace

    root_meta = dict(getattr(trace, "root_meta", None) or trace.meta)
    engine = dict(root_meta.get("engine") or {"name": "unknown"})
    static = dict(root_meta.get("static") or {})
    static.update(extra_static)
    create_trace(
        out_dir,
        engine=engine,
        command_line=list(root_meta.get("command_line") or []),
        static=static,
    )
    stats = SubsetStats()
    dropped: set[str] = set()
    for rank, events in chosen.items():
        view = trace.rank(rank)
        # In-process mode: the store's own writer, same validation and layout as a recording.
        w = TraceWriter(str(out_dir), rank=rank, process=False, tail_flush_s=3600.0)
        try:
            if getattr(view, "static", None):
                w.update_static(dict(view.static))
            for err in getattr(view, "errors", None) or []:
                w.note_error(str(err.get("tap", "?")), str(err.get("message", "")))
            w.dropped = dict(getattr(view, "dropped_steps", None) or {})
            attrs_cache: dict[str, dict[str, dict[str, Any]]] = {}
            readers: dict[str, WindowedSteps] = {}
            for ev, mask in events:
                table = view.table(ev.table)
                if ev.table not in attrs_cache:
                    attrs_cache[ev.table] = {
                        f"{axis}/{col}": column_attrs(rank, ev.table, axis, col)
                        for axis, cols in table.columns.items()
                        for col in cols
                    }
                if ev.table not in readers:
                    readers[ev.table] = WindowedSteps(table)
                rows = slice_requests(ev.table, readers[ev.table].step(ev.step), mask)
                axes, out_attrs = _redact_rows(ev.table, rows, attrs_cache[ev.table], how, dropped)
                w.write(ev.table, column_attrs=out_attrs, **axes)
                stats.events[ev.table] = stats.events.get(ev.table, 0) + 1
            stats.engine_steps[rank] = sorted(
                {ev.engine_step for ev, _ in events if ev.table != "requests"}
            )
        finally:
            w.close()
    stats.dropped_columns = sorted(dropped)
    return stats
