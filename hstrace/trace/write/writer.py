"""The producer side: `TraceWriter` validates and plans each step, then hands it to a sink.

Validation and planning live here: what a step is (normalise: tensors and arrays to rows,
step-axis values one row each, `seq` / `t_ns` filled in), the per-table plan its first write
fixes (sink.py `TablePlan`), the one schema check (columns.py), and a fast path that checks
a repeated step against a cached per-table matcher. Where the step goes is the sink's business
(sink.py, chosen by `default_sink` below): by default the shared-memory ring of the rank's
writer process (`process=True`, process_sink.py), or the
RankRecorder on the caller's thread (`process=False`: tests, the CPU reference engine,
bundles); `sink=` takes any other (a `MemorySink` in tests).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import numpy as np
import torch

from hstrace.errors import TraceError
from hstrace.trace.schema import AUTO_STEP_COLUMNS, SCALAR_STEP_COLUMNS, STEP_AXIS
from hstrace.trace.write.columns import (
    AxisRows,
    ColumnSpec,
    check_names,
    describe,
    row_counts,
    spec_of,
)
from hstrace.trace.write.protocol import Dropped, Error, Static
from hstrace.trace.write.sink import RecorderSink, Sink, TablePlan


def _as_rows(value: Any, where: str) -> tuple[Any, str | None]:
    """(CPU numpy array or CUDA tensor, logical dtype if it differs from the storage dtype).

    CPU data becomes a numpy view right away: numpy's copies are single-threaded memcpys,
    while torch's fan out to intra-op threads (tens of ms of stalls on a busy host)."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.is_cuda:
            return t, ("bfloat16" if t.dtype == torch.bfloat16 else None)
        if t.dtype == torch.bfloat16:
            return _contiguous(t.view(torch.uint16).numpy()), "bfloat16"
        return _contiguous(t.numpy()), None
    try:
        return _contiguous(np.asarray(value)), None
    except (TypeError, ValueError) as exc:
        raise TraceError(
            f"{where}: cannot convert {type(value).__name__} to an array ({exc})"
        ) from exc


def _plain(x: Any) -> Any:
    if hasattr(x, "tolist"):  # numpy scalars and arrays, small tensors
        return x.tolist()
    raise TypeError(f"{type(x).__module__}.{type(x).__qualname__} is not plain data")


def plain_static(items: dict[str, Any]) -> dict[str, Any]:
    """Audit items as plain JSON data, what zarr.json will hold. The writer process unpickles
    what it is sent: a `torch.__version__` (a `TorchVersion`, a str subclass) made it import
    torch, 4 CPU-seconds taken from serving at every arm (bench/live_overhead.py)."""
    try:
        return json.loads(json.dumps(dict(items), default=_plain))
    except (TypeError, ValueError) as exc:
        raise TraceError(f"static audit items must be JSON data: {exc}") from None


def _contiguous(a: np.ndarray) -> np.ndarray:
    # Not np.ascontiguousarray: it turns a 0-d scalar into shape (1,).
    return a if a.flags.c_contiguous else a.copy(order="C")


def normalise(
    table: str, axes: dict[str, dict[str, Any] | None], seq: int, t_ns: int
) -> tuple[AxisRows, dict[str, str]]:
    """({axis: {column: rows on dim 0}}, {"axis/column": logical dtype} for bf16 columns).
    Step-axis values are one row each; rows are numpy arrays, or tensors on CUDA."""
    out: AxisRows = {}
    logical: dict[str, str] = {}
    for axis, cols in axes.items():
        if cols is None:
            continue
        out[axis] = {}
        for col, value in cols.items():
            a, ld = _as_rows(value, f"table {table!r} column {axis}/{col}")
            if ld is not None:
                logical[f"{axis}/{col}"] = ld
            if axis == STEP_AXIS and col in SCALAR_STEP_COLUMNS:
                if a.size != 1:
                    raise TraceError(
                        f"table {table!r} column step/{col}: one scalar per step, got shape {a.shape}"
                    )
                a = a.reshape(1)
            elif axis == STEP_AXIS:
                a = a.reshape(1, *a.shape)
            elif a.ndim == 0:
                raise TraceError(
                    f"table {table!r} column {axis}/{col}: needs a row dimension, got a scalar"
                )
            out[axis][col] = a
    step = out.setdefault(STEP_AXIS, {})
    if "seq" not in step:
        step["seq"] = np.array([seq], np.int64)
    if "t_ns" not in step:
        step["t_ns"] = np.array([t_ns], np.int64)
    return out, logical


