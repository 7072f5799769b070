"""Messages between a producer (`ProcessSink`) and its rank's writer process.

Imports no torch and no zarr: both sides use it. Three one-way channels, each in order:

  producer -> writer, the descriptor queue in shared memory (hstrace/trace/write/ring.py): the
      host fast path's one-part steps, as fixed int64 slots (table id, ring offset, ring end,
      row counts) published by a counter, no syscall per step
  producer -> writer, the data pipe (multiprocessing Connection framing: a 4-byte big-endian
  length, then the payload; every message carries `after`, the number of descriptors the
  producer had published when it sent it: the writer takes those first, which orders the
  two channels as the producer wrote them):
      Step     one whole step in one ring part, columns in spec order, each at an ALIGN-aligned
               offset after the previous one (a fixed struct, not a pickle), where no
               descriptor slot was free
      Table    a table's id, name, spec and column attributes, before its first rows
      Part     rows of one step in a ring part, with their layout; `counts` on a step's last part
      Static | Error | Dropped | Flush | Close     control (pickled, after a CONTROL byte)
  writer -> producer, the reply pipe (pickled by Connection.send):
      Ready | Failed once at start; Flushed / Closed answering Flush / Close; Fault once, when the
      trace cannot be written any more (disk full, read-only, directory removed), before exiting
  writer -> producer, the ends pipe: raw 8-byte little-endian ring counters, one per consumed
      part (the producer's head after that part: the bytes before it are free again)

A part occupies ring bytes [offset, offset + size); dtypes and row shapes come from the table's
spec. `end` is always the producer's ring counter after the part.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
from dataclasses import dataclass
from typing import Any

# Part and column alignment in the ring.
ALIGN = 64

# First payload byte of a data-pipe message.
STEP = 1
CONTROL = 2

_LEN = struct.Struct("!i")
# kind, after, table id, ring offset, ring end; then one int64 row count per axis of the table.
_STEP_HEAD = "!BqHqq"
_AFTER = struct.Struct("!q")  # right after the kind byte of every data-pipe message


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class Step:
    table_id: int
    offset: int
    end: int
    counts: tuple[int, ...]  # rows per axis, in spec order (the step axis: 1)


@dataclass(frozen=True, slots=True)
class Table:
    table_id: int
    name: str
    spec: dict
    column_attrs: dict | None


@dataclass(frozen=True, slots=True)
class Part:
    table_id: int
    offset: int
    end: int
    layout: tuple[tuple[str, str, int, int], ...]  # (axis, column, byte offset in part, rows)
    counts: dict[str, int] | None  # set on a step's last part: the step is complete


@dataclass(frozen=True, slots=True)
class Static:
    items: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Error:
    tap: str
    message: str


@dataclass(frozen=True, slots=True)
class Dropped:
    counts: dict[str, int]  # steps dropped so far per table (on_full="drop")


@dataclass(frozen=True, slots=True)
class Flush:
    dropped: dict[str, int]


@dataclass(frozen=True, slots=True)
class Close:
    dropped: dict[str, int]


@dataclass(frozen=True, slots=True)
class Ready:
    pass


@dataclass(frozen=True, slots=True)
class Failed:
    message: str


@dataclass(frozen=True, slots=True)
class Flushed:
    pass


@dataclass(frozen=True, slots=True)
class Closed:
    pass


@dataclass(frozen=True, slots=True)
class Fault:
    message: str


class StepCodec:
    """Packs `Step` messages of one table (a fixed number of axes) into framed bytes: one
    `struct.pack` and one pipe write per step, ~1 us, where a pickle was ~5-10 us."""

    def __init__(self, table_id: int, n_axes: int) -> None:
        self.table_id = table_id
        body = struct.Struct(_STEP_HEAD + "q" * n_axes)
        self._st = struct.Struct("!i" + body.format[1:])
        self._size = body.size

    def frame(
        self, offset: int, end: int, counts: tuple[int, ...] | list[int], after: int
    ) -> bytes:
        return self._st.pack(self._size, STEP, after, self.table_id, offset, end, *counts)


def frame_control(msg: Any, after: int) -> bytes:
    """A control or layout message as framed bytes for the data pipe, to be taken after the
    first `after` descriptors."""
    body = bytes((CONTROL,)) + _AFTER.pack(after) + pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


def after(buf: bytes) -> int:
    """How many descriptors the writer takes before this data-pipe payload's message."""
    return _AFTER.unpack_from(buf, 1)[0]


_HEAD = struct.Struct(_STEP_HEAD)


def decode(buf: bytes) -> Any:
    """A data-pipe payload (without its length) as its message."""
    if buf[0] == STEP:
        _, _, tid, offset, end = _HEAD.unpack_from(buf)
        n = (len(buf) - _HEAD.size) // 8
        counts = struct.unpack_from(f"!{n}q", buf, _HEAD.size)
        return Step(tid, offset, end, counts)
    if buf[0] == CONTROL:
        # Our own producer's pipe (inherited descriptors), never a file or a socket.
        return _Plain(io.BytesIO(memoryview(buf)[1 + _AFTER.size :])).load()
    raise ValueError(f"unknown message kind {buf[0]}")


class NotPlainData(pickle.UnpicklingError):
    """A control message names a class of a module the reading side has not imported."""


class _Plain(pickle.Unpickler):
    """Unpickles only classes of modules already imported here: a message never makes the
    writer import anything (a pickled `torch.__version__` once made it import torch, 4 CPU
    seconds taken from serving at every arm)."""

    def find_class(self, module: str, name: str) -> Any:
        if module not in sys.modules:
            raise NotPlainData(f"a control message carries {module}.{name}, not plain data")
        return super().find_class(module, name)
