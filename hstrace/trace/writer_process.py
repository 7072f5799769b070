"""The writer process of one rank: drains the staging ring into a RankRecorder.

Imports no torch: it only needs numpy and zarr, so it starts fast and stays small. Protocol
(all over two one-way pipes, in order):
  producer -> writer  ("part", table, offset, end, layout, counts|None, spec|None, column_attrs|None, dropped)
                      ("static", dict) | ("error", tap, message) | ("flush",) | ("close",)
  writer -> producer  ("ready",) | ("failed", message) once at start; then, for each part
                      consumed, its `end` (int: the producer's ring counter after that part, so
                      the bytes before it are free again); ("flushed",) / ("closed",) answering
                      flush / close.
A part occupies ring bytes [offset, offset + size); `layout` lists (axis, column, byte offset
within the part, rows); dtype and row shape come from the table's spec, sent with the first
step of each table.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import time
from functools import partial
from multiprocessing.connection import Connection

import numpy as np

from hstrace.errors import HstraceError

# Part and column alignment in the ring (hstrace.trace.writer.ALIGN; that module imports torch).
ALIGN = 64
# Sleep between polls of an idle pipe: starts short, doubles while idle, up to the max.
IDLE_POLL_MIN_S = 0.001
IDLE_POLL_MAX_S = 0.016


def main(argv: list[str]) -> None:
    """Entry point: `python -m hstrace.trace.writer_process PATH RANK TAIL_S SHM DATA_FD FREE_FD`.

    Started with subprocess rather than multiprocessing's spawn, which would re-import the
    parent's __main__ (a server launcher inside SGLang, a test runner, a user script)."""
    path, rank, tail_s, shm_name, data_fd, free_fd = argv
    writer_main(
        path,
        int(rank),
        float(tail_s),
        shm_name,
        Connection(int(data_fd)),
        Connection(int(free_fd)),
    )


class _Ring:
    """The producer's shared-memory ring, mapped directly from /dev/shm. Not through
    SharedMemory: its resource tracker would unlink the producer's segment when we exit."""

    def __init__(self, name: str) -> None:
        fd = os.open(os.path.join("/dev/shm", name.lstrip("/")), os.O_RDWR)
        try:
            self.buf = mmap.mmap(fd, 0)
        finally:
            os.close(fd)

    def close(self) -> None:
        try:
            self.buf.close()
        except BufferError:  # a numpy view still alive at exit; the OS unmaps it
            pass


def writer_main(
    path: str,
    rank: int,
    tail_flush_s: float,
    shm_name: str,
    data_r: Connection,
    free_w: Connection,
) -> None:
    from hstrace.trace.recorder import RankRecorder

    try:
        rec = RankRecorder(path, rank, tail_flush_s=tail_flush_s)
    except HstraceError as exc:
        free_w.send(("failed", str(exc)))
        return
    shm = _Ring(shm_name)
    try:
        free_w.send(("ready",))
        _loop(rec, shm, data_r, free_w)
    finally:
        shm.close()


def _loop(rec, shm: _Ring, data_r: Connection, free_w: Connection) -> None:
    try:
        _serve(rec, shm, data_r, free_w)
    except (BrokenPipeError, ConnectionResetError):
        # The producer went away while we answered it: what it sent is written; keep it, as
        # an unclean close (no traceback into the server's stderr).
        _abandon(rec)


def _abandon(rec) -> None:
    for log in rec._all_logs():
        log.flush_tail()
    rec.commit(clean_close=False)


def _consume(rec, data_r: Connection, free_w: Connection, end, dropped, write) -> None:
    """Write one staged part, hand its ring space back whatever happened, then book-keep."""
    try:
        write()
    except HstraceError as exc:  # keep recording other tables; the error is in the trace
        rec.note_error("writer", str(exc))
    finally:
        free_w.send(end)
    if dropped is not None:
        rec.set_dropped(dropped)
    rec.tick(backlog=data_r.poll(0))