def _ordered(spec: ColumnSpec) -> list:
    # Column order is part of a table's layout (the ring's one-part steps rely on it).
    return [(a, list(cc.items())) for a, cc in spec.items()]


def _ignore_phase(running: bool) -> None:
    """A sink's `step_phase` where it has none."""


class TraceWriter:
    """Writes one rank's events into an existing trace (see `create_trace`).

    on_full: what `write` does when the staging ring is full: "block" waits for the
    writer process; "drop" drops the step and counts it (per table) in the trace.
    process: the writer-process sink (True) or the in-process recorder (False); sink: an
    explicit sink instead (then process and the staging keywords are not used).
    raw_when_behind: while the writer is behind, store chunks uncompressed (counted in the
    commit record) as long as the trace stays within rowlog.DISK_BUDGET of its raw size;
    raw_beyond_budget: beyond that budget too once the ring is nearly full (not making the
    server wait comes first), or (False) never: the budget holds and the producer waits.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        rank: int = 0,
        on_full: str = "block",
        tail_flush_s: float = 2.0,
        process: bool = True,
        staging_bytes: int = 256 << 20,
        max_part_bytes: int = 16 << 20,
        compress_threads: int = 2,
        raw_when_behind: bool = True,
        raw_beyond_budget: bool = True,
        sink: Sink | None = None,
    ) -> None:
        if on_full not in ("block", "drop"):
            raise TraceError(f"on_full must be 'block' or 'drop', got {on_full!r}")
        self.path = str(path)
        self.rank = int(rank)
        self.on_full = on_full
        self._may_drop = on_full == "drop"
        self.dropped: dict[str, int] = {}
        self._seq = 0
        self._plans: dict[str, TablePlan] = {}
        # Per-table checks of the fast path, from the first write (None: always the slow path).
        self._matchers: dict[str, _Matcher | None] = {}
        self._lock = threading.Lock()
        self._closed = False
        if sink is None:
            sink = default_sink(
                self.path,
                self.rank,
                tail_flush_s,
                process,
                staging_bytes=staging_bytes,
                max_part_bytes=max_part_bytes,
                compress_threads=compress_threads,
                raw_when_behind=raw_when_behind,
                raw_beyond_budget=raw_beyond_budget,
            )
        self.sink = sink
        self.stats = sink.stats
        # the engine's step started / ended (`Recorder.step_started`): a sink that keeps its
        # work out of the engine's gaps has it (ProcessSink), another ignores it
        self.step_phase = getattr(sink, "step_phase", _ignore_phase)

    @property
    def writer_pid(self) -> int | None:
        return self.sink.writer_pid

    # --- producer API -----------------------------------------------------------------
    def write(
        self,
        table: str,
        step: dict[str, Any] | None = None,
        req: dict[str, Any] | None = None,
        tok: dict[str, Any] | None = None,
        column_attrs: dict[str, dict] | None = None,
        **other_axes: dict[str, Any],
    ) -> bool:
        """Record one event (a step) of `table`. Returns False if it was dropped (on_full="drop")."""
        with self._lock:
            if self._closed:
                raise TraceError(f"{self.path}: rank {self.rank} writer is closed")
            m = self._matchers.get(table)
            if m is not None:
                # The sink's one-call route (the native build: checks, copy and publish in C),
                # else the same checks here and the sink's write_step.
                fast = m.fast
                if fast is not None and fast(self._seq, step, req, tok, other_axes):
                    self._seq += 1
                    return True
                hit = m.match(self._seq, step, req, tok, other_axes)
            else:
                hit = None
            if hit is not None:
                plan, (arrays, counts), host = m.plan, hit, True
            else:
                plan, arrays, counts, host = self._plan_step(
                    table, step, req, tok, column_attrs, other_axes
                )
            self._seq += 1  # a dropped step leaves its gap in seq
            kept = self.sink.write_step(plan, arrays, counts, host, self._may_drop)
            if table not in self._plans:  # the sink took the table's first step
                self._plans[table] = plan
                self._matchers[table] = m = _Matcher.of(plan, step or {})
                if m is not None:
                    m.fast = self.sink.fast_step(plan, m.axes)
            if not kept:
                self.dropped[table] = self.dropped.get(table, 0) + 1
                self.sink.control(Dropped(dict(self.dropped)))
            return kept

    def _plan_step(
        self,
        table: str,
        step: dict[str, Any] | None,
        req: dict[str, Any] | None,
        tok: dict[str, Any] | None,
        column_attrs: dict[str, dict] | None,
        other_axes: dict[str, dict[str, Any]],
    ) -> tuple[TablePlan, list[Any], tuple[int, ...], bool]:
        """The general path: normalise, check against the table's plan (or make it)."""
        axes = {STEP_AXIS: step or {}, "req": req, "tok": tok, **other_axes}
        cols, logical = normalise(table, axes, self._seq, time.time_ns())
        counts = row_counts(table, cols)
        spec = spec_of(cols, logical)
        plan = self._plans.get(table)
        if plan is None:
            check_names(table, spec)
            plan = TablePlan(table, spec, column_attrs)
        elif _ordered(spec) != _ordered(plan.spec):
            raise TraceError(
                f"table {table!r}: columns {describe(spec)} differ from the first write's "
                f"{describe(plan.spec)}"
            )
        arrays = [cols[a][c] for a, c in plan.columns]
        host = not any(isinstance(x, torch.Tensor) for x in arrays)  # CPU data is numpy now
        return plan, arrays, tuple(counts[a] for a in plan.axes), host

    def update_static(self, items: dict[str, Any]) -> None:
        """Merge audit items into this rank's `static` attributes (the reader merges ranks)."""
        items = plain_static(items)
        with self._lock:
            self.sink.control(Static(items))

    def note_error(self, tap: str, message: str) -> None:
        """Record that a tap failed and was disabled; `hstrace show` lists these."""
        with self._lock:
            self.sink.control(Error(str(tap), str(message)))

    def flush(self) -> None:
        """Make everything written so far durable and committed (waits for the writer)."""
        with self._lock:
            self.sink.flush(dict(self.dropped))

    def close(self) -> None:
        """Flush, trim shapes, and commit with clean_close=True."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.sink.close(dict(self.dropped))

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Matcher:
    """The fast path's check of a repeated step of one table: per axis (in spec order) the
    producer's columns with their torch dtype, numpy dtype (None: tensors only, e.g. bf16)
    and row shape, and the step columns the writer fills in. A step that passes has exactly
    the first write's columns, dtypes and row shapes, contiguous on the CPU, so it goes to
    the sink as it is; anything else takes the general path, which stages it or raises."""

    __slots__ = ("plan", "axes", "n_axes", "fast")

    def __init__(self, plan: TablePlan, axes: list) -> None:
        self.plan = plan
        self.fast: Any = None  # the sink's one-call route for these checks (Sink.fast_step)
        # [(axis, ((column, torch dtype, numpy dtype | None, row_shape, width, int_ok), ...),
        #   n, auto)]
        self.axes = axes
        self.n_axes = len(axes)

    @staticmethod
    def of(plan: TablePlan, step: dict[str, Any]) -> _Matcher | None:
        auto = tuple(c for c in AUTO_STEP_COLUMNS if c not in step)
        if auto and list(plan.spec[STEP_AXIS])[-len(auto) :] != list(auto):
            return None
        axes = []
        for axis, cc in plan.spec.items():
            cols = []
            for col, (storage, logical, row_shape) in cc.items():
                if axis == STEP_AXIS and col in auto:
                    continue
                ndtype = np.dtype(storage)
                if ndtype.kind == "c":
                    return None  # complex tensors may carry lazy conj/neg bits
                tdtype = torch.bfloat16 if logical == "bfloat16" else _TORCH_DTYPES.get(ndtype)
                if tdtype is None:
                    return None
                numpy_ok = ndtype if logical == storage else None
                rs = torch.Size(row_shape)
                # How `match` checks the shape: -1 the step row itself, 0 scalar rows, > 0 the
                # width of 1-d rows, -2 anything wider.
                width = -1 if axis == STEP_AXIS else {0: 0, 1: rs[0] if rs else 0}.get(len(rs), -2)
                # A Python int fits an int64 scalar step column as it is (the sinks store an
                # int as one int64 row): no 0-d numpy array made and checked per step.
                int_ok = width == -1 and not rs and numpy_ok == np.int64
                cols.append((col, tdtype, numpy_ok, rs, width, int_ok))
            axes.append((axis, tuple(cols), len(cols), auto if axis == STEP_AXIS else ()))
        return _Matcher(plan, axes)

    def match(
        self,
        seq: int,
        step: dict[str, Any] | None,
        req: dict[str, Any] | None,
        tok: dict[str, Any] | None,
        other_axes: dict[str, dict[str, Any]],
    ) -> tuple[list[Any], tuple[int, ...]] | None:
        """(arrays, counts) in plan order, or None: not this path. (Per column this is a few
        attribute reads: it runs for every column of every step.)"""
        given = 1 + (req is not None) + (tok is not None)
        if other_axes:
            given += sum(v is not None for v in other_axes.values())
        if given != self.n_axes:
            return None
        arrays: list[Any] = []
        counts: list[int] = []
        for axis, cols, n_cols, auto in self.axes:
            if axis == STEP_AXIS:
                values = step or {}
            elif axis == "req":
                values = req
            elif axis == "tok":
                values = tok
            else:
                values = other_axes.get(axis)
            if values is None or len(values) != n_cols:
                return None
            n = -1
            for col, tdtype, ndtype, row_shape, width, int_ok in cols:
                v = values.get(col)
                tv = type(v)
                if tv is int and int_ok:
                    if not _INT64_MIN <= v <= _INT64_MAX:
                        return None  # the general path names it
                    if n != 1:
                        if n >= 0:
                            return None
                        n = 1
                    arrays.append(v)
                    continue
                if tv is torch.Tensor:
                    if v.dtype is not tdtype or not v.is_cpu or not v.is_contiguous():
                        return None
                elif v is None or ndtype is None or isinstance(v, torch.Tensor):
                    return None  # bf16 columns take only tensors here; subclasses go the long way
                else:
                    try:
                        v = np.asarray(v)
                    except (TypeError, ValueError):
                        return None
                    if v.dtype != ndtype or not v.flags.c_contiguous:
                        return None
                shape = v.shape
                if width == -1:  # a step-axis column: the row itself
                    if shape != row_shape:
                        return None
                    rows = 1
                elif width == 0:  # one value per row
                    if len(shape) != 1:
                        return None
                    rows = shape[0]
                elif width > 0:  # rows of one dimension (no slicing: a torch.Size slice costs)
                    if len(shape) != 2 or shape[1] != width:
                        return None
                    rows = shape[0]
                else:
                    if len(shape) != len(row_shape) + 1 or shape[1:] != row_shape:
                        return None
                    rows = shape[0]
                if n != rows:
                    if n >= 0:
                        return None  # ragged axis: the general path names the columns
                    n = rows
                arrays.append(v)
            for c in auto:  # seq and t_ns close the step axis, in that order
                arrays.append(seq if c == "seq" else time.time_ns())
            counts.append(1 if axis == STEP_AXIS else max(n, 0))
        return arrays, tuple(counts)


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1

_TORCH_DTYPES = {
    np.dtype(n): getattr(torch, n)
    for n in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
        "uint16",
        "uint32",
        "uint64",
    )
}


def default_sink(
    path: str | os.PathLike, rank: int, tail_flush_s: float, process: bool, **process_kw: Any
) -> Sink:
    """The sink `TraceWriter(process=...)` has always meant (here, not in sink.py: the process
    sink builds on sink.py, which so never imports it back)."""
    if not process:
        return RecorderSink(str(path), rank, tail_flush_s)
    from hstrace.trace.write.process_sink import ProcessSink

    return ProcessSink(str(path), rank, tail_flush_s=tail_flush_s, **process_kw)
