"""The serving path's sink: steps are copied into a shared-memory byte ring and described to the
rank's writer process (writer_process.py), which does all compression and I/O: a one-part host
step by a descriptor in shared memory (ring.py), anything else by a small message down a pipe. The serving thread pays a memcpy (an async D2H copy on CUDA) and a
few stores. A step larger than `max_part_bytes` (a prefill of thousands of tokens) is split by rows
into several parts. Also here: starting and supervising the writer process, and the CUDA
completer that sends a step's message once its device copies are done.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import platform
import queue
import select
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from hstrace.errors import TraceError
from hstrace.trace.write import placement
from hstrace.trace.write import protocol as P
from hstrace.trace.write.protocol import ALIGN, align
from hstrace.trace.write.ring import (
    DESC_AXES,
    DESC_SLOTS,
    DESC_WORDS,
    FAULT,
    HEAD,
    PUBLISHED,
    STEP_ENDED,
    STEP_GAP,
    STEP_STARTED,
    TAIL,
    TAKEN,
    TRAILER_WORDS,
    Segment,
    release_segment,
    segment_bytes,
    unexported_view,
)
from hstrace.trace.write.sink import Sink, TablePlan, new_stats

# Where the hstrace package lives, so the writer process imports this very copy.
_PACKAGE_ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
# Seconds to wait for the writer process to start (it imports numpy and zarr).
START_TIMEOUT_S = 120.0
# Steps are published through the descriptor queue only where plain stores become visible to
# the writer in program order (x86's TSO): the ring bytes, then the slot, then PUBLISHED.
# Elsewhere (aarch64) that needs fences Python has no cheap way to issue, so every step goes
# down the pipe, whose write orders them.
DESCRIPTORS = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
# Every this many descriptors the producer checks that the writer is alive (one poll of the
# ends pipe): a pipe write per step used to say so at once.
LIVENESS_EVERY = 64
_UNBOUND: Any = object()
_native: Any = _UNBOUND  # the optional C extension once imported and bound, or None
_native_lock = threading.Lock()


def native_extension() -> Any:
    """The native one-call step (hstrace/trace/write/_native.c), imported and bound to torch's
    Tensor on the first call (once per process), or None where it is not built (a plain copy
    of the tree, a Python without a compiler): every step then takes the Python route."""
    global _native
    if _native is _UNBOUND:
        with _native_lock:
            if _native is _UNBOUND:
                _native = _bind_native()
    return _native


def _bind_native() -> Any:
    try:
        from hstrace.trace.write import _native as ext
    except ImportError:
        return None
    # (sample tensors: where a tensor object keeps its TensorImpl, for the native step's
    # prefetch; `_cdata` is that TensorImpl's address)
    samples = [torch.zeros(1), torch.zeros(2, 3, dtype=torch.bfloat16), torch.arange(4)[1:]]
    impls = [getattr(t, "_cdata", None) for t in samples]
    if None in impls:  # a torch without it: no prefetch, the same checks and bytes
        samples, impls = [], []
    ext.bind(torch.Tensor, samples, impls)
    return ext


def native_route(environ: Mapping[str, str] | None = None) -> Any:
    """The native extension where a sink built now takes the native route: it is built,
    descriptors are on and HSTRACE_NATIVE is not 0 (the Python route stages the same bytes);
    else None. Read when a ProcessSink is built, not at import."""
    env = os.environ if environ is None else environ
    if not DESCRIPTORS or env.get("HSTRACE_NATIVE", "1") == "0":
        return None
    return native_extension()


# align(n) as two integer operations (ALIGN is a power of two).
_ALIGN_UP, _ALIGN_MASK = ALIGN - 1, -ALIGN
assert ALIGN & (ALIGN - 1) == 0


class _Table:
    """Per table: its id on the wire and the packer of its Step messages."""

    __slots__ = ("tid", "codec", "descriptors")

    def __init__(self, tid: int, n_axes: int) -> None:
        self.tid = tid
        self.codec = P.StepCodec(tid, n_axes)
        self.descriptors = DESCRIPTORS and n_axes <= DESC_AXES


class _Cursor:
    """The ring's cursor of the Python route (the native build's is _native.Ring)."""

    __slots__ = ("head", "tail", "published", "enabled")

    def __init__(self) -> None:
        self.head = self.tail = self.published = 0
        self.enabled = 0


def native_plan(plan: TablePlan, columns: list) -> tuple:
    """The writer's fast-path checks of one table (writer._Matcher.axes) with the plan's row
    bytes, in the form _native.Step takes: per axis (kind, name, columns, auto columns)."""
    row_bytes = dict(zip(plan.columns, plan.row_bytes, strict=True))
    kinds = {"step": 0, "req": 1, "tok": 2}
    out = []
    for axis, cols, _, auto in columns:
        spec = tuple(
            (col, tdtype, tuple(rs), width, int(int_ok), row_bytes[(axis, col)])
            for col, tdtype, _, rs, width, int_ok in cols
        )
        out.append((kinds.get(axis, 3), axis, spec, tuple(0 if c == "seq" else 1 for c in auto)))
    return tuple(out)


class ProcessSink(Sink):
    def __init__(
        self,
        path: str,
        rank: int,
        tail_flush_s: float = 2.0,
        staging_bytes: int = 256 << 20,
        max_part_bytes: int = 16 << 20,
        compress_threads: int = 2,
        raw_when_behind: bool = True,
        raw_beyond_budget: bool = True,
    ) -> None:
        self.path, self.rank = path, rank
        self._native = native_route()  # HSTRACE_NATIVE, as this sink is built
        self.stats = new_stats()
        self._tables: dict[str, _Table] = {}
        self._fault: str | None = None  # set once the writer reports the trace is unwritable
        self._ring_bytes = align(int(staging_bytes))
        self._part_bytes = min(align(int(max_part_bytes)), self._ring_bytes // 2)
        self._shm = Segment(segment_bytes(self._ring_bytes))
        # A sink dropped without close() (a crashed caller, a test) must still release its
        # segment: its memory is not freed while the process lives on.
        self._release = weakref.finalize(self, release_segment, self._shm)
        whole = unexported_view(self._shm.mmap, self._shm.size)
        self._ring_np = whole[: self._ring_bytes]
        # int64 words of the ring and its trailer (ring.HEAD / TAIL / FAULT) as memoryviews of
        # ctypes arrays at the mapping's address: a word read or store is a few bytecodes, where
        # numpy's scalar indexing runs its dtype machinery (~10 us of cold code a step here).
        words = (ctypes.c_int64 * (self._shm.size // 8)).from_address(whole.ctypes.data)
        self._ring_i64 = memoryview(words).cast("B").cast("q")
        at = self._ring_bytes // 8
        self._trailer = self._ring_i64[at : at + TRAILER_WORDS]
        # step_phase runs on the engine's serving thread, the close on another: the words it
        # stores are let go under this lock before the mapping is (`_teardown`)
        self._phase_lock = threading.Lock()
        self._phase_words: Any = self._trailer
        self._desc_at = at + TRAILER_WORDS  # word index of descriptor slot 0
        self._ring = torch.from_numpy(self._ring_np)
        self._ring_addr = self._ring.data_ptr()
        self._ring.zero_()  # pre-fault the pages now, not on the serving thread's first steps
        # ... and the descriptor queue's (a first touch under memory pressure is a direct
        # reclaim: milliseconds on the serving thread; seen as the p99 of bench/write_path.py)
        whole[self._ring_bytes :] = 0
        self._pending: list[Any] = []  # replies read while waiting for something else
        self._pinned = False
        self._completer: _CudaCompleter | None = None
        data_r, self._data_w = mp.Pipe(duplex=False)
        self._data_fd = self._data_w.fileno()
        self._free_r, free_w = mp.Pipe(duplex=False)
        # select.poll on the raw fd: Connection.poll goes through selectors (tens of us a call).
        self._free_poll = select.poll()
        self._free_poll.register(self._free_r.fileno(), select.POLLIN)
        # Ring space comes back as raw 8-byte counters on a pipe of their own: one
        # non-blocking read takes all of them.
        self._ends_r, ends_w = os.pipe()
        os.set_blocking(self._ends_r, False)
        self._ends_poll = select.poll()  # POLLHUP: the writer's end is closed
        self._ends_poll.register(self._ends_r, select.POLLIN)
        self._wait_poll = select.poll()
        self._wait_poll.register(self._free_r.fileno(), select.POLLIN)
        self._wait_poll.register(self._ends_r, select.POLLIN)
        # The FIFO byte ring's cursor: bytes [tail, head) (monotonic counters) are in flight to
        # the writer, which hands back the counter of each part it has consumed; `published`
        # descriptors so far (ring.PUBLISHED). The native one also stages whole steps itself
        # (fast_step); both routes move this one cursor.
        self._cur = self._new_cursor()
        args = [path, str(rank), str(float(tail_flush_s)), self._shm.arg]
        args += [str(data_r.fileno()), str(free_w.fileno()), str(ends_w)]
        raw = ("1" if raw_beyond_budget else "b") if raw_when_behind else "0"
        args += [str(max(0, int(compress_threads))), raw]
        env = dict(os.environ)
        for name in placement.OMP_BIND:  # an OpenMP runtime it loads would bind it back there
            env.pop(name, None)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        # subprocess rather than multiprocessing's spawn, which would re-import the parent's
        # __main__ (a server launcher, a test runner, a user script).
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "hstrace.trace.write.writer_process", *args],
            pass_fds=(data_r.fileno(), free_w.fileno(), ends_w, *self._shm.pass_fds()),
            env=env,
        )
        # off the engine's cores before the writer imports numpy (its threads inherit the mask)
        placement.move_process(self._proc.pid, placement.spare_cpus())
        data_r.close()
        free_w.close()
        os.close(ends_w)
        try:
            reply = self._wait_reply((P.Ready, P.Failed), START_TIMEOUT_S)
        except BaseException:
            self._teardown()
            raise
        if isinstance(reply, P.Failed):
            self._teardown()
            raise TraceError(reply.message)
        # Both sides have the ring mapped: drop its name / our descriptor now, so no kill of
        # the producer, the writer or their whole process group can leak it (issue 12, item 6).
        self._shm.mapped_by_both()

    def _new_cursor(self) -> Any:
        if self._native is None:
            return _Cursor()
        # A weak reference, not the bound method: no cycle keeps a dropped sink (and its
        # segment) alive until the garbage collector runs.
        ref, path, rank = weakref.ref(self), self.path, self.rank

        def gone() -> TraceError:
            sink = ref()
            if sink is None:
                return TraceError(f"{path}: the writer process of rank {rank} is gone")
            return sink._gone()

        at = self._ring_bytes // 8
        return self._native.Ring(
            self._ring_np.ctypes.data,
            self._ring_bytes,
            self._part_bytes,
            at,
            at + TRAILER_WORDS,
            DESC_SLOTS,
            DESC_WORDS,
            self._ends_r,
            LIVENESS_EVERY,
            self.stats,
            gone,
        )

    @property
    def writer_pid(self) -> int | None:
        return self._proc.pid

    def step_phase(self, running: bool) -> None:
        """The producer's engine step has started (`running`) or ended: a few word stores
        (ring.STEP_STARTED / STEP_ENDED, and at a start the gap it ends, STEP_GAP), which the
        writer reads to keep its work out of the gap between two steps
        (writer_process.GAP_HOLD_NS, RingView.gap_left)."""
        now = time.monotonic_ns()
        with self._phase_lock:
            tr = self._phase_words
            if tr is None:  # closed: the mapping is gone
                return
            if running:
                ended = tr[STEP_ENDED]
                if ended:
                    tr[STEP_GAP] = now - ended
                tr[STEP_STARTED] = now
            else:
                tr[STEP_ENDED] = now

    @property
    def _published(self) -> int:
        return self._cur.published

    def fast_step(self, plan: TablePlan, columns: list) -> Any:
        """The native one-call write of a repeated step of `plan` (see TraceWriter.write),
        or None where there is none: no build, no descriptor queue, a CUDA step seen."""
        t = self._tables.get(plan.name)
        if isinstance(self._cur, _Cursor) or t is None or not t.descriptors:
            return None
        try:
            return self._native.Step(self._cur, t.tid, native_plan(plan, columns)).write
        except ValueError:  # beyond the native route's fixed limits (columns, row rank)
            return None

    # --- steps ------------------------------------------------------------------------
    def write_step(
        self,
        plan: TablePlan,
        arrays: list[Any],
        counts: tuple[int, ...],
        host: bool,
        may_drop: bool,
    ) -> bool:
        if self._fault is not None:
            raise TraceError(self._fault)
        t = self._tables.get(plan.name)
        if t is None:
            t = self._announce(plan)
        if not host or self._completer is not None:
            return self._write_parts(plan, t, arrays, counts, may_drop)
        # One part, every column in spec order at an ALIGN-aligned offset after the previous
        # one (the layout writer_process._write_step reads).
        sizes = [counts[ai] * rb for ai, rb in plan.axis_row_bytes]
        used = 0
        for nb in sizes:
            used += (nb + _ALIGN_UP) & _ALIGN_MASK
        if used > self._part_bytes:
            return self._write_parts(plan, t, arrays, counts, may_drop)
        base = self._allocate(used, may_drop)
        if base is None:
            return False
        t0 = time.perf_counter()
        addr = self._ring_addr + base
        off = 0
        for a, nb in zip(arrays, sizes, strict=True):
            if nb:
                ta = type(a)
                if ta is torch.Tensor:
                    ctypes.memmove(addr + off, a.data_ptr(), nb)  # a single-threaded memcpy
                elif ta is int:
                    # (an int64 word: struct.pack_into on the mmap costs ~15 us a call here)
                    self._ring_i64[(base + off) >> 3] = a
                else:
                    lo = base + off
                    self._ring_np[lo : lo + nb] = a.reshape(-1).view(np.uint8)
            off += (nb + _ALIGN_UP) & _ALIGN_MASK
        self.stats["copy_s"] += time.perf_counter() - t0  # the copy itself (bench/README.md)
        j = self._cur.published
        if t.descriptors and j - self._trailer[TAKEN] < DESC_SLOTS:
            # A descriptor instead of a pipe write: a few stores, no syscall (ring.py).
            w = self._desc_at + (j % DESC_SLOTS) * DESC_WORDS
            i64 = self._ring_i64
            i64[w] = t.tid
            i64[w + 1] = base
            i64[w + 2] = self._cur.head
            i64[w + 3] = len(counts)
            w += 4
            for c in counts:
                i64[w] = c
                w += 1
            self._cur.published = j = j + 1
            self._trailer[PUBLISHED] = j  # after the slot (see DESCRIPTORS)
            if not j % LIVENESS_EVERY and self._ends_hung_up():
                raise self._gone()  # the writer process is gone (its ends pipe is closed)
        else:  # no free slot (the writer is far behind), or a table of many axes
            self._send(t.codec.frame(base, self._cur.head, counts, j))
        return True

    def _announce(self, plan: TablePlan) -> _Table:
        t = self._tables[plan.name] = _Table(len(self._tables), len(plan.axes))
        self._send(
            P.frame_control(
                P.Table(t.tid, plan.name, plan.spec, plan.column_attrs), self._cur.published
            )
        )
        return t

    def _write_parts(
        self,
        plan: TablePlan,
        t: _Table,
        arrays: list[Any],
        counts: tuple[int, ...],
        may_drop: bool,
    ) -> bool:
        """The general path: rows split into parts of at most max_part_bytes, CUDA tensors
        copied asynchronously (their messages sent by the completer once the copy is done)."""
        srcs = []
        for (axis, col), dtype, rs, a in zip(
            plan.columns, plan.dtypes, plan.row_shapes, arrays, strict=True
        ):
            if type(a) is int:
                a = np.array([a], dtype)
            elif isinstance(a, torch.Tensor) and not a.is_cuda:
                a = a.view(torch.uint16) if a.dtype == torch.bfloat16 else a
                a = a.numpy()
            n = counts[plan.axes.index(axis)]
            srcs.append((axis, col, a.reshape(n, *rs)))
        by_axis = dict(zip(plan.axes, counts, strict=True))
        parts = _pack(plan, srcs, by_axis, self._part_bytes)
        for i, (layout, nbytes_part) in enumerate(parts):
            # A step is dropped whole or not at all: only its first part may be refused.
            base = self._allocate(nbytes_part, may_drop=(i == 0 and may_drop))
            if base is None:
                return False
            cuda = False
            msg_layout = []
            t0 = time.perf_counter()
            for j, offset, r0, r1 in layout:
                axis, col, rows = srcs[j]
                src = rows[r0:r1]
                nbytes = (
                    src.nbytes if isinstance(src, np.ndarray) else src.numel() * src.element_size()
                )
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
            self.stats["copy_s"] += time.perf_counter() - t0
            last = i == len(parts) - 1
            msg = P.Part(t.tid, base, self._cur.head, tuple(msg_layout), by_axis if last else None)
            frame = P.frame_control(msg, self._cur.published)
            if cuda and self._completer is None:
                self._completer = _CudaCompleter(self._write_frame)
                self._cur.enabled = 0  # host steps now queue behind CUDA ones (_write_parts)
            if self._completer is not None:
                self._completer.submit(torch.cuda.Event() if cuda else None, frame, record=cuda)
            else:
                self._write_frame(frame)
        return True

    def _pin(self) -> None:
        # Page-lock the ring once so non_blocking D2H copies really are asynchronous.
        if self._pinned:
            return
        self._pinned = True
        try:
            torch.cuda.cudart().cudaHostRegister(self._ring.data_ptr(), self._ring.numel(), 0)
        except Exception:  # noqa: BLE001 - copies stay correct, only synchronous
            pass

    def _allocate(self, n: int, may_drop: bool) -> int | None:
        """Offset of n contiguous free bytes in the ring (None: full and may_drop)."""
        trailer = self._trailer  # _poll_free, inlined: this runs for every step
        tail = trailer[TAIL]
        if tail > self._cur.tail:
            self._cur.tail = tail
        if trailer[FAULT]:
            self._poll_free()
        if self._fault is not None:
            raise TraceError(self._fault)
        head = self._cur.head
        if self._cur.tail == head and head % self._ring_bytes:
            # Nothing in flight: start over at the ring's start, whose pages the last steps
            # touched and are likely still in cache (a FIFO walk copies into cold memory).
            head = self._cur.tail = -(-head // self._ring_bytes) * self._ring_bytes
            self._cur.head = head  # (so tail <= head holds whatever happens next)
        pos = head % self._ring_bytes
        pad = self._ring_bytes - pos if pos + n > self._ring_bytes else 0  # never wrap a part
        need = pad + n
        if head + need - self._cur.tail > self._ring_bytes:
            if may_drop:
                self._cur.head = head
                return None
            self.stats["blocked_parts"] += 1
            t0 = time.perf_counter()
            while head + need - self._cur.tail > self._ring_bytes:
                if self._wait_poll.poll(500):
                    if not self._drain_ends():
                        raise self._gone()  # end of file: the writer process is gone
                    while self._fault is None and self._free_poll.poll(0):
                        self._take(self._recv_reply())  # a fault report, or its end of file
                    if self._fault is not None:
                        raise TraceError(self._fault)
                    self._poll_free()
                elif self._proc.poll() is not None:
                    raise self._gone()
            self.stats["blocked_s"] += time.perf_counter() - t0
        self.stats["parts"] += 1
        self._cur.head = head + need
        self._trailer[HEAD] = self._cur.head
        return 0 if pad else pos

    def _poll_free(self) -> None:
        """Ring space handed back, and a fault report if there is one: two reads of shared
        memory, no syscall (the pipes are read only while waiting for room or a reply)."""
        tail = self._trailer[TAIL]
        if tail > self._cur.tail:
            self._cur.tail = tail
        if self._trailer[FAULT]:
            while self._fault is None and self._free_poll.poll(0):
                self._take(self._recv_reply())

    def _ends_hung_up(self) -> bool:
        """Whether the writer process has closed its end of the ends pipe (it is gone): one
        poll, no read (a read allocates its 64 KiB buffer, a fresh heap page under memory
        pressure; TAIL in the trailer says what the pipe's counters would)."""
        return any(ev & select.POLLHUP for _, ev in self._ends_poll.poll(0))

    def _drain_ends(self) -> bool:
        """Empty the ends pipe (the same counters as the trailer's TAIL: the pipe is what a
        blocked producer waits on). False at its end of file: the writer process is gone."""
        while True:
            try:
                ends = os.read(self._ends_r, 1 << 16)
            except BlockingIOError:
                return True
            if not ends:
                return False
            # counters only grow: the last one read says it all
            self._cur.tail = max(self._cur.tail, int.from_bytes(ends[-8:], "little"))

    # --- control ----------------------------------------------------------------------
    def control(self, msg: P.Static | P.Error | P.Dropped) -> None:
        if self._fault is not None:
            raise TraceError(self._fault)
        self._send(P.frame_control(msg, self._cur.published))

    def flush(self, dropped: dict[str, int]) -> None:
        self.control(P.Flush(dict(dropped)))
        self._wait_reply((P.Flushed,), None)

    def close(self, dropped: dict[str, int]) -> None:
        try:
            if self._fault is None:
                self._poll_free()
            if self._fault is not None:
                raise TraceError(self._fault)
            self._send(P.frame_control(P.Close(dict(dropped)), self._cur.published))
            self._wait_reply((P.Closed,), None)
            self._proc.wait(timeout=60)
        finally:
            self._teardown()

    # --- the pipes and the writer process ------------------------------------------------
    def _send(self, frame: bytes) -> None:
        if self._completer is not None:  # keep order behind in-flight CUDA copies
            self._completer.submit(None, frame, record=False)
            if frame[4] != P.STEP:
                self._completer.drain()
        else:
            self._write_frame(frame)

    def _write_frame(self, frame: bytes) -> None:
        # One write of a framed message (Connection's framing, so the writer's recv_bytes
        # reads it): Connection.send_bytes costs a few us of Python around the same write.
        try:
            view = memoryview(frame)
            while view:
                view = view[os.write(self._data_fd, view) :]
        except OSError as exc:  # broken pipe: the writer process is gone
            raise self._gone(exc) from exc

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

    def _recv_reply(self) -> Any:
        try:
            return self._free_r.recv()
        except (EOFError, OSError):
            raise self._gone() from None

    def _take(self, reply: Any) -> None:
        if isinstance(reply, P.Fault):
            self._fault = reply.message
            self._cur.enabled = 0  # every later step raises it (write_step)
        else:
            self._pending.append(reply)

    def _wait_reply(self, kinds: tuple[type, ...], timeout: float | None) -> Any:
        t_end = None if timeout is None else time.monotonic() + timeout
        while True:
            for i, reply in enumerate(self._pending):
                if isinstance(reply, kinds):
                    return self._pending.pop(i)
            if self._fault is not None:
                raise TraceError(self._fault)
            if self._free_r.poll(0.5):
                self._take(self._recv_reply())
                continue
            if self._proc.poll() is not None and not self._free_r.poll(0):
                raise self._gone()
            if t_end is not None and time.monotonic() > t_end:
                raise TraceError(
                    f"{self.path}: the writer process of rank {self.rank} did not answer "
                    f"within {timeout:.0f} s"
                )

    def _teardown(self) -> None:
        self._cur.enabled = 0  # the ring's memory is about to go
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
        with self._phase_lock:  # no step mark lands in memory about to be unmapped
            self._phase_words = None
        del self._ring, self._ring_np, self._ring_i64, self._trailer
        self._release()


def _pack(
    plan: TablePlan, srcs: list[tuple[str, str, Any]], counts: dict[str, int], part_bytes: int
) -> list[tuple[list[tuple[int, int, int, int]], int]]:
    """Split a step's rows into parts of at most part_bytes: ([(source index, offset, r0, r1)],
    bytes), axis by axis in spec order."""
    parts: list[tuple[list[tuple[int, int, int, int]], int]] = []
    cur: list[tuple[int, int, int, int]] = []
    used = 0
    for axis in plan.axes:
        idx = [j for j, (a, _, _) in enumerate(srcs) if a == axis]
        n = counts[axis]
        row_bytes = {j: plan.row_bytes[j] for j in idx}
        per_row = sum(row_bytes.values())
        r = 0
        while r < n:
            room = part_bytes - used - ALIGN * len(idx)
            k = min(n - r, room // per_row if per_row else n - r)
            if k <= 0:
                if not cur:
                    raise TraceError(
                        f"table {plan.name!r}: one row of axis {axis!r} ({per_row} B) is larger "
                        f"than a staging part ({part_bytes} B)"
                    )
                parts.append((cur, used))
                cur, used = [], 0
                continue
            for j, b in row_bytes.items():
                cur.append((j, used, r, r + k))
                used += align(k * b)
            r += k
    parts.append((cur, used))
    return parts


class _CudaCompleter:
    """Sends messages once their async D2H copies are done, in order, off the serving thread."""

    def __init__(self, write) -> None:
        self._write = write
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="hstrace-d2h", daemon=True)
        self._thread.start()

    def submit(self, event, frame: bytes, record: bool) -> None:
        if record:
            event.record()
        self._idle.clear()
        self._q.put((event, frame))

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
            event, frame = item
            if event is not None:
                event.synchronize()
            try:
                self._write(frame)
            except TraceError:
                return  # the writer is gone: the next write or close says so
