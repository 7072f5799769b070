"""The producer side: `TraceWriter.write` copies tensors into staging and returns.

In process mode (the default) the copy goes into a shared-memory byte ring and a small
message goes down a pipe to the rank's writer process, which does all compression and I/O.
The serving thread pays a memcpy (or an async D2H copy on CUDA) plus a pipe write. A step
larger than `max_part_bytes` (a prefill of thousands of tokens) is split by rows into several
parts. In-process mode
(`process=False`) writes through the same RankRecorder on the caller's thread: same on-disk
result, for tests and the CPU reference engine.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import multiprocessing as mp
import os
import pickle
import queue
import select
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np
import torch

from hstrace.errors import TraceError
from hstrace.trace.schema import AUTO_STEP_COLUMNS, SCALAR_STEP_COLUMNS, STEP_AXIS, check_name

ALIGN = 64
# Where the hstrace package lives, so the writer process imports this very copy.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Seconds to wait for the writer process to start (spawn imports numpy and zarr).
START_TIMEOUT_S = 120.0

Columns = dict[str, dict[str, torch.Tensor]]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _storage(t: torch.Tensor) -> tuple[str, str]:
    """(storage dtype name, logical dtype name) of a tensor; bf16 travels as uint16 bits."""
    if t.dtype == torch.bfloat16:
        return "uint16", "bfloat16"
    name = str(t.dtype).removeprefix("torch.")
    return name, name


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


def _contiguous(a: np.ndarray) -> np.ndarray:
    # Not np.ascontiguousarray: it turns a 0-d scalar into shape (1,).
    return a if a.flags.c_contiguous else a.copy(order="C")


def normalise(
    table: str, axes: dict[str, dict[str, Any] | None], seq: int, t_ns: int
) -> tuple[Columns, dict[str, str]]:
    """({axis: {column: rows on dim 0}}, {"axis/column": logical dtype} for bf16 columns).
    Step-axis values are one row each; rows are numpy arrays, or tensors on CUDA."""
    out: Columns = {}
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


def spec_of(
    cols: Columns, logical: dict[str, str]
) -> dict[str, dict[str, tuple[str, str, tuple[int, ...]]]]:
    spec: dict[str, dict[str, tuple[str, str, tuple[int, ...]]]] = {}
    for axis, cc in cols.items():
        spec[axis] = {}
        for c, a in cc.items():
            storage = _storage(a)[0] if isinstance(a, torch.Tensor) else str(a.dtype)
            spec[axis][c] = (storage, logical.get(f"{axis}/{c}", storage), tuple(a.shape[1:]))
    return spec


def counts_of(table: str, cols: Columns) -> dict[str, int]:
    counts: dict[str, int] = {}
    for axis, cc in cols.items():
        lens = {c: int(a.shape[0]) for c, a in cc.items()}
        if len(set(lens.values())) > 1:
            raise TraceError(
                f"table {table!r}: columns on axis {axis!r} have different row counts {lens}"
            )
        counts[axis] = next(iter(lens.values()), 0)
    return counts


def to_numpy(a: Any) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    t = a.detach().cpu().contiguous()
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _nbytes(a: Any) -> int:
    return a.nbytes if isinstance(a, np.ndarray) else a.numel() * a.element_size()


class TraceWriter:
    """Writes one rank's events into an existing trace (see `create_trace`).

    on_full: what `write` does when the staging ring is full: "block" waits for the
    writer process; "drop" drops the step and counts it (per table) in the trace.
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
    ) -> None:
        if on_full not in ("block", "drop"):
            raise TraceError(f"on_full must be 'block' or 'drop', got {on_full!r}")
        self.path = str(path)
        self.rank = int(rank)
        self.on_full = on_full
        self.process = process
        self.dropped: dict[str, int] = {}
        self._seq = 0
        self._specs: dict[str, dict] = {}
        self._sigs: dict[str, tuple] = {}
        # Per-table copy plans for the fast path, built from the first write (see _Plan).
        self._plans: dict[str, _Plan] = {}
        self._lock = threading.Lock()
        self._closed = False
        # Set once the writer process reports that the trace cannot be written any more.
        self._fault: str | None = None
        if not process:
            from hstrace.trace.recorder import RankRecorder

            self._rec = RankRecorder(self.path, self.rank, tail_flush_s=tail_flush_s)
            return
        self._ring_bytes = _align(int(staging_bytes))
        self._part_bytes = min(_align(int(max_part_bytes)), self._ring_bytes // 2)
        # The ring, then ALIGN bytes whose first int64 is the head counter (the writer process
        # reads it to know how far behind it is).
        self._shm = _Segment(self._ring_bytes + ALIGN)
        # A writer dropped without close() (a crashed caller, a test) must still release its
        # segment: its memory is not freed while the process lives on.
        self._release = weakref.finalize(self, _release_segment, self._shm)
        whole = _unexported_view(self._shm.mmap, self._shm.size)
        self._ring_np = whole[: self._ring_bytes]
        self._ring_i64 = self._ring_np.view(np.int64)
        self._head_np = whole[self._ring_bytes : self._ring_bytes + 8].view(np.int64)
        self._ring = torch.from_numpy(self._ring_np)
        self._ring_addr = self._ring.data_ptr()
        self._ring.zero_()  # pre-fault the pages now, not on the serving thread's first steps
        # FIFO byte ring: bytes [tail, head) (monotonic counters) are in flight to the writer,
        # which hands back the counter of each part it has consumed.
        self._head = 0
        self._tail = 0
        self.stats = {"parts": 0, "blocked_parts": 0, "blocked_s": 0.0, "copy_s": 0.0}
        self._pending_control: list[tuple] = []  # control replies read while waiting for room
        self._announced: set[str] = set()
        self._pinned = False
        self._completer: _CudaCompleter | None = None
        data_r, self._data_w = mp.Pipe(duplex=False)
        self._free_r, free_w = mp.Pipe(duplex=False)
        # select.poll on the raw fd: Connection.poll goes through selectors (tens of us a call).
        self._free_poll = select.poll()
        self._free_poll.register(self._free_r.fileno(), select.POLLIN)
        # Ring space comes back as raw 8-byte counters on a pipe of their own: one
        # non-blocking read takes all of them (a pickled message each cost a poll, two reads
        # and an unpickle per part on the serving thread).
        self._ends_r, ends_w = os.pipe()
        os.set_blocking(self._ends_r, False)
        self._wait_poll = select.poll()
        self._wait_poll.register(self._free_r.fileno(), select.POLLIN)
        self._wait_poll.register(self._ends_r, select.POLLIN)
        self._dropped_sent: dict[str, int] = {}
        args = [
            self.path,
            str(self.rank),
            str(float(tail_flush_s)),
            self._shm.arg,
        ]
        args += [str(data_r.fileno()), str(free_w.fileno()), str(ends_w)]
        args += [str(max(0, int(compress_threads))), "1" if raw_when_behind else "0"]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "hstrace.trace.writer_process", *args],
            pass_fds=(data_r.fileno(), free_w.fileno(), ends_w, *self._shm.pass_fds()),
            env=env,
        )
        data_r.close()
        free_w.close()
        os.close(ends_w)
        try:
            reply = self._wait_control(("ready", "failed"), START_TIMEOUT_S)
        except BaseException:
            self._teardown()
            raise
        if reply[0] == "failed":
            self._teardown()
            raise TraceError(reply[1])
        # Both sides have the ring mapped: drop its name / our descriptor now, so no kill of
        # the producer, the writer or their whole process group can leak it (issue 12, item 6).
        self._shm.mapped_by_both()

    @property
    def writer_pid(self) -> int | None:
        return self._proc.pid if self.process else None

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
            if self._fault is not None:
                raise TraceError(self._fault)
            plan = self._plans.get(table)
            if plan is not None:
                staged = self._fast_write(plan, step, req, tok, other_axes)
                if staged is not None:
                    return staged
            seq, self._seq = self._seq, self._seq + 1
            cols, logical = normalise(
                table,
                {STEP_AXIS: step or {}, "req": req, "tok": tok, **other_axes},
                seq,
                time.time_ns(),
            )
            counts = counts_of(table, cols)
            # Cheap signature check on the hot path; the string spec is built on first use.
            # (np.dtype compares equal to its name, so CPU and CUDA writes of a table agree.)
            sig = tuple(
                (a, c, x.dtype if isinstance(x, np.ndarray) else _storage(x)[0], tuple(x.shape[1:]))
                for a, cc in cols.items()
                for c, x in cc.items()
            )
            sig += tuple(sorted(logical.items()))
            if table not in self._specs:
                check_name("table", table)
                for axis, cc in cols.items():
                    check_name("axis", axis)
                    for col in cc:
                        check_name("column", col)
                self._specs[table] = spec_of(cols, logical)
                self._sigs[table] = sig
            spec = known = self._specs[table]
            if sig != self._sigs[table]:
                spec = spec_of(cols, logical)
                raise TraceError(
                    f"table {table!r}: columns {_describe(spec)} differ from the first write's {_describe(known)}"
                )
            if not self.process:
                try:
                    self._rec.write_step(
                        table,
                        {a: {c: to_numpy(t) for c, t in cc.items()} for a, cc in cols.items()},
                        logical,
                        column_attrs,
                    )
                except OSError as exc:
                    raise TraceError(
                        f"{self.path}: rank {self.rank}: cannot write ({exc})"
                    ) from exc
                return True
            staged = self._stage(table, cols, counts, spec, column_attrs)
            if table not in self._plans and table in self._announced:
                self._plans[table] = _Plan.of(table, spec, step or {})
            return staged

    def update_static(self, items: dict[str, Any]) -> None:
        """Merge audit items into this rank's `static` attributes (the reader merges ranks)."""
        self._control(("static", dict(items)))

    def note_error(self, tap: str, message: str) -> None:
        """Record that a tap failed and was disabled; `hstrace show` lists these."""
        self._control(("error", str(tap), str(message)))

    def flush(self) -> None:
        """Make everything written so far durable and committed (waits for the writer)."""
        if not self.process:
            with self._lock:
                for log in self._rec._all_logs():
                    log.flush_tail()
                self._rec.commit()
            return
        self._send(("flush",))
        self._wait_control(("flushed",), None)

    def close(self) -> None:
        """Flush, trim shapes, and commit with clean_close=True."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self.process:
                self._rec.set_dropped(self.dropped)
                self._rec.close()
                return
            try:
                if self._fault is None:
                    self._poll_free()
                if self._fault is not None:
                    raise TraceError(self._fault)
                self._send(("close", dict(self.dropped)))
                self._wait_control(("closed",), None)
                self._proc.wait(timeout=60)
            finally:
                self._teardown()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- staging ----------------------------------------------------------------------
    def _fast_write(
        self,
        plan: _Plan,
        step: dict[str, Any] | None,
        req: dict[str, Any] | None,
        tok: dict[str, Any] | None,
        other_axes: dict[str, dict[str, Any]],
    ) -> bool | None:
        """One step of a known table on CPU, in one ring part: a memmove per column, one pipe
        write. None: not this path (CUDA, another layout, a split step); the generic path
        then stages it or raises the error it would always have raised."""
        if self._completer is not None:
            return None  # CUDA copies in flight: messages must stay in order behind them
        given = {STEP_AXIS: step or {}, "req": req, "tok": tok, **other_axes}
        if sum(v is not None for v in given.values()) != len(plan.axes):
            return None
        seq_at = 0
        srcs: list[tuple[int, Any, int]] = []  # (offset in part, source, bytes)
        counts: list[int] = []
        used = 0
        for axis, cols, n_cols in plan.axes:
            values = given.get(axis)
            if values is None or len(values) != n_cols:
                return None
            n = -1
            for col, tdtype, ndtype, row_shape, row_bytes in cols:
                v = values.get(col)
                if v is None:
                    return None
                if type(v) is torch.Tensor:
                    if v.dtype is not tdtype or not v.is_cpu or not v.is_contiguous():
                        return None
                    shape = v.shape
                    src: Any = v.data_ptr()
                else:
                    # bf16 columns take only tensors here; tensor subclasses go the long way.
                    if ndtype is None or isinstance(v, torch.Tensor):
                        return None
                    try:
                        v = np.asarray(v)
                    except (TypeError, ValueError):
                        return None
                    if v.dtype != ndtype or not v.flags.c_contiguous:
                        return None
                    shape = v.shape
                    src = v
                if axis == STEP_AXIS:
                    if shape != row_shape:
                        return None
                    rows = 1
                else:
                    if len(shape) != len(row_shape) + 1 or shape[1:] != row_shape:
                        return None
                    rows = shape[0]
                if n != rows:
                    if n >= 0:
                        return None  # ragged axis: the generic path names the columns
                    n = rows
                nbytes = rows * row_bytes
                srcs.append((used, src, nbytes))
                used += -(-nbytes // ALIGN) * ALIGN
            if axis == STEP_AXIS and plan.auto_seq:
                seq_at = used
                used += 2 * ALIGN
            counts.append(max(n, 0) if axis != STEP_AXIS else 1)
        if used > self._part_bytes:
            return None
        seq, self._seq = self._seq, self._seq + 1  # a dropped step leaves its gap in seq
        base = self._allocate(used, may_drop=self.on_full == "drop")
        if base is None:
            self.dropped[plan.table] = self.dropped.get(plan.table, 0) + 1
            return False
        addr = self._ring_addr + base
        t0 = time.perf_counter()
        for offset, src, nbytes in srcs:
            if not nbytes:
                continue
            if type(src) is int:
                ctypes.memmove(addr + offset, src, nbytes)  # one single-threaded memcpy
            else:
                lo = base + offset
                self._ring_np[lo : lo + nbytes] = src.reshape(-1).view(np.uint8)
        self.stats["copy_s"] += time.perf_counter() - t0  # the memcpy itself (bench/README.md)
        if plan.auto_seq:
            # seq and t_ns close the step axis, in that order (as the generic path appends them).
            # (an int64 view: struct.pack_into on the mmap costs ~15 us a call here)
            i = (base + seq_at) >> 3
            self._ring_i64[i] = seq
            self._ring_i64[i + (ALIGN >> 3)] = time.time_ns()
        dropped = None
        if self.dropped != self._dropped_sent:
            dropped = self._dropped_sent = dict(self.dropped)
        msg = ("step", plan.table, base, self._head, tuple(counts), dropped)
        try:  # plain pickle: Connection.send's ForkingPickler costs more than the write itself
            self._data_w.send_bytes(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))
        except OSError as exc:
            raise self._gone(exc) from exc
        return True

    def _control(self, msg: tuple) -> None:
        with self._lock:
            if not self.process:
                if msg[0] == "static":
                    self._rec.update_static(msg[1])
                else:
                    self._rec.note_error(msg[1], msg[2])
                return
            self._send(msg)

    def _stage(
        self,
        table: str,
        cols: Columns,
        counts: dict[str, int],
        spec: dict,
        column_attrs: dict | None,
    ) -> bool:
        parts = _pack(cols, counts, self._part_bytes, table)
        announce = table not in self._announced
        for i, (layout, nbytes_part) in enumerate(parts):
            # A step is dropped whole or not at all: only its first part may be refused.
            base = self._allocate(nbytes_part, may_drop=(i == 0 and self.on_full == "drop"))
            if base is None:
                self.dropped[table] = self.dropped.get(table, 0) + 1
                return False
            cuda = False
            msg_layout = []
            for axis, col, offset, r0, r1 in layout:
                src = cols[axis][col][r0:r1]
                nbytes = _nbytes(src)
                lo, hi = base + offset, base + offset + nbytes
                if isinstance(src, torch.Tensor):  # on CUDA
                    cuda = True
                    self._pin()
                    self._ring[lo:hi].view(src.dtype).view(src.shape).copy_(src, non_blocking=True)
                elif nbytes:
                    # A plain single-threaded memcpy: torch's copy_ fans out to its intra-op
                    # threads, which on a busy host stalls the serving thread for tens of ms.
                    self._ring_np[lo:hi] = src.reshape(-1).view(np.uint8)
                msg_layout.append((axis, col, offset, r1 - r0))
            last = i == len(parts) - 1
            msg = (
                "part",
                table,
                base,
                self._head,
                msg_layout,
                counts if last else None,
                spec if (announce and i == 0) else None,
                column_attrs if (announce and i == 0) else None,
                dict(self.dropped) if (last and self.dropped) else None,
            )
            if cuda and self._completer is None:
                self._completer = _CudaCompleter(self._data_w)
            if self._completer is not None:
                self._completer.submit(torch.cuda.Event() if cuda else None, msg, record=cuda)
            else:
                self._pipe_send(msg)
        self._announced.add(table)
        return True

    def _send(self, msg: tuple) -> None:
        if self._completer is not None:  # keep order behind in-flight CUDA copies
            self._completer.submit(None, msg, record=False)
            self._completer.drain()
        else:
            self._pipe_send(msg)

    def _pipe_send(self, msg: tuple) -> None:
        try:
            self._data_w.send(msg)
        except OSError as exc:  # broken pipe: the writer process is gone
            raise self._gone(exc) from exc

    def _pin(self) -> None:
        # Page-lock the ring once so non_blocking D2H copies really are asynchronous.
        if self._pinned:
            return
        self._pinned = True
        try:
            ptr = self._ring.data_ptr()
            torch.cuda.cudart().cudaHostRegister(ptr, self._ring.numel(), 0)
        except Exception:  # noqa: BLE001 - copies stay correct, only synchronous
            pass

    def _allocate(self, n: int, may_drop: bool) -> int | None:
        """Offset of n contiguous free bytes in the ring (None: full and may_drop)."""
        self._poll_free()
        if self._fault is not None:
            raise TraceError(self._fault)
        if self._tail == self._head and self._head % self._ring_bytes:
            # Nothing in flight: start over at the ring's start, whose pages the last steps
            # touched and are likely still in cache (a FIFO walk copies into cold memory).
            self._head = self._tail = -(-self._head // self._ring_bytes) * self._ring_bytes
        pos = self._head % self._ring_bytes
        pad = self._ring_bytes - pos if pos + n > self._ring_bytes else 0  # never wrap a part
        need = pad + n
        if self._head + need - self._tail > self._ring_bytes:
            if may_drop:
                return None
            self.stats["blocked_parts"] += 1
            t0 = time.perf_counter()
            while self._head + need - self._tail > self._ring_bytes:
                if self._wait_poll.poll(500):
                    self._poll_free()
                    if self._fault is not None:
                        raise TraceError(self._fault)
                elif self._proc.poll() is not None:
                    raise self._gone()
            self.stats["blocked_s"] += time.perf_counter() - t0
        self.stats["parts"] += 1
        self._head += need
        self._head_np[0] = self._head
        return 0 if pad else pos

    def _poll_free(self) -> None:
        try:
            ends = os.read(self._ends_r, 1 << 16)
        except BlockingIOError:
            ends = None
        if ends:  # counters only grow: the last one read says it all
            self._tail = max(self._tail, int.from_bytes(ends[-8:], "little"))
        while self._free_poll.poll(0):
            self._take(self._recv_free())

    def _gone(self, exc: BaseException | None = None) -> TraceError:
        """The error for a writer process that is gone: its fault report if it sent one."""
        try:
            while self._fault is None and self._free_r.poll(0):
                self._take(self._free_r.recv())
        except (EOFError, OSError):
            pass
        if self._fault is not None:
            return TraceError(self._fault)
        code = self._proc.poll()
        why = f"code {code}" if exc is None else f"{exc}; code {code}"
        return TraceError(f"{self.path}: the writer process of rank {self.rank} exited ({why})")

    def _recv_free(self) -> Any:
        try:
            return self._free_r.recv()
        except (EOFError, OSError):
            raise self._gone() from None

    def _take(self, item: Any) -> None:
        if isinstance(item, int):
            self._tail = max(self._tail, item)
        elif item[0] == "fault":
            self._fault = str(item[1])
        else:
            self._pending_control.append(item)

    def _wait_control(self, kinds: tuple[str, ...], timeout: float | None) -> tuple:
        t_end = None if timeout is None else time.monotonic() + timeout
        while True:
            for i, item in enumerate(self._pending_control):
                if item[0] in kinds:
                    return self._pending_control.pop(i)
            if self._fault is not None:
                raise TraceError(self._fault)
            if self._free_r.poll(0.5):
                self._take(self._recv_free())
                continue
            if self._proc.poll() is not None and not self._free_r.poll(0):
                raise self._gone()
            if t_end is not None and time.monotonic() > t_end:
                raise TraceError(
                    f"{self.path}: the writer process of rank {self.rank} did not answer within {timeout:.0f} s"
                )

    def _teardown(self) -> None:
        if self._completer is not None:
            self._completer.stop()
        for conn in (self._data_w, self._free_r):
            conn.close()
        os.close(self._ends_r)
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()  # only after close or a failed start: nothing left to save
            self._proc.wait()
        if self._pinned:
            try:
                torch.cuda.cudart().cudaHostUnregister(self._ring.data_ptr())
            except Exception:  # noqa: BLE001 - the mapping goes away with the segment anyway
                pass
        del self._ring, self._ring_np, self._ring_i64, self._head_np
        self._release()


class _Plan:
    """What the fast path needs to stage a step of one table without building dicts: per axis
    (in spec order), the producer's columns with their torch and numpy dtypes and row sizes."""

    def __init__(self, table: str, axes: list, auto_seq: bool) -> None:
        self.table = table
        self.axes = axes  # [(axis, ((column, torch dtype, numpy dtype|None, row_shape, row_bytes), ...), n)]
        self.auto_seq = auto_seq

    @staticmethod
    def of(table: str, spec: dict, step: dict[str, Any]) -> _Plan | None:
        auto = [c for c in AUTO_STEP_COLUMNS if c not in step]
        if auto and (len(auto) != len(AUTO_STEP_COLUMNS) or list(spec[STEP_AXIS])[-2:] != auto):
            return None  # only one of seq / t_ns given: rare, the generic path handles it
        axes = []
        for axis, cc in spec.items():
            cols = []
            for col, (storage, logical, row_shape) in cc.items():
                if axis == STEP_AXIS and auto and col in auto:
                    continue
                ndtype = np.dtype(storage)
                if ndtype.kind == "c":
                    return None  # complex tensors may carry lazy conj/neg bits
                tdtype = torch.bfloat16 if logical == "bfloat16" else _TORCH_DTYPES.get(ndtype)
                if tdtype is None:
                    return None
                numpy_ok = ndtype if logical == storage else None
                rs = tuple(row_shape)
                cols.append(
                    (col, tdtype, numpy_ok, torch.Size(rs), ndtype.itemsize * math.prod(rs))
                )
            axes.append((axis, tuple(cols), len(cols)))
        return _Plan(table, axes, bool(auto))


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


