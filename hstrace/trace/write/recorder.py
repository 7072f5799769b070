"""The writer side of one rank: tables of RowLogs, one CSR offsets array per table, and the
commit record.

It runs in the rank's writer process (or in-process for tests and the CPU reference engine)
and is the only code that writes inside `rank{r}`. Data is written before the commit record
that covers it, so a reader that trusts only the commit record never sees a row that is not
on disk.
"""

from __future__ import annotations

import os
import time
from array import array
from bisect import bisect_right
from collections.abc import Callable
from typing import Any

import numpy as np
import zarr

from hstrace.errors import TraceError
from hstrace.trace.schema import (
    OFFSETS_ARRAY,
    OFFSETS_AXES_KEY,
    ROOT_KEY,
    STEP_AXIS,
    V1_TABLES,
    check_name,
    column_array,
)
from hstrace.trace.write.columns import ColumnSpec, describe, row_counts, spec_of
from hstrace.trace.write.rowlog import CR_WORDS, RowLog

# Commit at most this often when only whole units were written (tail flushes always commit).
COMMIT_INTERVAL_S = 0.25
# How often `tick` looks over every column for one to tail-flush (each step calls it; the ages
# it compares are seconds long, so a look per step cost the writer ~0.5 ms a step for nothing).
SCAN_INTERVAL_S = 0.05
# While the writer is draining a backlog, tail flushes wait up to this many times the age
# limit: a partial unit that keeps growing would otherwise be rewritten again and again,
# slowing the writer further exactly when it is already behind.
BACKLOG_AGE_FACTOR = 4.0


class TableLog:
    def __init__(
        self,
        rank_group: zarr.Group,
        name: str,
        spec: ColumnSpec,
        column_attrs: dict[str, dict] | None = None,
    ) -> None:
        check_name("table", name)
        axes = list(spec)
        if STEP_AXIS not in axes:
            raise TraceError(f"table {name!r}: a write needs at least one '{STEP_AXIS}' column")
        known = V1_TABLES.get(name)
        if known is not None and not set(axes) <= set(known):
            extra = sorted(set(axes) - set(known))
            raise TraceError(f"table {name!r} of schema v1 has no axis {extra} (axes: {known})")
        self.name = name
        self.spec = spec
        self.group = rank_group.create_group(
            name,
            attributes={
                ROOT_KEY: {
                    "axes": axes,
                    "columns": {
                        a: {
                            c: {"dtype": d, "logical_dtype": ld, "row_shape": list(rs)}
                            for c, (d, ld, rs) in cols.items()
                        }
                        for a, cols in spec.items()
                    },
                }
            },
        )
        column_attrs = column_attrs or {}
        self.cols: dict[str, dict[str, RowLog]] = {}
        for axis, cols in spec.items():
            check_name("axis", axis)
            self.cols[axis] = {}
            for col, (dtype, logical, row_shape) in cols.items():
                check_name("column", col)
                self.cols[axis][col] = RowLog(
                    self.group,
                    column_array(axis, col),
                    row_shape,
                    np.dtype(dtype),
                    logical,
                    column_attrs.get(f"{axis}/{col}"),
                )
        # One offsets array for all non-step axes: row s = where step s starts on each axis.
        # A step's offsets are one row, so they become durable together.
        self.off_axes = [a for a in axes if a != STEP_AXIS]
        self.offs: RowLog | None = None
        self.off_mem: dict[str, array] = {a: array("q", [0]) for a in self.off_axes}
        if self.off_axes:
            self.offs = RowLog(
                self.group,
                OFFSETS_ARRAY,
                (len(self.off_axes),),
                np.dtype(np.int64),
                "int64",
                {OFFSETS_AXES_KEY: list(self.off_axes)},
            )
            self.offs.append(np.zeros((1, len(self.off_axes)), np.int64))
        self.steps = 0
        self.rows = {axis: 0 for axis in spec}  # rows of each axis in complete steps
        self._layout: list | None = None
        self._fast: tuple | None = None

    def logs(self) -> dict[str, RowLog]:
        """Every array's RowLog, keyed as in the commit record ("offsets", "axis/column")."""
        out = {OFFSETS_ARRAY: self.offs} if self.offs is not None else {}
        for axis, cols in self.cols.items():
            out.update({f"{axis}/{c}": log for c, log in cols.items()})
        return out

    def layout(self) -> list[list[tuple[RowLog, int]]]:
        """Per axis in spec order, per column: (log, bytes per row): a step's columns as the
        writer process lays them out of the ring (cached: the columns are fixed at the first
        write)."""
        if self._layout is None:
            self._layout = [
                [(log, log.row_bytes) for log in cols.values()] for cols in self.cols.values()
            ]
        return self._layout

    def fast_state(self) -> tuple[list[tuple[RowLog, int]], int, np.ndarray, int]:
        """The table's columns in layout order as the writer's native step takes them
        (_native.c copy_rows): [(log, axis index)], the address of their state array (each
        log's CR_WORDS words: rowlog.py), and the array copy_rows lists the columns it left
        to Python in, with its address. Built at the first call; from then on each column
        keeps its words there."""
        if self._fast is None:
            flat = [(log, ai) for ai, logs in enumerate(self.layout()) for log, _ in logs]
            state = np.zeros((len(flat), CR_WORDS), np.int64)
            for i, (log, ai) in enumerate(flat):
                log.share_state(state[i], ai)
            slow = np.zeros((len(flat), 2), np.int64)
            self._fast_state = state  # (kept alive: its address is in _fast)
            self._fast = (flat, state.ctypes.data, slow, slow.ctypes.data)
        return self._fast

    def append(self, axis_rows: dict[str, dict[str, np.ndarray]], now: float) -> None:
        """Append one part of a step: for each axis present, rows of every column."""
        for axis, cols in axis_rows.items():
            mine = self.cols.get(axis)
            if mine is None or set(cols) != set(mine):
                raise TraceError(
                    f"table {self.name!r}: axis {axis!r} got columns {sorted(cols)}, "
                    f"but its first write fixed {sorted(mine or ())}"
                )
            for col, rows in cols.items():
                log = mine[col]
                if rows.dtype != log.dtype or rows.shape[1:] != log.row_shape:
                    raise TraceError(
                        f"table {self.name!r}: column {axis}/{col} got {rows.dtype}{list(rows.shape[1:])}, "
                        f"first write fixed {log.dtype}{list(log.row_shape)}"
                    )
                log.append(rows, now)

    def end_step(self, counts: dict[str, int], now: float) -> None:
        """Close a step: its rows on every axis are appended; now record the offsets."""
        for axis in self.off_axes:
            self.rows[axis] += int(counts.get(axis, 0))
            self.off_mem[axis].append(self.rows[axis])
        if self.offs is not None:
            row = np.array([[self.rows[a] for a in self.off_axes]], np.int64)
            self.offs.append(row, now)
        self.steps += 1

    def durable_steps(self) -> int:
        """Largest S such that step rows, offsets and every column cover steps [0, S)."""
        s = self.steps
        for log in self.cols[STEP_AXIS].values():
            s = min(s, log.stored)
        if self.offs is not None:
            s = min(s, self.offs.stored - 1)
        for axis in self.off_axes:
            limit = min((log.stored for log in self.cols[axis].values()), default=1 << 62)
            s = min(s, bisect_right(self.off_mem[axis], limit) - 1)
        return max(0, s)

    def commit_entry(self) -> dict[str, Any]:
        entry = {
            "steps": self.durable_steps(),
            "rows": {k: log.stored for k, log in self.logs().items()},
        }
        # Chunks the writer stored uncompressed (Blosc level 0) while behind the producer.
        raw = {k: log.raw_chunks for k, log in self.logs().items() if log.raw_chunks}
        if raw:
            entry["uncompressed_chunks"] = raw
        return entry


