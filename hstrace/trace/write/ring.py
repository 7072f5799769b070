"""The staging ring's shared memory, both sides of it.

`Segment` is the producer's: on Linux a memfd (no name; the writer process inherits its
descriptor, so no kill can leave anything behind), elsewhere a named /dev/shm segment unlinked
as soon as both sides have mapped it. `RingView` is the writer process's mapping of it. The
ring is followed by ALIGN bytes of counters (HEAD, TAIL, FAULT, PUBLISHED, TAKEN, STEP_* below), then
the descriptor queue (DESC_*). Imports no torch (the writer process uses it).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from hstrace.errors import TraceError
from hstrace.trace.write.protocol import ALIGN

# The ALIGN bytes after the ring, as int64 words: the producer's head counter (how far the
# writer is behind), the writer's consumed counter (ring space back to the producer without a
# pipe read) and a fault flag (a Fault reply is waiting: the producer reads its pipe then);
# then the descriptors the producer has published and those the writer has taken; then when
# the producer's engine step last started and last ended (CLOCK_MONOTONIC ns; 0: never told),
# and how long the gap before the last start lasted (ns).
HEAD, TAIL, FAULT, PUBLISHED, TAKEN = 0, 1, 2, 3, 4
STEP_STARTED, STEP_ENDED, STEP_GAP = 5, 6, 7
# A gap is expected to last as long as the last one, a quarter more and this margin.
GAP_MARGIN_NS = 200_000
TRAILER_WORDS = ALIGN // 8

# The descriptor queue after the trailer: DESC_SLOTS slots of DESC_WORDS int64 words, descriptor
# j in slot j % DESC_SLOTS: table id, ring offset, ring end, axis count, then one row count per
# axis (tables of at most DESC_AXES axes). The producer fills a slot, then stores PUBLISHED; a
# slot is reused only once TAKEN is past it. 4096 slots: a writer 4096 steps behind (or a table
# of more axes) sends its steps down the data pipe instead, in order (protocol.py `after`).
DESC_SLOTS = 4096
DESC_WORDS = 8
DESC_AXES = DESC_WORDS - 4
DESC_BYTES = DESC_SLOTS * DESC_WORDS * 8


def segment_bytes(ring_bytes: int) -> int:
    """The whole shared mapping of a ring of ring_bytes: ring, trailer, descriptor queue."""
    return ring_bytes + ALIGN + DESC_BYTES


class Segment:
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


def unexported_view(mm: mmap.mmap, size: int) -> np.ndarray:
    """The mapping as a uint8 array that does not hold a buffer export on it (as
    `np.frombuffer(mm)` would), so it can be closed whatever order views and writer are
    collected in. Only the writer uses these views, never after `_release`."""
    anchor = ctypes.c_char.from_buffer(mm)  # a momentary export, just for the address
    addr = ctypes.addressof(anchor)
    del anchor
    return np.ctypeslib.as_array(ctypes.cast(addr, ctypes.POINTER(ctypes.c_uint8)), (size,))


def release_segment(seg: Segment) -> None:
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


class RingView:
    """The producer's staging ring: a memfd passed down (it has no name, so no kill leaves it
    behind), or a /dev/shm segment mapped directly (not through SharedMemory: its resource
    tracker would unlink the producer's segment when we exit). Its last ALIGN bytes hold the
    producer's head counter, from which the writer knows how far behind it is."""

    def __init__(self, ring: str) -> None:
        if ring.startswith("fd:"):
            fd = int(ring[3:])
        else:
            fd = os.open(os.path.join("/dev/shm", ring.lstrip("/")), os.O_RDWR)
        try:
            self.buf = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self.size = len(self.buf) - ALIGN - DESC_BYTES
        anchor = ctypes.c_char.from_buffer(self.buf)  # a momentary export, for the address
        self.addr = ctypes.addressof(anchor)  # of the ring's first byte (_native.c copy_rows)
        del anchor
        self._trailer = np.frombuffer(
            self.buf, dtype=np.int64, count=TRAILER_WORDS, offset=self.size
        )
        self._head = self._trailer[HEAD : HEAD + 1]
        self.bytes_read = 0  # of the parts taken so far (part_read): the producer's rate
        self._desc = np.frombuffer(
            self.buf, dtype=np.int64, count=DESC_SLOTS * DESC_WORDS, offset=self.size + ALIGN
        )

    def published(self) -> int:
        """How many descriptors the producer has published so far."""
        return int(self._trailer[PUBLISHED])

    def descriptor(self, j: int) -> tuple[int, int, int, tuple[int, ...]]:
        """Descriptor j (published): (table id, ring offset, ring end, row counts per axis)."""
        s = (j % DESC_SLOTS) * DESC_WORDS
        w = self._desc[s : s + DESC_WORDS].tolist()
        n = w[3]
        if not 0 <= n <= DESC_AXES:
            raise ValueError(f"descriptor {j}: {n} axes")
        return w[0], w[1], w[2], tuple(w[4 : 4 + n])

    def part_read(self, offset: int, end: int) -> None:
        """Count a part the writer takes: ring bytes [offset, end's position), a part ending at
        the ring's end ending at its size (a part never wraps and is at most half the ring; the
        head counter itself also jumps over padding and restarts, so it is not the rate)."""
        self.bytes_read += (end - offset) % self.size

    def taken(self, j: int) -> None:
        """Publish that descriptors before j are read: their slots may be reused."""
        self._trailer[TAKEN] = j

    def behind(self, end: int) -> bool:
        """Whether the bytes staged after `end` fill more than half the ring."""
        return int(self._head[0]) - end > self.size // 2

    def far_behind(self, end: int) -> bool:
        """Whether the bytes staged after `end` fill more than three quarters of the ring: the
        producer is about to wait for room."""
        return int(self._head[0]) - end > self.size * 3 // 4

    def consumed(self, end: int) -> None:
        """Publish that the bytes before counter `end` are free again (after the pipe write of
        the same counter: the producer reads this word instead of the pipe, no syscall)."""
        self._trailer[TAIL] = end

    def gap_left(self, now_ns: int, hold_ns: int) -> int:
        """Nanoseconds the writer should hold its work: the producer's engine is between two
        steps (its last step ended after the last one started) and the gap is younger than
        the last one lasted (and a quarter, and GAP_MARGIN_NS; `hold_ns` where none was told),
        so the rest of it is left to the engine's scheduling; else 0 (in a step, a gap longer
        than expected (an idle server), or a producer that never says). Never more than
        `hold_ns`, whatever the words say."""
        tr = self._trailer
        started, ended = int(tr[STEP_STARTED]), int(tr[STEP_ENDED])
        if ended <= started:
            return 0
        gap = int(tr[STEP_GAP])
        expect = gap + gap // 4 + GAP_MARGIN_NS if gap > 0 else hold_ns
        return min(hold_ns, max(0, ended + min(expect, hold_ns) - now_ns))

    def faulted(self) -> None:
        """Tell the producer, once the Fault reply is on its pipe, that there is one."""
        self._trailer[FAULT] = 1

    def close(self) -> None:
        del self._head, self._trailer, self._desc
        try:
            self.buf.close()
        except BufferError:  # a numpy view still alive at exit; the OS unmaps it
            pass