def _pack(
    cols: Columns, counts: dict[str, int], part_bytes: int, table: str
) -> list[tuple[list[tuple], int]]:
    """Split a step's rows into parts of at most part_bytes: ([(axis, column, offset, r0, r1)], bytes)."""
    parts: list[list[tuple]] = []
    cur: list[tuple] = []
    used = 0
    for axis, cc in cols.items():
        n = counts[axis]
        row_bytes = {c: _nbytes(a) // n if n else 0 for c, a in cc.items()}
        per_row = sum(row_bytes.values())
        r = 0
        while r < n:
            room = part_bytes - used - ALIGN * len(cc)
            k = min(n - r, room // per_row if per_row else n - r)
            if k <= 0:
                if not cur:
                    raise TraceError(
                        f"table {table!r}: one row of axis {axis!r} ({per_row} B) is larger than a staging part ({part_bytes} B)"
                    )
                parts.append((cur, used))
                cur, used = [], 0
                continue
            for c, b in row_bytes.items():
                cur.append((axis, c, used, r, r + k))
                used += _align(k * b)
            r += k
    parts.append((cur, used))
    return parts


class _Segment:
    """The staging ring's shared memory. On Linux a memfd: it has no name, the writer process
    inherits its descriptor, and the memory lives exactly as long as someone maps it, so no
    kill can leave anything behind. Elsewhere a named /dev/shm segment, unlinked as soon as
    both sides have mapped it (`mapped_by_both`)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fd: int | None = None
        self.shm: SharedMemory | None = None
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create("hstrace-ring", os.MFD_CLOEXEC)
            try:
                os.ftruncate(self.fd, size)
                self.mmap = mmap.mmap(self.fd, size)
            except BaseException:
                os.close(self.fd)
                raise
            self.arg = f"fd:{self.fd}"
        else:
            _check_shm_room(size)
            self.shm = SharedMemory(create=True, size=size)
            self.mmap = self.shm._mmap
            self.arg = self.shm.name

    def pass_fds(self) -> tuple[int, ...]:
        return (self.fd,) if self.fd is not None else ()

    def mapped_by_both(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        elif self.shm is not None:
            _unlink(self.shm)

    def release(self) -> None:
        if self.shm is not None:
            self.shm.close()
            _unlink(self.shm)
            return
        self.mmap.close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _unlink(shm: SharedMemory) -> None:
    try:
        shm.unlink()
    except FileNotFoundError:  # already unlinked
        pass


def _unexported_view(mm: mmap.mmap, size: int) -> np.ndarray:
    """The mapping as a uint8 array that does not hold a buffer export on it (as
    `np.frombuffer(mm)` would), so it can be closed whatever order views and writer are
    collected in. Only the writer uses these views, never after `_release`."""
    anchor = ctypes.c_char.from_buffer(mm)  # a momentary export, just for the address
    addr = ctypes.addressof(anchor)
    del anchor
    return np.ctypeslib.as_array(ctypes.cast(addr, ctypes.POINTER(ctypes.c_uint8)), (size,))


def _release_segment(seg: _Segment) -> None:
    seg.release()


def _check_shm_room(n: int) -> None:
    # Touching shared memory beyond what /dev/shm holds is a SIGBUS in the serving process,
    # so refuse up front with a message instead (Docker's default /dev/shm is 64 MB).
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return
    room = st.f_bavail * st.f_frsize
    if room < n:
        raise TraceError(
            f"/dev/shm has {room >> 20} MiB free, the trace writer needs {n >> 20} MiB of staging; "
            "enlarge /dev/shm (docker --shm-size) or pass a smaller staging_bytes"
        )


def _describe(spec: dict) -> str:
    return (
        "{"
        + ", ".join(f"{a}/{c}:{s[1]}{list(s[2])}" for a, cc in spec.items() for c, s in cc.items())
        + "}"
    )


class _CudaCompleter:
    """Sends messages once their async D2H copies are done, in order, off the serving thread."""

    def __init__(self, conn) -> None:
        self._conn = conn
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="hstrace-d2h", daemon=True)
        self._thread.start()

    def submit(self, event, msg: tuple, record: bool) -> None:
        if record:
            event.record()
        self._idle.clear()
        self._q.put((event, msg))

    def drain(self) -> None:
        self._q.put(None)
        self._idle.wait()

    def stop(self) -> None:
        self._q.put(StopIteration)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is StopIteration:
                return
            if item is None:
                if self._q.empty():
                    self._idle.set()
                continue
            event, msg = item
            if event is not None:
                event.synchronize()
            self._conn.send(msg)
