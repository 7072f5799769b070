"""The writer process of one rank: drains the staging ring into a RankRecorder.

Imports no torch: it only needs numpy and zarr, so it starts fast and stays small. The
messages it reads and answers are in hstrace/trace/write/protocol.py.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import json
import math
import os
import select
import sys
import time
from collections.abc import Mapping
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from hstrace.errors import HstraceError
from hstrace.trace.write import protocol as P
from hstrace.trace.write import rowlog
from hstrace.trace.write.protocol import ALIGN
from hstrace.trace.write.ring import RingView

# Sleep between polls of an idle pipe. Each wake has a cost of its own (30-80 us of CPU for a
# bare `time.sleep` wake-up on this project's 2-vCPU host, then the batch's book-keeping), so
# after a batch of steps the writer sleeps long enough to find a few: at a server's pace (a
# step every 10 ms) 20 ms takes two steps a wake, where 4 ms then 8 took one after two wakes.
# Measured: 15-27 % less writer CPU per step, side by side on the same steps (bench/README.md,
# eleventh pass; the live figures and their caveats are there). The sleep is cut short where
# the producer stages bytes fast (a big batch on a GPU): at the rate of the last batch, a
# sleep fills at most SLEEP_RING_SHARE of the ring (never less than IDLE_POLL_MIN_S). While
# idle the sleep doubles up to the max: a producer waiting for room waits at most that long
# for the writer to wake (it waits only when the ring is full, when the writer is busy, not
# asleep).
IDLE_POLL_MIN_S = 0.002
IDLE_POLL_BATCH_S = 0.02
IDLE_POLL_MAX_S = 0.04
SLEEP_RING_SHARE = 1 / 16
# A batch (or an encoder's job) found in the gap between two of the producer's engine steps
# (ring.STEP_*, told by vLLM's hooks) waits, once, until the gap has lasted as long as the last
# one did and a quarter more (RingView.gap_left), at most this long: in the gap vLLM's engine
# core schedules the next step on the core the writer runs on, and writer CPU there lengthened
# the gap by about its length (bench/README.md, nineteenth pass: 0.14-0.27 ms of writer CPU a
# gap, about the armed gaps' growth). A dormant gap on the bench's host lasts 0.9-1.8 ms; a longer one
# is an idle server, whose gap nobody waits on.
GAP_HOLD_NS = 5_000_000
# While idle, the trace directory is checked at most this often (each batch of writes checks it
# first).
GUARD_IDLE_S = 0.1

# glibc serves blocks of at least its mmap threshold from their own mappings, but raises the
# threshold to the size of each such block freed (up to 32 MiB). After the first tail flush
# frees its 1-4 MiB work buffers (c-blosc's, numcodecs' output), those come from the heap,
# where, between small objects, they fragment it: the writer's RssAnon rose 57 -> 93 MB over
# a 20 GB recording (bench/README.md). Fixed (which fixes the trim threshold too), it stays
# flat. HSTRACE_MMAP_THRESHOLD=0 leaves glibc's dynamic threshold (for the bench's side by side).
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def mmap_threshold_from_env(default: int = 1 << 20) -> int:
    """HSTRACE_MMAP_THRESHOLD in bytes; anything but a whole number keeps the default (a
    typo in the server's environment must not stop the writer from starting)."""
    try:
        return int(os.environ.get("HSTRACE_MMAP_THRESHOLD", default))
    except ValueError:
        return default


def fix_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at nbytes; False where not set (0, out of a C int's range,
    refused by glibc, or not glibc)."""
    if not 0 < nbytes < 1 << 31:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return mallopt(_M_MMAP_THRESHOLD, nbytes) == 1


def main(argv: list[str]) -> None:
    """Entry point: `python -m hstrace.trace.write.writer_process PATH RANK TAIL_S RING DATA_FD
    FREE_FD ENDS_FD THREADS RAW`; RING is `fd:N` (a memfd) or a /dev/shm name; RAW is 0 (never
    uncompressed), 1 (while behind, within the disk budget, beyond it when far behind) or b
    (while behind, within the disk budget only).

    Started with subprocess rather than multiprocessing's spawn, which would re-import the
    parent's __main__ (a server launcher inside SGLang, a test runner, a user script)."""
    path, rank, tail_s, ring, data_fd, free_fd, ends_fd, threads, raw_when_behind = argv
    writer_main(
        path,
        int(rank),
        float(tail_s),
        ring,
        Connection(int(data_fd)),
        Connection(int(free_fd)),
        int(ends_fd),
        int(threads),
        raw_when_behind in ("1", "b"),
        raw_when_behind != "b",
    )


class _Replies:
    """The pipes back to the producer: control replies (pickled), and ring counters (raw
    8-byte little-endian, non-blocking: counters only grow, so one that does not fit now is
    superseded by the next). Once the producer is gone, replies are dropped: the writer keeps
    draining what the producer had handed over (issue 12, item 5)."""

    def __init__(self, conn: Connection, ends_fd: int) -> None:
        self.conn = conn
        self.ends_fd = ends_fd
        os.set_blocking(ends_fd, False)
        self.pending: int | None = None
        self.gone = False

    def end(self, n: int) -> None:
        """Hand ring bytes before counter n back to the producer."""
        self.pending = n
        self.flush_end()

    def flush_end(self) -> None:
        if self.pending is None or self.gone:
            return
        try:
            os.write(self.ends_fd, self.pending.to_bytes(8, "little"))
            self.pending = None
        except BlockingIOError:
            pass  # the producer empties the pipe at its next write; a later counter supersedes
        except (BrokenPipeError, ConnectionResetError):
            self.gone = True

    def send(self, msg) -> None:
        if self.gone:
            return
        try:
            self.conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self.gone = True


class _Fatal(Exception):
    """The trace cannot be written any more (disk full, read-only, directory removed)."""


class _Moved(_Fatal):
    """The trace directory was moved (not removed) while recording: what was committed is in
    the moved directory, at `now` (None where the OS cannot tell its new path)."""

    def __init__(self, now: str | None) -> None:
        self.now = now
        where = f"moved to {now}" if now else "moved away (its new path is unknown)"
        super().__init__(f"the trace directory was {where} while recording")


class _Guard:
    """Notices the trace directory being removed or replaced under a running writer: zarr
    would silently recreate `rank{r}/` without the root metadata, and every write would
    'succeed' into a trace nobody can open."""

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.meta = os.path.join(path, "zarr.json")
        # The root and our own rank group (inode numbers alone are reused at once by a
        # trace recreated at the same path; a new trace has no rank group of ours).
        self.dirs = [path, os.path.join(path, f"rank{rank}")]
        self.ident = [self._ident(d) for d in self.dirs]
        # The root kept open: after a move its fd still names it (/proc/self/fd on Linux), so
        # the fault can say where the committed steps went instead of "the trace is gone".
        try:
            self.fd: int | None = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except (OSError, AttributeError):
            self.fd = None

    def whereabouts(self) -> tuple[bool, str | None]:
        """(moved, where): whether the root directory we opened still exists somewhere (moved,
        not removed), and its path now when the OS can tell."""
        if self.fd is None:
            return False, None
        try:
            if os.fstat(self.fd).st_nlink == 0:  # removed: a live directory links at least 2
                return False, None
        except OSError:
            return False, None
        try:
            now = os.readlink(f"/proc/self/fd/{self.fd}")
        except OSError:
            return True, None
        if now.endswith(" (deleted)") or not os.path.isdir(now):
            return False, None
        return os.path.abspath(now) != os.path.abspath(self.path), now

    @staticmethod
    def _ident(d: str) -> tuple[int, int]:
        st = os.stat(d)
        return st.st_dev, st.st_ino

    def check(self) -> None:
        try:
            ok = [self._ident(d) for d in self.dirs] == self.ident and os.path.isfile(self.meta)
        except OSError:
            ok = False
        if not ok:
            moved, now = self.whereabouts()
            if moved:
                raise _Moved(now)
            raise _Fatal("the trace directory was removed or replaced while recording")


def writer_main(
    path: str,
    rank: int,
    tail_flush_s: float,
    ring: str,
    data_r: Connection,
    free_w: Connection,
    ends_fd: int,
    threads: int = 0,
    raw_when_behind: bool = False,
    raw_beyond_budget: bool = True,
) -> None:
    from hstrace.trace.write.placement import name_thread
    from hstrace.trace.write.recorder import RankRecorder

    global COPY_ROWS
    name_thread("hstrace-writer")  # the process's name in ps/top (else "python")
    fix_mmap_threshold(mmap_threshold_from_env())  # read as the writer process starts
    COPY_ROWS = native_rows()
    replies = _Replies(free_w, ends_fd)
    try:
        shm = RingView(ring)
        rowlog.configure(threads, raw_when_behind, raw_beyond_budget)
        rec = RankRecorder(path, rank, tail_flush_s=tail_flush_s)
        rowlog.ENCODER.gap_wait = rec.gap_wait = partial(_gap_wait, shm)
        guard = _Guard(path, rank)
    except (HstraceError, OSError) as exc:
        replies.send(P.Failed(str(exc)))
        return
    # What lives as long as the session (modules, zarr's objects, each table's columns, frozen
    # again as each table is made) is left out of the cyclic collector's full passes: those
    # walked all of it while recording, about 6 % of this process's CPU (a
    # `perf` profile of the writer at a server's pace, bench/writer_idle.py --tiny-world-rows).
    gc.freeze()
    try:
        replies.send(P.Ready())
        _loop(rec, shm, guard, _Pipe(data_r), replies)
    finally:
        shm.close()


class _Pipe:
    """The data pipe as the loop reads it. `Connection.poll(0)` builds a selector at every
    call (~90 us: the idle loop's largest cost, bench/writer_idle.py); one poll object
    registered once answers the same question (data or end of file waiting) in a few us."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.recv_bytes = conn.recv_bytes
        self._poller = select.poll() if hasattr(select, "poll") else None
        if self._poller is not None:
            self._poller.register(conn.fileno(), select.POLLIN)

    def poll(self, timeout: float = 0.0) -> bool:
        if self._poller is None:
            return self.conn.poll(timeout)
        return bool(self._poller.poll(int(timeout * 1000)))


def _loop(rec, shm: RingView, guard: _Guard, data_r: _Pipe, replies: _Replies) -> None:
    try:
        _serve(rec, shm, guard, data_r, replies)
    except _Moved as exc:  # what was committed is in the moved directory: say where
        kept = (
            f"{_kept(exc.now, rec.rank)}, in {exc.now}"
            if exc.now
            else "the committed steps are in the directory that was at "
            f"{guard.path} when recording started"
        )
        _fault(rec, guard, replies, str(exc), commit=False, kept=kept)
    except _Fatal as exc:  # the trace itself is gone: nothing of it is ours to report as kept
        _fault(rec, guard, replies, str(exc), commit=False, kept="nothing (the trace is gone)")
    except OSError as exc:  # disk full, read-only remount, I/O error
        _fault(rec, guard, replies, _describe_os_error(exc), commit=True)
    except Exception as exc:  # noqa: BLE001 - never a traceback into the server's log
        _fault(rec, guard, replies, f"unexpected {type(exc).__name__}: {exc}", commit=True)
    else:
        return
    shm.faulted()


def _describe_os_error(exc: OSError) -> str:
    code = errno.errorcode.get(exc.errno or 0, "")
    what = {
        errno.ENOSPC: "no space left on the device",
        errno.EROFS: "the file system is read-only",
        errno.EDQUOT: "disk quota exceeded",
    }.get(exc.errno or 0, exc.strerror or str(exc))
    where = f" writing {exc.filename}" if exc.filename else ""
    return f"{what}{f' ({code})' if code else ''}{where}"


def _fault(
    rec, guard: _Guard, replies: _Replies, why: str, commit: bool, kept: str | None = None
) -> None:
    """Stop recording: free what we can, commit what is on disk if the disk lets us, and tell
    the producer what happened and what was kept (its next write or close raises it)."""
    for log in rec._all_logs():
        log.abort()  # our temp files: space back on a full disk
    if commit:
        try:
            guard.check()
            rec.commit(clean_close=False)
        except Exception:  # noqa: BLE001 - the last commit on disk stands
            pass
    kept = kept or _kept(guard.path, rec.rank)
    replies.send(P.Fault(f"{guard.path}: rank {rec.rank} stopped recording: {why}; kept: {kept}"))


def _kept(path: str, rank: int) -> str:
    """What the trace holds, from the commit record on disk (not from memory)."""
    meta_path = os.path.join(path, f"rank{rank}", "zarr.json")
    try:
        with open(meta_path, "rb") as f:
            commit = json.load(f)["attributes"]["hstrace"]["commit"]
        steps = {t: int(e["steps"]) for t, e in commit["tables"].items()}
        age = (time.time_ns() - int(commit["updated_ns"])) / 1e9
    except (OSError, ValueError, KeyError, TypeError):
        return f"nothing readable ({meta_path} is gone or unreadable)"
    if not steps:
        return "no committed steps yet"
    listed = ", ".join(f"{n} steps of {t}" for t, n in sorted(steps.items()))
    return f"{listed} (committed {age:.1f} s before the fault; later steps are lost)"


def _abandon(rec) -> None:
    for log in rec._all_logs():
        log.flush_tail()
    rec.commit(clean_close=False)


def _handed(rec, shm: RingView, replies: _Replies, end: int, write, reply: bool) -> None:
    """Write one staged part, then hand its ring space back whatever happened (`reply`: on the
    pipe too, which a producer waiting for room sleeps on)."""
    try:
        write()
    except HstraceError as exc:  # keep recording other tables; the error is in the trace
        rec.note_error("writer", str(exc))
    finally:
        shm.consumed(end)  # the producer reads this word as it stages (no syscall)
        if reply:
            replies.end(end)


def _consume(rec, shm: RingView, data_r: _Pipe, replies: _Replies, end: int, write) -> None:
    """Write one staged part (a pipe message's) and book-keep."""
    far = shm.far_behind(end)
    _handed(rec, shm, replies, end, write, reply=True)
    _booked(rec, shm, data_r, end, far)


def _take(
    rec, shm: RingView, guard: _Guard, data_r: _Pipe, replies, names: dict, taken: int, upto: int
) -> int:
    """Write descriptors [taken, upto) (one-part steps, ring.py), in order; returns upto.

    The trace directory is checked once for the batch, before its first write, as for a pipe
    message: every step of the batch was published before that check. The book-keeping after
    a step (ring space handed back on the pipe, the behind flags, the scan for tail flushes) is
    done once for the batch too, except that a producer about to wait for room gets its space
    at once."""
    if taken >= upto:
        return taken
    guard.check()
    end = 0
    first = taken
    while taken < upto:
        if taken > first:  # a long batch (a backlog) leaves the engine's gaps alone too
            _gap_wait(shm)
        tid, offset, end, counts = shm.descriptor(taken)
        shm.part_read(offset, end)
        taken += 1
        shm.taken(taken)  # the slot's words are read: the producer may reuse it
        write = partial(_write_step, rec, shm, offset, names.get(tid), counts)
        _handed(rec, shm, replies, end, write, reply=taken == upto or shm.far_behind(end))
    _booked(rec, shm, data_r, end, far=shm.far_behind(end))
    return taken


def _booked(rec, shm: RingView, data_r: _Pipe, end: int, far: bool) -> None:
    """After writing what was staged before counter `end`: say whether the writer is behind,
    and look for tail flushes when a scan is due."""
    behind = shm.behind(end)
    rowlog.set_behind(behind, far=far)
    now = time.monotonic()
    if rec.scan_due(now):
        rec.tick(now, backlog=behind or data_r.poll(0))


class _Pacer:
    """The sleep after a batch of work (all the descriptors and pipe messages handled between
    two idle moments): IDLE_POLL_BATCH_S, cut short so that, at the rate the producer staged
    bytes since the last batch, a sleep fills at most SLEEP_RING_SHARE of the ring. `read`:
    bytes of the parts taken so far (RingView.bytes_read)."""

    def __init__(self, ring_bytes: int, read: int, now: float) -> None:
        self.budget = ring_bytes * SLEEP_RING_SHARE
        self.read, self.at = read, now

    def after_batch(self, read: int, now: float) -> float:
        staged, dt = read - self.read, now - self.at
        self.read, self.at = read, now
        if staged <= 0 or dt <= 0:
            return IDLE_POLL_BATCH_S
        return min(IDLE_POLL_BATCH_S, max(IDLE_POLL_MIN_S, self.budget * dt / staged))


def _gap_wait(shm: RingView) -> None:
    """Work found early in the engine's gap (a descriptor, an encoding thread's job, a
    column's tail flush) waits for the next step, once (RingView.gap_left, GAP_HOLD_NS)."""
    try:
        hold = shm.gap_left(time.monotonic_ns(), GAP_HOLD_NS)
    except (AttributeError, ValueError):  # the ring is unmapped (the writer is closing)
        return
    if hold:
        time.sleep(hold / 1e9)


def _serve(rec, shm: RingView, guard: _Guard, data_r: _Pipe, replies: _Replies) -> None:
    # The writer sleeps between polls rather than blocking on the pipe: a pipe write that
    # wakes a blocked reader costs the serving thread tens of microseconds (and, on a busy
    # host, often a preemption); a write to a pipe nobody waits on is a plain copy.
    pacer = _Pacer(shm.size, shm.bytes_read, time.monotonic())
    pause = IDLE_POLL_BATCH_S
    worked = False  # descriptors or pipe messages handled since the loop last went idle
    names: dict[int, str] = {}  # table id -> name (protocol.Table)
    taken = 0  # descriptors written so far
    checked = 0.0  # when the idle loop last looked at the trace directory (_Guard)
    held = False  # the batch waiting now has waited for the engine's gap to end (GAP_HOLD_NS)
    while True:
        # Read PUBLISHED before polling the pipe: a pipe message the poll misses was sent after
        # every descriptor counted here, so those come first (protocol.py `after`).
        published = shm.published()
        if not data_r.poll(0):
            if taken < published:
                # the engine between two steps: the batch waits for the next step, once (an
                # engine whose gaps outnumber its steps would otherwise hold it for good)
                hold = 0 if held else shm.gap_left(time.monotonic_ns(), GAP_HOLD_NS)
                if hold:
                    held = True
                    time.sleep(hold / 1e9)
                    continue
                taken = _take(rec, shm, guard, data_r, replies, names, taken, published)
                held = False
                worked = True
                continue
            replies.flush_end()
            now = time.monotonic()
            if worked:  # the rate over the whole burst: a GPU step comes as several messages
                pause, worked = pacer.after_batch(shm.bytes_read, now), False
            if now - checked >= GUARD_IDLE_S:  # every batch checks; idle, a few times a second
                guard.check()
                checked = now
            rec.drain()  # chunks the encoder finished meanwhile
            deadline = rec.next_deadline()
            if deadline is not None and now >= deadline:
                rec.tick(now, due=True)  # not rate-limited: the loop would spin until it ran
                continue
            rec.tick()  # commits units the drain completed (rate-limited inside)
            time.sleep(pause if deadline is None else min(pause, deadline - now))
            pause = min(2 * pause, IDLE_POLL_MAX_S)
            continue
        worked = True
        try:
            buf = data_r.recv_bytes()
        except (EOFError, OSError):
            # The producer is gone without closing: keep what we have, but not as a clean close.
            # What it published is final now; all of it was handed over.
            guard.check()
            _take(rec, shm, guard, data_r, replies, names, taken, shm.published())
            _abandon(rec)
            return
        guard.check()
        taken = _take(rec, shm, guard, data_r, replies, names, taken, P.after(buf))
        try:
            msg = P.decode(buf)
        except P.NotPlainData as exc:  # the item is lost, said in the trace; recording goes on
            rec.note_error("writer", str(exc))
            continue
        if isinstance(msg, (P.Step, P.Part)):
            shm.part_read(msg.offset, msg.end)
        if isinstance(msg, P.Step):  # a whole step in one part, laid out in spec order
            write = partial(_write_step, rec, shm, msg.offset, names.get(msg.table_id), msg.counts)
            _consume(rec, shm, data_r, replies, msg.end, write)
        elif isinstance(msg, P.Part):
            write = partial(_write_part, rec, shm, names.get(msg.table_id), msg)
            _consume(rec, shm, data_r, replies, msg.end, write)
        elif isinstance(msg, P.Table):
            names[msg.table_id] = msg.name
            try:
                rec.table(msg.name, msg.spec, msg.column_attrs)
            except HstraceError as exc:  # its rows are refused (and noted) as they arrive
                rec.note_error("writer", str(exc))
            gc.freeze()  # see writer_main
        elif isinstance(msg, P.Static):
            rec.update_static(msg.items)
        elif isinstance(msg, P.Error):
            rec.note_error(msg.tap, msg.message)
        elif isinstance(msg, P.Dropped):
            rec.set_dropped(msg.counts)
        elif isinstance(msg, P.Flush):
            rec.set_dropped(msg.dropped)
            for log in rec._all_logs():
                log.flush_tail()
            rec.commit()
            replies.send(P.Flushed())
        elif isinstance(msg, P.Close):
            rec.set_dropped(msg.dropped)
            rec.close()
            replies.send(P.Closed())
            return
        else:
            raise HstraceError(f"unknown message {type(msg).__name__}")


def _table(rec, name: str | None):
    t = rec.tables.get(name) if name is not None else None
    if t is None:
        raise HstraceError(f"table {name!r}: rows arrived before its columns were announced")
    return t


def native_rows(environ: Mapping[str, str] | None = None) -> Any:
    """_native.c's copy_rows where it is built and HSTRACE_NATIVE is not 0, else None (every
    step then takes the Python route, with the same bytes). Imports no torch."""
    env = os.environ if environ is None else environ
    if env.get("HSTRACE_NATIVE", "1") == "0":
        return None
    try:
        from hstrace.trace.write import _native
    except ImportError:
        return None
    return getattr(_native, "copy_rows", None)


# Set by writer_main (native_rows); None: the Python route.
COPY_ROWS = None


def _write_step(rec, shm: RingView, base: int, table: str | None, counts: tuple[int, ...]) -> None:
    """A one-part step: every column of every axis, in spec order, each at a 64-byte aligned
    offset after the previous one (ProcessSink.write_step's layout). Each column's rows go
    straight from the ring into its log, in the log's own dtype and row shape, which is all
    TableLog.append would check: natively in one call (COPY_ROWS: every column whose rows
    fit its chunk buffer, one memcpy each), the rest through RowLog.append_from (its first
    rows since a tail flush, a chunk that ends, a chunk being encoded). This function's thread
    CPU on the tiny world's steps: 37 us a table step through the Python route, 25 natively,
    most of it first touches of new chunk buffers (bench/README.md, fifteenth pass)."""
    t = _table(rec, table)
    now = time.monotonic()
    copy_rows = COPY_ROWS
    if copy_rows is not None:
        flat, state, slow, slow_at = t.fast_state()
        k = copy_rows(shm.addr, shm.size, base, counts, state, len(flat), slow_at)
        if k:
            with memoryview(shm.buf) as src:
                for i, offset in slow[:k].tolist():
                    log, axis = flat[i]
                    log.append_from(src, offset, counts[axis], now)
    else:
        offset = base
        with memoryview(shm.buf) as src:
            for logs, n in zip(t.layout(), counts, strict=True):
                for log, row_bytes in logs:
                    if n:
                        log.append_from(src, offset, n, now)
                    offset += -(-n * row_bytes // ALIGN) * ALIGN
    t.end_step(dict(zip(t.cols, counts, strict=True)), now)


def _write_part(rec, shm: RingView, table: str | None, part: P.Part) -> None:
    t = _table(rec, table)
    rows: dict[str, dict[str, np.ndarray]] = {}
    for axis, col, offset, n in part.layout:
        log = t.cols[axis][col]
        count = n * math.prod(log.row_shape)
        view = np.frombuffer(shm.buf, dtype=log.dtype, count=count, offset=part.offset + offset)
        rows.setdefault(axis, {})[col] = view.reshape(n, *log.row_shape)
    now = time.monotonic()
    t.append(rows, now)
    if part.counts is not None:
        t.end_step(part.counts, now)


if __name__ == "__main__":
    main(sys.argv[1:])