def _serve(rec, shm: _Ring, data_r: Connection, free_w: Connection) -> None:
    # The writer sleeps between polls rather than blocking on the pipe: a pipe write that
    # wakes a blocked reader costs the serving thread tens of microseconds (and, on a busy
    # host, often a preemption); a write to a pipe nobody waits on is a plain copy.
    pause = IDLE_POLL_MIN_S
    while True:
        if not data_r.poll(0):
            deadline = rec.next_deadline()
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                rec.tick()
                continue
            time.sleep(pause if deadline is None else min(pause, deadline - now))
            pause = min(2 * pause, IDLE_POLL_MAX_S)
            continue
        pause = IDLE_POLL_MIN_S
        try:
            msg = data_r.recv()
        except (EOFError, OSError):
            # The producer is gone without closing: keep what we have, but not as a clean close.
            _abandon(rec)
            return
        kind = msg[0]
        if kind == "step":  # a whole step in one part, laid out in spec order (the fast path)
            _, table, offset, end, counts, dropped = msg
            write = partial(_write_step, rec, shm, offset, table, counts)
            _consume(rec, data_r, free_w, end, dropped, write)
        elif kind == "part":
            _, table, offset, end, layout, counts, spec, column_attrs, dropped = msg
            write = partial(
                _write_part, rec, shm, offset, table, layout, counts, spec, column_attrs
            )
            _consume(rec, data_r, free_w, end, dropped, write)
        elif kind == "static":
            rec.update_static(msg[1])
        elif kind == "error":
            rec.note_error(msg[1], msg[2])
        elif kind == "dropped":
            rec.set_dropped(msg[1])
        elif kind == "flush":
            for log in rec._all_logs():
                log.flush_tail()
            rec.commit()
            free_w.send(("flushed",))
        elif kind == "close":
            if msg[1:] and msg[1] is not None:
                rec.set_dropped(msg[1])
            rec.close()
            free_w.send(("closed",))
            return


def _write_step(rec, shm: _Ring, base: int, table: str, counts: tuple[int, ...]) -> None:
    """A fast-path step: every column of every axis, in spec order, each at a 64-byte
    aligned offset after the previous one (the producer's `_fast_write` layout)."""
    t = rec.tables.get(table)
    if t is None:
        raise HstraceError(f"table {table!r}: rows arrived before its columns were announced")
    rows: dict[str, dict[str, np.ndarray]] = {}
    offset = base
    for (axis, cols), n in zip(t.cols.items(), counts, strict=True):
        rows[axis] = {}
        for col, log in cols.items():
            count = n * log.row_items
            rows[axis][col] = np.frombuffer(
                shm.buf, dtype=log.dtype, count=count, offset=offset
            ).reshape(n, *log.row_shape)
            offset += -(-count * log.dtype.itemsize // ALIGN) * ALIGN
    now = time.monotonic()
    t.append(rows, now)
    t.end_step(dict(zip(t.cols, counts, strict=True)), now)


def _write_part(rec, shm: _Ring, base: int, table: str, layout, counts, spec, column_attrs) -> None:
    if spec is not None and table not in rec.tables:
        rec.table(table, spec, column_attrs)
    t = rec.tables.get(table)
    if t is None:
        raise HstraceError(f"table {table!r}: rows arrived before its columns were announced")
    rows: dict[str, dict[str, np.ndarray]] = {}
    for axis, col, offset, n in layout:
        log = t.cols[axis][col]
        count = n * math.prod(log.row_shape)
        view = np.frombuffer(shm.buf, dtype=log.dtype, count=count, offset=base + offset)
        rows.setdefault(axis, {})[col] = view.reshape(n, *log.row_shape)
    now = time.monotonic()
    t.append(rows, now)
    if counts is not None:
        t.end_step(counts, now)


if __name__ == "__main__":
    main(sys.argv[1:])