class RankRecorder:
    def __init__(self, path: str, rank: int, tail_flush_s: float = 2.0) -> None:
        # called before each column's tail flush (the writer process: wait, once, while the
        # producer's engine is early in a gap between two steps); None: flush at once
        self.gap_wait: Callable[[], None] | None = None
        try:
            root = zarr.open_group(path, mode="r+", use_consolidated=False)
        except Exception as exc:  # noqa: BLE001 - any failure here means "not a trace root"
            raise TraceError(
                f"{path}: cannot open the trace root for writing ({exc}); call create_trace first"
            ) from exc
        if ROOT_KEY not in root.attrs:
            raise TraceError(
                f"{path}: not an hstrace trace (no '{ROOT_KEY}' root attributes); call create_trace first"
            )
        name = f"rank{int(rank)}"
        if name in root:
            raise TraceError(f"{path}: {name} already exists; each rank records once per trace")
        # The claim: "exists? then create" races (two writers both pass the check, and one
        # writer's steps are silently lost, or zarr raises ContainsGroupError). mkdir of the
        # rank's directory is atomic: exactly one writer creates it.
        try:
            os.mkdir(os.path.join(os.fspath(path), name))
        except FileExistsError:
            raise TraceError(
                f"{path}: {name} is already claimed by another writer; each rank records once "
                "per trace"
            ) from None
        except OSError as exc:
            raise TraceError(f"{path}: cannot create {name} ({exc.strerror})") from None
        self.rank = int(rank)
        self.tail_flush_s = float(tail_flush_s)
        self.meta: dict[str, Any] = {
            "rank": self.rank,
            "static": {},
            "errors": [],
            "commit": {
                "tables": {},
                "dropped_steps": {},
                "clean_close": False,
                "updated_ns": time.time_ns(),
            },
        }
        self.group = root.create_group(name, attributes={ROOT_KEY: self.meta})
        self.tables: dict[str, TableLog] = {}
        self.dropped: dict[str, int] = {}
        self.last_commit = time.monotonic()
        self.last_scan = float("-inf")
        self.units_at_commit = 0
        self.closed = False
        self._logs: list[RowLog] | None = None  # every table's columns (fixed once created)

    # --- data -------------------------------------------------------------------------
    def table(
        self, name: str, spec: ColumnSpec, column_attrs: dict[str, dict] | None = None
    ) -> TableLog:
        t = self.tables.get(name)
        if t is None:
            t = self.tables[name] = TableLog(self.group, name, spec, column_attrs)
            self._logs = None
        elif spec != t.spec:
            raise TraceError(
                f"table {name!r}: columns {describe(spec)} differ from the first write's "
                f"{describe(t.spec)}"
            )
        return t

    def write_step(
        self,
        table: str,
        axis_rows: dict[str, dict[str, np.ndarray]],
        logical: dict[str, str] | None = None,
        column_attrs: dict[str, dict] | None = None,
    ) -> None:
        """Write one whole step (in-process mode and tests). `logical` maps "axis/column" to
        its logical dtype where it differs from the storage dtype (bf16 as uint16)."""
        spec = spec_of(axis_rows, logical)
        counts = row_counts(table, axis_rows)
        now = time.monotonic()
        t = self.table(table, spec, column_attrs)
        t.append(axis_rows, now)
        t.end_step(counts, now)
        self.tick(now)

    def set_dropped(self, dropped: dict[str, int]) -> None:
        self.dropped = dict(dropped)

    # --- durability -------------------------------------------------------------------
    def _all_logs(self) -> list[RowLog]:
        if self._logs is None:
            self._logs = [log for t in self.tables.values() for log in t.logs().values()]
        return self._logs

    def drain(self) -> None:
        """Write what the encoder and the I/O thread finished meanwhile (the idle loop)."""
        for log in self._all_logs():
            log.drain()  # returns at once when nothing of the column is in flight

    def next_deadline(self) -> float | None:
        """Monotonic time at which the oldest unwritten row reaches the tail-flush age."""
        oldest = min(
            (t for log in self._all_logs() if (t := log.dirty_since) is not None), default=None
        )
        return None if oldest is None else oldest + self.tail_flush_s

    def scan_due(self, now: float) -> bool:
        """Whether `tick` would look over the columns now (else it returns at once)."""
        return not 0 <= now - self.last_scan < SCAN_INTERVAL_S

    def tick(self, now: float | None = None, backlog: bool = False, due: bool = False) -> None:
        """Tail-flush columns whose oldest staged row is too old; commit what became durable.
        Rate-limited to a scan per SCAN_INTERVAL_S unless `due` (next_deadline has passed)."""
        now = time.monotonic() if now is None else now
        if not due and not self.scan_due(now):
            return
        self.last_scan = now
        max_age = self.tail_flush_s * (BACKLOG_AGE_FACTOR if backlog else 1.0)
        flushed = False
        wait = self.gap_wait
        for log in self._all_logs():
            if log.needs_tail_flush(now, max_age):
                if wait is not None:  # a column at a time, out of the engine's gaps
                    wait()
                flushed |= log.flush_tail()
        if flushed or (
            now - self.last_commit >= COMMIT_INTERVAL_S
            and sum(log.units_written for log in self._all_logs()) != self.units_at_commit
        ):
            self.commit()

    def commit(self, clean_close: bool = False) -> None:
        # Written after the data it describes; LocalStore replaces zarr.json atomically.
        self.meta["commit"] = {
            "tables": {name: t.commit_entry() for name, t in self.tables.items()},
            "dropped_steps": dict(self.dropped),
            "clean_close": clean_close,
            "updated_ns": time.time_ns(),
        }
        self._save_meta()
        self.last_commit = time.monotonic()
        self.units_at_commit = sum(log.units_written for log in self._all_logs())

    def _save_meta(self) -> None:
        self.group.attrs[ROOT_KEY] = self.meta

    # --- audit ------------------------------------------------------------------------
    def update_static(self, items: dict[str, Any]) -> None:
        self.meta["static"] = _deep_merge(self.meta["static"], items)
        self._save_meta()

    def note_error(self, tap: str, message: str) -> None:
        self.meta["errors"].append(
            {"tap": str(tap), "message": str(message), "t_ns": time.time_ns()}
        )
        self._save_meta()

    def close(self) -> None:
        if self.closed:
            return
        for log in self._all_logs():
            log.close()
        self.commit(clean_close=True)
        self.closed = True


def _deep_merge(base: dict, new: dict) -> dict:
    out = dict(base)
    for k, v in new.items():
        out[k] = (
            _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out
