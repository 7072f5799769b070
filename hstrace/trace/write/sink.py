"""Where a `TraceWriter` hands its validated steps: the sink interface and the two sinks that
need no writer process.

`TraceWriter` validates and plans (what a step is, the per-table column plan); a sink only
moves a planned step somewhere, the way httpx puts transports behind `BaseTransport`:

  RecorderSink   the RankRecorder on the caller's thread (tests, the CPU reference engine,
                 bundles): same on-disk result as the writer process
  ProcessSink    (hstrace/trace/write/process_sink.py) a shared-memory ring drained by the rank's
                 writer process: the serving path
  MemorySink     steps kept in RAM, readable back (tests)

A planned step is `arrays`, one per column of the table's plan in spec order, each holding
`counts[axis]` rows: a C-contiguous numpy array in the column's storage dtype, a contiguous
CPU tensor of the column's dtype (bf16 too), a CUDA tensor, or a Python int (one int64 row:
the `seq` / `t_ns` the writer fills in).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from hstrace.errors import TraceError
from hstrace.trace.write.columns import ColumnSpec
from hstrace.trace.write.protocol import Dropped, Error, Static


class TablePlan:
    """One table as its first write fixed it: the spec, and per column (in spec order) the
    axis index, storage dtype, row shape and row bytes every sink lays rows out by."""

    __slots__ = (
        "name",
        "spec",
        "column_attrs",
        "axes",
        "columns",
        "col_axis",
        "dtypes",
        "row_shapes",
        "row_bytes",
        "axis_row_bytes",
        "logical",
    )

    def __init__(self, name: str, spec: ColumnSpec, column_attrs: dict | None = None) -> None:
        self.name = name
        self.spec = spec
        self.column_attrs = column_attrs
        self.axes = list(spec)
        self.columns = [(a, c) for a, cc in spec.items() for c in cc]
        self.col_axis = [self.axes.index(a) for a, _ in self.columns]
        entries = [spec[a][c] for a, c in self.columns]
        self.dtypes = [np.dtype(storage) for storage, _, _ in entries]
        self.row_shapes = [tuple(rs) for _, _, rs in entries]
        self.row_bytes = [
            d.itemsize * math.prod(rs) for d, rs in zip(self.dtypes, self.row_shapes, strict=True)
        ]
        # Per column (axis index, row bytes): a step's byte sizes are counts[axis] * row bytes.
        self.axis_row_bytes = list(zip(self.col_axis, self.row_bytes, strict=True))
        # {"axis/column": logical} where it differs from the storage dtype (bf16 as uint16).
        self.logical = {
            f"{a}/{c}": spec[a][c][1] for a, c in self.columns if spec[a][c][1] != spec[a][c][0]
        }

    def axis_rows(
        self, arrays: list[Any], counts: tuple[int, ...], copy: bool = False
    ) -> dict[str, dict[str, np.ndarray]]:
        """A planned step as {axis: {column: rows}}, host numpy arrays in storage dtype."""
        out: dict[str, dict[str, np.ndarray]] = {a: {} for a in self.axes}
        for (axis, col), ai, dtype, rs, a in zip(
            self.columns, self.col_axis, self.dtypes, self.row_shapes, arrays, strict=True
        ):
            rows = host_array(a, dtype).reshape(counts[ai], *rs)
            out[axis][col] = rows.copy() if copy else rows
        return out


def host_array(a: Any, dtype: np.dtype) -> np.ndarray:
    """One planned column as a host numpy array in its storage dtype (bf16 as uint16 bits)."""
    if type(a) is int:
        return np.array([a], dtype)
    if isinstance(a, np.ndarray):
        return a
    t = a.detach().cpu().contiguous()
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def new_stats() -> dict[str, float]:
    """Backpressure seen by the producer and its time in the copy itself (docs/internal-api.md)."""
    return {"parts": 0, "blocked_parts": 0, "blocked_s": 0.0, "copy_s": 0.0}


class Sink:
    """What a TraceWriter writes through. Calls come one at a time (the writer's lock)."""

    stats: dict[str, float]

    @property
    def writer_pid(self) -> int | None:
        """The process that writes the trace, when it is not this one."""
        return None

    def write_step(
        self,
        plan: TablePlan,
        arrays: list[Any],
        counts: tuple[int, ...],
        host: bool,
        may_drop: bool,
    ) -> bool:
        """Take one step of `plan` (see the module docstring); `host`: every array is in host
        memory. Returns False if the step was dropped (only when `may_drop`: no room)."""
        raise NotImplementedError

    def fast_step(self, plan: TablePlan, columns: list) -> Any:
        """Optional: a callable `(seq, step, req, tok, other_axes) -> True | None` that checks a
        repeated step of `plan` against `columns` (the writer's fast-path checks, see
        writer._Matcher) and takes it whole in one call, or returns None without a side
        effect (then the writer does its own checks and calls write_step). None: no such
        route (the default)."""
        return None

    def control(self, msg: Static | Error | Dropped) -> None:
        """Audit items, a disabled tap, or the dropped-step counts so far."""
        raise NotImplementedError

    def flush(self, dropped: dict[str, int]) -> None:
        """Everything taken so far is durable and committed when this returns."""
        raise NotImplementedError

    def close(self, dropped: dict[str, int]) -> None:
        """Flush, trim, commit with clean_close=True; release what the sink holds."""
        raise NotImplementedError


class RecorderSink(Sink):
    """Writes through a RankRecorder on the caller's thread."""

    def __init__(self, path: str, rank: int, tail_flush_s: float = 2.0) -> None:
        from hstrace.trace.write.recorder import RankRecorder

        self.path, self.rank = path, rank
        self.recorder = RankRecorder(path, rank, tail_flush_s=tail_flush_s)
        self.stats = new_stats()
        self.fault: str | None = None  # once the disk refused: every later call says so

    def _io(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)`; an OSError (disk full, read-only remount, I/O error) stops recording as
        the writer process does: a TraceError naming the path, the cause and what the trace
        kept on disk, raised again by every later call (close included)."""
        if self.fault is not None:
            raise TraceError(self.fault)
        try:
            return fn(*args)
        except OSError as exc:
            from hstrace.trace.write.writer_process import _describe_os_error, _kept

            for log in self.recorder._all_logs():
                try:
                    log.abort()  # our temp files: space back on a full disk
                except OSError:
                    pass
            self.fault = (
                f"{self.path}: rank {self.rank} stopped recording: {_describe_os_error(exc)}; "
                f"kept: {_kept(self.path, self.rank)}"
            )
            raise TraceError(self.fault) from exc

    def write_step(
        self,
        plan: TablePlan,
        arrays: list[Any],
        counts: tuple[int, ...],
        host: bool,
        may_drop: bool,
    ) -> bool:
        self._io(
            self.recorder.write_step,
            plan.name,
            plan.axis_rows(arrays, counts),
            plan.logical,
            plan.column_attrs,
        )
        self.stats["parts"] += 1
        return True

    def control(self, msg: Static | Error | Dropped) -> None:
        if isinstance(msg, Static):
            self._io(self.recorder.update_static, msg.items)
        elif isinstance(msg, Error):
            self._io(self.recorder.note_error, msg.tap, msg.message)
        else:
            self._io(self.recorder.set_dropped, msg.counts)

    def flush(self, dropped: dict[str, int]) -> None:
        def flush() -> None:
            self.recorder.set_dropped(dropped)
            for log in self.recorder._all_logs():
                log.flush_tail()
            self.recorder.commit()

        self._io(flush)

    def close(self, dropped: dict[str, int]) -> None:
        def close() -> None:
            self.recorder.set_dropped(dropped)
            self.recorder.close()

        self._io(close)


class MemorySink(Sink):
    """Keeps every step in RAM (copies: the producer may reuse its buffers), for tests.

    tables[name] = {"spec", "column_attrs", "steps": [{axis: {column: rows}}]}; `column`
    concatenates one column over the steps. Rows are in storage dtype (bf16 as uint16 bits)."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, Any]] = {}
        self.static: dict[str, Any] = {}
        self.errors: list[tuple[str, str]] = []
        self.dropped: dict[str, int] = {}
        self.flushes = 0
        self.closed = False
        self.stats = new_stats()

    def write_step(
        self,
        plan: TablePlan,
        arrays: list[Any],
        counts: tuple[int, ...],
        host: bool,
        may_drop: bool,
    ) -> bool:
        if self.closed:
            raise TraceError("memory sink: closed")
        t = self.tables.setdefault(
            plan.name, {"spec": plan.spec, "column_attrs": plan.column_attrs, "steps": []}
        )
        t["steps"].append(plan.axis_rows(arrays, counts, copy=True))
        self.stats["parts"] += 1
        return True

    def control(self, msg: Static | Error | Dropped) -> None:
        if isinstance(msg, Static):
            self.static.update(msg.items)
        elif isinstance(msg, Error):
            self.errors.append((msg.tap, msg.message))
        else:
            self.dropped = dict(msg.counts)

    def flush(self, dropped: dict[str, int]) -> None:
        self.dropped = dict(dropped)
        self.flushes += 1

    def close(self, dropped: dict[str, int]) -> None:
        self.dropped = dict(dropped)
        self.closed = True

    def column(self, table: str, axis: str, column: str) -> np.ndarray:
        steps = self.tables[table]["steps"]
        storage, _, rs = self.tables[table]["spec"][axis][column]
        parts = [s[axis][column] for s in steps]
        return np.concatenate(parts) if parts else np.empty((0, *rs), storage)
