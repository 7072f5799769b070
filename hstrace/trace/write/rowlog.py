"""One append-only column on disk: whole-unit writes, an age-bounded tail, capacity growth.

Why this shape (reference/trace-storage.md §1, §6): `Array.append` rewrites metadata and
re-encodes a partial chunk on every call, and under SIGKILL leaves a shape that runs ahead of
the data. Here rows are staged in RAM and written one whole unit (a chunk, or a whole shard)
at a time, so no key is ever read-modify-written on the hot path; the shape is a capacity
grown in big steps, and how many rows are valid lives only in the rank's commit record.

The data path bypasses zarr's (asyncio, per-call) write pipeline, which ran at ~150 MB/s
against ~650 MB/s for the codec alone (bench/README.md): zarr creates every array and its
metadata, but chunks and shards are encoded here with the very codec chain the metadata
declares (bytes little-endian + Blosc zstd byte shuffle; shards: chunks back to back, then
the uint64 (offset, nbytes) index and its crc32c), and written as files next to zarr's,
atomically (temp file + rename, as zarr's LocalStore does; a shard a tail flush made durable
is then live at its key, a valid shard at every moment: _Shard; an unsharded key a tail flush
rewrites is swapped with a spare written in place: TailFile). Plain zarr reads them.

Chunks are encoded as soon as they fill, by a small thread pool (Blosc releases the GIL), and
appended to their shard's temp file, so a writer holds a few chunks per column in RAM, not a
whole shard. While the writer process says it is behind (`set_behind`), chunks may be stored
with Blosc level 0 (a valid Blosc frame holding the bytes as they are: readers need nothing
new), but only while every encoding thread is busy and a chunk already waits for one (an idle
encoder compresses without delaying anything, and a raw chunk costs the device 1.47x the
bytes), and only while what the writer has put on disk stays within DISK_BUDGET of the bytes
it was given: a writer whose encoders are its bound compresses just enough chunks to keep the
trace at <= 0.8x its raw size and stores the rest as they are. Only when the ring is more than
3/4 full (the producer is about to wait for room) does not blocking the server come first and
chunks go raw beyond the budget (unless
`raw_beyond_budget` is off: then the budget holds and the producer waits). Each column counts
its uncompressed chunks (`raw_chunks`); the commit record says so.

Shards (the wide columns: nearly all the bytes) are written with O_DIRECT where the file system
takes it: the kernel's copy into the page cache cost the writer ~0.7 CPU s per GB written, as
much as half the codec (bench/README.md), and a recorder beside a server should not fill its
page cache with trace either. So are an unsharded column's whole chunks (_write_chunk_file;
on this project's 2-vCPU VM each MB through the page cache took fresh pages at ~4 ms of CPU);
only its tail flushes, which rewrite a key in place, go through the page cache. Each chunk is
compressed into one of a few page-aligned buffers the column reuses (blosc_into.py) and
written at a block-aligned offset of its shard: the shard index says where each chunk is, so
the few hundred bytes of padding after a chunk are never read. Elsewhere (tmpfs, a file system without O_DIRECT) the same files are written
through the page cache, packed. With encoding threads, the writes themselves are made by one
I/O thread, in order, while the writer's main thread goes on feeding the encoders.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import math
import os
import struct
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import google_crc32c
import numcodecs.blosc
import numpy as np
import zarr
from numcodecs import Blosc
from zarr.codecs import BloscCodec
from zarr.core.sync import sync
from zarr.storage import LocalStore

from hstrace.trace.codecs import blosc_into, blosc_planes, blosc_tail
from hstrace.trace.codecs.blosc_into import aligned_buffer, padded
from hstrace.trace.liveshard import live_layout
from hstrace.trace.schema import unit_rows
from hstrace.trace.write.placement import name_thread

# The codec zarr.json declares: Blosc zstd-1, byte shuffle, 1 MiB blocks (releases the GIL).
# 2-byte chunks are encoded by blosc_planes into frames of the same format (_compress_into).
CNAME, CLEVEL, SHUFFLE, BLOCKSIZE = "zstd", 1, "shuffle", 1 << 20
ZARR_JSON = "zarr.json"  # a node's metadata key
COMPRESSORS = [BloscCodec(cname=CNAME, clevel=CLEVEL, shuffle=SHUFFLE, blocksize=BLOCKSIZE)]
# Capacity grows by this many units at a time, so zarr.json is rewritten rarely.
GROW_UNITS = 64
# Chunks of one column being encoded at once; the column waits for the oldest beyond this.
MAX_INFLIGHT = 4
# Encoded chunks of one column waiting for the I/O thread; the column waits beyond this.
MAX_WRITES = 4
# While behind, chunks are stored uncompressed only while the bytes on disk (compressed chunks
# as encoded, in-flight ones estimated at the ratio seen so far) stay within this share of the
# bytes recorded (issue 14: disk <= 0.8x raw).
DISK_BUDGET = 0.8
# Stored/raw ratio assumed for a compressed chunk before any has finished (zstd-1 + byte
# shuffle on bf16 activations: 0.68-0.70, bench/README.md).
_FIRST_RATIO = 0.7
# An empty inner chunk in a shard index (zarr's sharding codec).
_EMPTY = np.uint64(2**64 - 1)
# Room before a chunk buffer's rows for a Blosc header: a raw chunk is then a frame in place.
_HEAD = 16
# A column's words in its table's state array, as _native.c copy_rows reads and writes them
# (recorder.py TableLog.fast_state): where its chunk buffer is (0: none in hand), the rows in
# it, a chunk's rows, a row's bytes, the axis that counts its rows, and the gate (1: its next
# rows take the Python route: its first since a tail flush, or a chunk of it being encoded).
CR_DST, CR_FILL, CR_CAP, CR_ROWB, CR_AXIS, CR_GATE = range(6)
CR_WORDS = 8


class Aligned:
    """An encoded chunk in page-aligned memory: the frame is block[:nbytes], and block holds
    at least padded(nbytes) bytes (what an O_DIRECT write of it needs). `cached`: write it
    through the page cache (a raw chunk of a writer far behind, past the disk budget: the page
    cache takes it at memory speed and the device catches up later; an O_DIRECT write would
    wait for the device exactly when the writer can least afford it)."""

    __slots__ = ("block", "nbytes", "cached")

    def __init__(self, block: np.ndarray, nbytes: int, cached: bool = False) -> None:
        self.block = block
        self.nbytes = nbytes
        self.cached = cached


class Encoder:
    """How chunks are encoded in this process: the thread pool, and level 0 while behind."""

    def __init__(self) -> None:
        self.threads = 0
        self.raw_when_behind = False
        # Far behind, chunks may go raw beyond DISK_BUDGET (False: the budget is a hard bound
        # and the producer waits for ring room instead).
        self.raw_beyond_budget = True
        self.behind = False
        # Far behind: the producer is about to wait for ring room. Not blocking the server
        # comes before the disk budget then (issue 14: store it uncompressed and say so).
        self.far_behind = False
        self._pool: ThreadPoolExecutor | None = None
        # Shard writes, in order, off the writer's main thread (with encoding threads only):
        # an O_DIRECT write waits for the device, and on the main thread that wait left the
        # encoders without chunks to compress (perf: the main thread spent 0.95 of 2.4 s in
        # shard writes while both encoders idled ~60 %, bench/README.md).
        self.io: ThreadPoolExecutor | None = None
        self._codecs: dict[tuple[int, int], Blosc] = {}
        self._lock = threading.Lock()
        self._queued = 0  # chunks handed to the pool that no encoding thread has started
        # Called by an encoding thread before each job (the writer process: wait, once, while
        # the producer's engine is early in the gap between two steps); None: start at once.
        self.gap_wait: Callable[[], None] | None = None
        self._reset_budget()
        # Read when a writer is built (read_flags), not at import.
        # Shards written with O_DIRECT where the file system takes it (False: the page cache).
        self.direct_io = True
        # 2-byte chunks as byte planes (blosc_planes; False: c-blosc, HSTRACE_PLANES=0).
        self.planes = False
        # Chunks compressed into the column's aligned buffers (blosc_into; False: numcodecs).
        self.into = False

    def read_flags(self, environ: Mapping[str, str] | None = None) -> None:
        """Read HSTRACE_DIRECT_IO and HSTRACE_PLANES and bind the codecs (on first use): when
        a writer builds its columns (RowLog) or the writer process configures this encoder."""
        env = os.environ if environ is None else environ
        self.direct_io = env.get("HSTRACE_DIRECT_IO", "1") != "0"
        self.planes = blosc_planes.enabled(env)
        self.into = blosc_into.available()

    def _reset_budget(self) -> None:
        # Bytes handed to the encoder; bytes stored for finished chunks; raw bytes of chunks
        # still being compressed; compressed chunks' bytes in and out (their ratio so far).
        self.bytes_in = 0
        self.bytes_stored = 0
        self.bytes_pending = 0
        self._done_in = 0
        self._done_out = 0

    def configure(
        self, threads: int, raw_when_behind: bool, raw_beyond_budget: bool = True
    ) -> None:
        """threads: encoding threads (0: encode on the caller's thread)."""
        # One Blosc thread per call, whichever thread calls: numcodecs otherwise fans a call
        # from the main thread out to blosc's global threads (behind a global lock).
        numcodecs.blosc.use_threads = False
        for pool in (self._pool, self.io):
            if pool is not None:
                pool.shutdown(wait=True)
        self.threads = max(0, int(threads))
        self._pool = (
            ThreadPoolExecutor(
                self.threads,
                thread_name_prefix="hstrace-encode",
                initializer=name_thread,
                initargs=("hstrace-encode",),
            )
            if self.threads
            else None
        )
        self.io = (
            ThreadPoolExecutor(
                1,
                thread_name_prefix="hstrace-io",
                initializer=name_thread,
                initargs=("hstrace-io",),
            )
            if self.threads
            else None
        )
        self.raw_when_behind = bool(raw_when_behind)
        self.raw_beyond_budget = bool(raw_beyond_budget)
        self._reset_budget()

    @property
    def past_budget(self) -> bool:
        """Chunks may go raw beyond DISK_BUDGET now: far behind, and allowed to."""
        return self.far_behind and self.raw_beyond_budget

    def _ratio(self) -> float:
        return self._done_out / self._done_in if self._done_in else _FIRST_RATIO

    def encoders_busy(self) -> bool:
        """Every encoding thread is busy and a chunk waits for one (always, without threads:
        the writer's own thread encodes). Only then does a raw chunk save the writer time."""
        return self._pool is None or self._queued > 0

    def may_store_raw(self, nbytes: int) -> bool:
        """Whether a chunk of nbytes may go uncompressed now: only while behind (and allowed
        to) with the encoders busy, and only while the trace stays within DISK_BUDGET of its
        raw size with it."""
        if not (self.raw_when_behind and self.behind and self.encoders_busy()):
            return False
        if self.past_budget:
            return True
        with self._lock:
            on_disk = self.bytes_stored + self.bytes_pending * self._ratio() + nbytes
            return on_disk <= DISK_BUDGET * (self.bytes_in + nbytes)

    def _finished(self, nbytes: int, fut: Future) -> None:
        try:
            out = _nbytes(fut.result())
        except BaseException:  # noqa: BLE001 - the column raises it where it drains the chunk
            out = nbytes
        with self._lock:
            self.bytes_pending -= nbytes
            self.bytes_stored += out
            self._done_in += nbytes
            self._done_out += out

    def codec(self, typesize: int, raw: bool) -> Blosc:
        key = (typesize, 0 if raw else CLEVEL)
        c = self._codecs.get(key)
        if c is None:
            with self._lock:
                c = self._codecs[key] = Blosc(
                    cname=CNAME,
                    clevel=key[1],
                    shuffle=Blosc.SHUFFLE,
                    blocksize=BLOCKSIZE,
                    typesize=typesize,
                )
        return c

    def submit(
        self, chunk: np.ndarray, block: np.ndarray | None = None, out: np.ndarray | None = None
    ) -> tuple[Future, bool]:
        """Encode a chunk (C-contiguous, little-endian); (future of the encoded chunk, stored
        raw?). `block`: page-aligned memory holding _HEAD bytes and then the chunk (a raw
        chunk becomes a frame in place); `out`: a page-aligned buffer to compress into (room
        for chunk.nbytes + 16). Without them: bytes, or a raw frame's parts."""
        n = chunk.nbytes
        raw = self.may_store_raw(n)
        with self._lock:
            self.bytes_in += n
            if raw:
                self.bytes_stored += n + 16  # a level-0 Blosc frame: the bytes and its header
            else:
                self.bytes_pending += n
        if raw:
            f: Future = Future()
            f.set_result(
                # Past the budget (far behind, the server about to wait) through the page
                # cache, which takes it at memory speed; within it with O_DIRECT, as the rest.
                raw_frame_in_place(chunk, block, cached=self.past_budget)
                if block is not None
                else raw_frame(chunk)
            )
            return f, raw
        work = (
            partial(_compress_into, chunk, out)
            if out is not None and self.into
            else partial(self.encode, chunk)
        )
        if self._pool is None:
            f = Future()
            f.set_result(work())
        else:
            with self._lock:
                self._queued += 1
            f = self._pool.submit(self._started, work)
        f.add_done_callback(partial(self._finished, n))
        return f, raw

    def _started(self, work):
        with self._lock:
            self._queued -= 1
        wait = self.gap_wait
        if wait is not None:
            wait()
        return work()

    def encode(self, chunk: np.ndarray):
        """The chunk's frame in new memory (bytes-like): byte planes for 2-byte values, as
        _compress_into, else c-blosc zstd-1 through numcodecs."""
        if self.planes and blosc_planes.applies(chunk):
            out = np.empty(chunk.nbytes + blosc_planes.MAX_OVERHEAD, np.uint8)
            return memoryview(out)[: blosc_planes.compress_into(chunk, out, BLOCKSIZE)]
        return self.codec(chunk.dtype.itemsize, False).encode(chunk)


ENCODER = Encoder()


def raw_frame(chunk: np.ndarray) -> list:
    """The chunk as a Blosc level-0 frame without copying it: Blosc's own 16-byte header
    (format 2, zstd, byte shuffle flag, memcpyed, no split; the same bytes numcodecs writes at
    clevel 0, tests/test_rowlog.py) followed by the chunk's buffer itself."""
    n = chunk.nbytes
    head = struct.pack("<BBBBIII", 2, 1, 0x93, chunk.dtype.itemsize, n, min(BLOCKSIZE, n), n + 16)
    return [head, memoryview(chunk).cast("B")]


def raw_frame_in_place(chunk: np.ndarray, block: np.ndarray, cached: bool = True) -> Aligned:
    """The same frame as raw_frame, in place: `block` holds _HEAD bytes before the chunk's
    rows, and the header goes there. `cached`: written through the page cache (see Aligned)."""
    n = chunk.nbytes
    head = struct.pack("<BBBBIII", 2, 1, 0x93, chunk.dtype.itemsize, n, min(BLOCKSIZE, n), n + 16)
    block[:_HEAD] = np.frombuffer(head, dtype=np.uint8)
    return Aligned(block, n + _HEAD, cached=cached)


def _compress_into(chunk: np.ndarray, out: np.ndarray) -> Aligned:
    """Encode into out: 2-byte values (bf16 activations, logits) as Huffman-coded byte planes
    (blosc_planes.py: ~3x c-blosc zstd-1's speed at a slightly better ratio), the rest with
    c-blosc zstd-1. Both are Blosc frames any reader decodes."""
    if ENCODER.planes and blosc_planes.applies(chunk):
        return Aligned(out, blosc_planes.compress_into(chunk, out, BLOCKSIZE))
    return Aligned(
        out, blosc_into.compress_into(chunk, out, CNAME, CLEVEL, Blosc.SHUFFLE, BLOCKSIZE)
    )


def _nbytes(data) -> int:
    """Size of an encoded chunk: bytes, the parts of a raw frame, or an aligned frame."""
    if isinstance(data, Aligned):
        return data.nbytes
    return sum(len(p) for p in data) if isinstance(data, list) else len(data)


def _parts(data) -> list:
    """The encoded chunk as bytes-likes to write in order."""
    if isinstance(data, Aligned):
        return [memoryview(data.block)[: data.nbytes]]
    return data if isinstance(data, list) else [data]


def configure(
    threads: int = 0, raw_when_behind: bool = False, raw_beyond_budget: bool = True
) -> None:
    ENCODER.read_flags()
    ENCODER.configure(threads, raw_when_behind, raw_beyond_budget)


def set_behind(flag: bool, far: bool = False) -> None:
    """The writer process is behind the producer: chunks encoded from now on may be raw
    (within DISK_BUDGET; beyond it too when `far`: the producer is about to block)."""
    ENCODER.behind = bool(flag or far)
    ENCODER.far_behind = bool(far)


def _write_file(path: str, parts: list) -> None:
    """Write `parts` (bytes-likes) as the file at path, atomically (temp file + rename)."""
    tmp = f"{path}.{uuid.uuid4().hex}.partial"
    with open(tmp, "wb") as f:
        for p in parts:
            f.write(p)
    os.replace(tmp, path)


def _write_chunk_file(path: str, data) -> None:
    """An unsharded column's whole chunk (an encoded chunk, as _Shard.add takes) as the file at
    path, atomically (temp file + rename). A frame in page-aligned memory (compressed into
    one of the column's aligned buffers, or a raw chunk in place) is written with O_DIRECT
    where the encoder's flag and the file system allow it, as a shard's chunks are: padded to
    whole blocks, then cut to the frame's length. Through the page cache, every chunk
    written took fresh pages, at ~4 ms of CPU per MB on this project's 2-vCPU VM (a guest's
    first touch of its memory) against 0.12-0.15 with O_DIRECT (bench/chunk_write.py). An
    O_DIRECT write waits for the device, on this thread, as a shard's did without I/O threads.
    A raw chunk marked `cached` (far behind, past the disk budget) and a frame in ordinary
    memory go through the page cache."""
    if not isinstance(data, Aligned) or data.cached:
        _write_file(path, _parts(data))
        return
    tmp = f"{path}.{uuid.uuid4().hex}.partial"
    fd, direct = _open_new_file(tmp)
    try:
        n = data.nbytes
        _write_all(fd, memoryview(data.block)[: padded(n) if direct else n], 0)
        if direct:
            os.ftruncate(fd, n)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    os.replace(tmp, path)


_RENAME_EXCHANGE = 2  # renameat2's flag: swap the two names atomically (Linux 3.15+)
_AT_FDCWD = -100


def _renameat2() -> Any:
    """glibc's renameat2 (2.28+) through ctypes, or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


class TailFile:
    """A key rewritten at every tail flush (an unsharded column's partly filled chunk), with
    the file of its previous version kept at `spare` (`<key>.tail.partial`, a name no reader
    looks at and `pack` skips) instead of unlinked. A flush writes the new version over the
    spare in place, cuts it to size, and swaps the two names in one atomic rename
    (renameat2 RENAME_EXCHANGE): the key holds a complete frame at every moment, as with
    _write_file, but no file is created and none unlinked. On this host's ext4 a temp file's
    create + rename over the key cost ~300 us of CPU and the swap ~15 us (bench/README.md,
    fourteenth pass); a column's tail flush was ~0.6 ms, 59 columns a flush.

    The first flush of a key is a _write_file-style rename (no previous version to keep);
    the second creates the spare. Where the file system has no exchange (EINVAL, ENOSYS),
    every flush falls back to a rename of the spare over the key. As with a shard's two tail
    slots (_Shard.snapshot), a reader that opened the key before a flush and still reads it
    a whole tail-flush period later may see the next flush's bytes."""

    exchange: Any = _renameat2()  # None: no swap on this host (class-wide, set on refusal)

    def __init__(self, path: str) -> None:
        self.path = path
        self.spare = f"{path}.tail.partial"
        self.has_spare = False  # the spare holds an older version of path

    def write(self, parts: list) -> None:
        swap = type(self).exchange
        if self.has_spare and swap is not None:
            with open(self.spare, "r+b") as f:  # over the old bytes: no blocks freed first
                for p in parts:
                    f.write(p)
                f.truncate()
        else:
            with open(self.spare, "wb") as f:
                for p in parts:
                    f.write(p)
        if swap is not None and os.path.exists(self.path):
            if swap(_AT_FDCWD, self.spare.encode(), _AT_FDCWD, self.path.encode(),
                    _RENAME_EXCHANGE) == 0:  # fmt: skip
                self.has_spare = True
                return
            err = ctypes.get_errno()
            if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise OSError(err, os.strerror(err), self.path)
            type(self).exchange = None  # this file system cannot swap: rename from now on
        os.replace(self.spare, self.path)
        self.has_spare = False

    def drop(self) -> None:
        """Remove the spare (the key's unit is written whole, or the column closes)."""
        if self.has_spare:
            self.has_spare = False
            try:
                os.unlink(self.spare)
            except FileNotFoundError:
                pass


def _index_bytes(index: np.ndarray) -> list:
    raw = index.astype("<u8", copy=False).tobytes()
    return [raw, np.uint32(google_crc32c.value(raw)).astype("<u4").tobytes()]


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    """pwrite all of view at offset. An O_DIRECT file whose file system refuses this alignment
    (EINVAL) goes on through the page cache: the bytes land at the same offsets."""
    got = 0
    while got < len(view):
        try:
            n = os.pwrite(fd, view[got:], offset + got)
        except OSError as exc:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if exc.errno != errno.EINVAL or not flags & getattr(os, "O_DIRECT", 0):
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            continue
        if n == 0:
            raise OSError(errno.EIO, "a write made no progress")
        got += n


def _open_new_file(path: str) -> tuple[int, bool]:
    """(fd, direct?): a new temp file (a shard's, or an unsharded chunk's), with O_DIRECT
    where the encoder's direct_io flag (HSTRACE_DIRECT_IO) and the file system allow it
    (tmpfs and some others refuse it at open: EINVAL)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    direct = getattr(os, "O_DIRECT", 0)
    if ENCODER.direct_io and direct:
        try:
            return os.open(path, flags | direct, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644), False


# An encoded chunk is at most this many bytes longer than its rows (Blosc's header; a frame
# that would be longer is stored as it is).
MAX_FRAME_OVERHEAD = blosc_into.MAX_OVERHEAD


class _Shard:
    """A shard being filled: encoded inner chunks written to a temp file, index in RAM.

    With O_DIRECT every chunk starts at a multiple of ALIGN (the index holds where each chunk
    is and how long it is; the padding after it is never read), and the index goes last, the
    file then cut to end with it. Without, chunks are packed back to back. finish, snapshot
    and discard are called once every write `add` handed to the I/O thread is done.

    A tail flush makes the shard so far readable at its key without copying it. The first
    snapshot extends the temp file (sparse) to its live size (liveshard.py), writes the
    partly filled chunk into a tail slot past the room for every chunk and the index into the
    file's last bytes, where zarr reads it, and renames the file to its key; later chunks go
    on into the same file, below the slots. Each later snapshot writes its tail into the other
    slot (never into the one the index on disk points to) and then rewrites the index in
    place: the file at the key is a valid shard at every moment, of the rows as of its last
    snapshot. finish writes the final index after the last chunk and cuts the file there.
    (Copying the shard so far into a new file at each flush wrote 3.2x the trace at a 50 ms
    step, 6.3x at 200 ms.)"""

    def __init__(self, path: str, n_inner: int, chunk_bytes: int) -> None:
        self.path = path
        self.tmp = f"{path}.{uuid.uuid4().hex}.partial"
        self.fd, self.direct = _open_new_file(self.tmp)
        self._cached_fd = -1  # the same file without O_DIRECT, for chunks marked `cached`
        self.index = np.full((n_inner, 2), _EMPTY, dtype="<u8")
        self.pos = 0
        self.done = 0  # inner chunks placed (in the file once their writes are done)
        self._bounce: np.ndarray | None = None  # aligned copy of a chunk not in aligned memory
        self.max_frame = chunk_bytes + MAX_FRAME_OVERHEAD
        self._slots, self.size = live_layout(n_inner, chunk_bytes)
        self.live = False  # the file is at its key (a snapshot was taken)
        self._slot_in_use: int | None = None  # the tail slot the index on disk points to

    def add(self, data, io: ThreadPoolExecutor | None = None) -> Future | None:
        """Append an encoded chunk (bytes, the parts of a raw frame, or an aligned frame). Its
        place in the file is decided here; the write itself goes to `io` (the writer's one
        I/O thread, which writes in submission order) when given, and the future says when
        the bytes are in the file; without `io` it is written before this returns."""
        n = _nbytes(data)
        if n > self.max_frame:
            raise ValueError(f"an encoded chunk of {n} bytes, more than {self.max_frame}")
        at = self.pos
        self.index[self.done] = (at, n)
        self.pos += padded(n) if self.direct else n
        self.done += 1
        if io is None:
            self._write(data, at, n)
            return None
        return io.submit(self._write, data, at, n)

    def _write(self, data, at: int, n: int) -> None:
        if self.direct and isinstance(data, Aligned) and data.cached:
            if self._cached_fd < 0:
                self._cached_fd = os.open(
                    self.tmp if not self.live else self.path,
                    os.O_WRONLY | getattr(os, "O_CLOEXEC", 0),
                )
            # The next chunk still starts block-aligned: the bytes between are a hole.
            _write_all(self._cached_fd, memoryview(data.block)[:n], at)
        elif self.direct:
            if isinstance(data, Aligned):
                block = data.block
            else:  # not in aligned memory (the numcodecs fallback): through a bounce buffer
                if self._bounce is None or self._bounce.nbytes < n:
                    self._bounce = aligned_buffer(n)
                block, pos = self._bounce, 0
                for p in _parts(data):
                    m = len(p) if not isinstance(p, memoryview) else p.nbytes
                    block[pos : pos + m] = np.frombuffer(p, dtype=np.uint8)
                    pos += m
            _write_all(self.fd, memoryview(block)[: padded(n)], at)
        else:
            for p in _parts(data):
                v = memoryview(p).cast("B")
                _write_all(self.fd, v, at)
                at += v.nbytes

    def _write_index(self, index: np.ndarray, end: int) -> None:
        """Write the index and its crc32c so that they end at `end`; with O_DIRECT as the
        whole block(s) before `end`, the index right-aligned in them."""
        raw = b"".join(_index_bytes(index))
        if not self.direct:
            _write_all(self.fd, memoryview(raw), end - len(raw))
            return
        room = padded(len(raw))
        block = aligned_buffer(room)
        block[room - len(raw) : room] = np.frombuffer(raw, dtype=np.uint8)
        _write_all(self.fd, memoryview(block)[:room], end - room)

    def finish(self) -> None:
        index = b"".join(_index_bytes(self.index))
        if self.direct:
            block = aligned_buffer(len(index))
            block[: len(index)] = np.frombuffer(index, dtype=np.uint8)
            _write_all(self.fd, memoryview(block)[: padded(len(index))], self.pos)
        else:
            _write_all(self.fd, memoryview(index), self.pos)
        # Live at its key, the file ended with the last snapshot's index until this cut; from
        # it on, with the final one (a crash in between leaves the snapshot's shard).
        os.ftruncate(self.fd, self.pos + len(index))
        self._close()
        if not self.live:
            os.replace(self.tmp, self.path)

    def _close(self) -> None:
        for fd in (self.fd, self._cached_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self._cached_fd = -1

    def snapshot(self, tail: bytes | None) -> None:
        """The key holds the chunks so far plus `tail` (a partly filled chunk): the first time
        by a rename, then in place (the tail into the free slot, then the index)."""
        index = self.index.copy()
        if not self.live:
            os.ftruncate(self.fd, self.size)  # sparse: the slots and the index's place
        slot = None
        if tail is not None:
            if len(tail) > self.max_frame:
                raise ValueError(f"a tail of {len(tail)} bytes, more than {self.max_frame}")
            slot = 1 if self._slot_in_use == 0 else 0
            self._write(tail, self._slots[slot], len(tail))
            index[self.done] = (self._slots[slot], len(tail))
        self._write_index(index, self.size)
        self._slot_in_use = slot
        if not self.live:
            os.replace(self.tmp, self.path)
            self.live = True

    def discard(self) -> None:
        """Close the file; remove it unless it is live at its key (which then holds the last
        snapshot's shard, as it should)."""
        try:
            self._close()
            if not self.live:
                os.unlink(self.tmp)
        except OSError:
            pass


def array_metadata(
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    dtype: np.dtype,
    shard_rows: int | None,
    attributes: dict,
) -> dict | None:
    """The zarr.json zarr 3 writes for `group.create_array(shape=shape, chunks=chunks,
    dtype=dtype, compressors=COMPRESSORS, fill_value=0, attributes=attributes[, shards])` (a
    column: rows split on the first dimension only), or None where this does not know it (a
    dtype other than bool, ints and floats; attributes JSON cannot hold). Creating a column
    through zarr costs ~2 ms of CPU (its event loop), ~65 columns at a session's first step:
    written directly, about 0.2 ms. tests/test_rowlog_metadata.py holds it equal to zarr's."""
    if dtype.kind not in "biuf" or dtype.itemsize not in (1, 2, 4, 8) or dtype.byteorder == ">":
        return None
    try:
        json.dumps(attributes, allow_nan=False)
    except (TypeError, ValueError):
        return None
    fill = False if dtype.kind == "b" else 0.0 if dtype.kind == "f" else 0
    inner = [
        {"name": "bytes"} if dtype.itemsize == 1 else {"name": "bytes", "configuration": {"endian": "little"}},
        {
            "name": "blosc",
            "configuration": {
                "typesize": dtype.itemsize, "cname": CNAME, "clevel": CLEVEL, "shuffle": SHUFFLE,
                "blocksize": BLOCKSIZE,
            },
        },
    ]  # fmt: skip
    grid, codecs = list(chunks), inner
    if shard_rows is not None:
        grid = [shard_rows, *chunks[1:]]
        index = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
        codecs = [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(chunks), "codecs": inner, "index_codecs": index,
                    "index_location": "end",
                },
            }
        ]  # fmt: skip
    return {
        "shape": list(shape),
        "data_type": "bool" if dtype.kind == "b" else dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill,
        "codecs": codecs,
        "attributes": attributes,
        "zarr_format": 3,
        "node_type": "array",
        "storage_transformers": [],
    }


def write_metadata(node_dir: str, meta: dict) -> None:
    """A node's zarr.json in node_dir (made if new), as zarr formats it, put in place by one
    rename (never half written at its key)."""
    os.makedirs(node_dir, exist_ok=True)
    path = os.path.join(node_dir, ZARR_JSON)
    tmp = f"{path}.{os.getpid()}.partial"
    with open(tmp, "w") as f:
        f.write(json.dumps(meta, allow_nan=True, indent=zarr.config.get("json_indent")))
    os.replace(tmp, path)


class RowLog:
    def __init__(
        self,
        group: zarr.Group,
        name: str,
        row_shape: tuple[int, ...],
        dtype: np.dtype,
        logical_dtype: str,
        attributes: dict | None = None,
    ) -> None:
        ENCODER.read_flags()  # the environment's flags, as this writer is built
        self.row_shape = tuple(int(x) for x in row_shape)
        self.dtype = np.dtype(dtype)  # native: little-endian hosts, as zarr's bytes codec
        self.row_items = math.prod(self.row_shape)
        self.row_bytes = row_bytes = self.row_items * self.dtype.itemsize
        chunk_rows, shard_rows = unit_rows(row_bytes)
        self.chunk_rows = chunk_rows
        self._chunk_bytes = chunk_rows * row_bytes
        self.unit = shard_rows or chunk_rows
        self.sharded = shard_rows is not None
        extra = {"shards": (shard_rows, *self.row_shape)} if shard_rows else {}
        # Created with its first capacity (GROW_UNITS units): the shape is a capacity, the
        # valid rows are the commit record's. Created empty, each column's first tail flush
        # resized it through zarr (its zarr.json rewritten through zarr's event loop): the
        # tiny world's first flush took 116-137 ms of CPU with it, 48-75 ms without
        # (bench/tail_flush.py, bench/README.md fourteenth pass)
        self.capacity = GROW_UNITS * self.unit
        attrs = {"hstrace_dtype": logical_dtype, **(attributes or {})}
        store = group.store
        path = f"{group.path}/{name}" if group.path else name
        # Where the chunk files go; None: not a local directory store (zarr writes them).
        self.dir = (
            os.path.join(str(store.root), *path.split("/"))
            if isinstance(store, LocalStore)
            else None
        )
        self.arr: Any = None  # the zarr array where zarr made it (else the files are written here)
        meta = None
        if self.dir is not None and not os.path.exists(os.path.join(self.dir, ZARR_JSON)):
            meta = array_metadata(
                (self.capacity, *self.row_shape), (chunk_rows, *self.row_shape), self.dtype,
                shard_rows, attrs,
            )  # fmt: skip
        if meta is not None:
            write_metadata(self.dir, meta)
        else:
            self.arr = group.create_array(
                name,
                shape=(self.capacity, *self.row_shape),
                chunks=(chunk_rows, *self.row_shape),
                dtype=self.dtype,
                compressors=COMPRESSORS,
                fill_value=0,
                attributes=attrs,
                config={"write_empty_chunks": True},
                **extra,
            )
        self._meta = meta  # written directly: a resize rewrites it the same way
        self._made: set[str] = set()
        # The column's words of the writer's native step (CR_*): its own, until its table
        # shares them (share_state). `fill` lives there.
        self._st = np.zeros(CR_WORDS, np.int64)
        self._stv = memoryview(self._st)  # plain int reads and writes
        self._stv[CR_CAP] = chunk_rows
        self._stv[CR_ROWB] = row_bytes
        self._dirty_since: float | None = None
        self._inflight: deque[tuple[int, Future, np.ndarray, Any, Any]] = deque()
        self.buf: np.ndarray | None = None  # the chunk being filled (allocated on first rows)
        self._bytes: memoryview | None = None  # buf's bytes (append_from copies into them)
        # On a local store buf lives in page-aligned memory after _HEAD bytes (block), and
        # chunks are compressed into reused page-aligned buffers (outs), for O_DIRECT writes
        # (a shard's chunks; an unsharded column's chunk files, _write_chunk_file).
        self.block: np.ndarray | None = None
        self._aligned = self.dir is not None
        self._outs: list[np.ndarray] = []
        self.fill = 0
        self.encoded = 0  # rows handed to the encoder (whole chunks)
        self.flushed = 0  # rows on disk as whole units
        self.tail_stored = 0  # rows on disk through the last tail flush
        self._tail_file: TailFile | None = None  # unsharded: the key tail flushes rewrite
        self._tail_file_no = -1  # its unit
        self.dirty_since = None  # monotonic time of the oldest unwritten row
        self.units_written = 0
        self.raw_chunks = 0  # chunks stored uncompressed (Blosc level 0) while behind
        self._free: list[tuple[np.ndarray, np.ndarray | None]] = []  # (buf, block)
        # (chunk no., encoded chunk, buf, block, out): self._inflight, above
        # Chunks handed to the I/O thread: (write, buf and block or None, out or None), the
        # memory given back once the write is done.
        self._writing: deque[tuple[Future, Any, Any]] = deque()
        self._shard: _Shard | None = None
        self._shard_no = -1
        self._tails = blosc_tail.TailFrames(CNAME, CLEVEL, Blosc.SHUFFLE)

    @property
    def fill(self) -> int:
        """Rows in buf."""
        return self._stv[CR_FILL]

    @fill.setter
    def fill(self, n: int) -> None:
        self._stv[CR_FILL] = n

    @property
    def dirty_since(self) -> float | None:
        """Monotonic time of the oldest row not on disk (None: every row is)."""
        return self._dirty_since

    @dirty_since.setter
    def dirty_since(self, t: float | None) -> None:
        self._dirty_since = t
        self._gate()

    def _gate(self) -> None:
        """Whether the native step must leave this column's rows to append_from: its first
        rows since a tail flush (dirty_since is set there), or a chunk being encoded (append
        drains it)."""
        self._stv[CR_GATE] = 1 if self._dirty_since is None or self._inflight else 0

    def share_state(self, row: np.ndarray, axis: int) -> None:
        """Keep this column's words in `row` (a row of its table's state array, int64,
        CR_WORDS long) from now on, its rows counted by the step's `axis`-th count."""
        row[:] = self._st
        row[CR_AXIS] = axis
        self._st = row
        self._stv = memoryview(row)

    @property
    def stored(self) -> int:
        """Rows that are on disk (whole units plus the last tail flush)."""
        return max(self.flushed, self.tail_stored)

    @property
    def total(self) -> int:
        return self.encoded + self.fill

    def _ensure_capacity(self, end: int) -> None:
        if end > self.capacity:
            grow = GROW_UNITS * self.unit
            self.capacity = -(-end // grow) * grow
            self._set_rows(self.capacity)

    def _set_rows(self, rows: int) -> None:
        """Set the array's row count in its zarr.json. Nothing is deleted: every unit this
        column wrote lies below `rows` (close trims only the capacity grown ahead, which was
        never written), and zarr's own resize would otherwise try to delete each of those up
        to GROW_UNITS - 1 absent keys per column, one unlink each (~0.1 s per close)."""
        if self._meta is not None:  # created directly: its zarr.json rewritten the same way
            self._meta["shape"][0] = rows
            write_metadata(self.dir, self._meta)
            return
        sync(self.arr.async_array.resize((rows, *self.row_shape), delete_outside_chunks=False))

    def _key_path(self, unit_no: int) -> str:
        """File of unit `unit_no` (a shard, or a chunk when unsharded): zarr's default key
        `c/<unit>/0/...` (one coordinate per dimension; rows are only split on the first)."""
        coords = [str(unit_no)] + ["0"] * len(self.row_shape)
        parent = os.path.join(self.dir, "c", *coords[:-1])
        if parent not in self._made:
            if not os.path.isdir(self.dir):
                # Never recreate a removed trace (zarr would, without its root metadata).
                raise FileNotFoundError(2, "the array's directory is gone", self.dir)
            os.makedirs(parent, exist_ok=True)
            self._made.add(parent)
        return os.path.join(parent, coords[-1])

    def append(self, rows: np.ndarray, now: float | None = None) -> None:
        n = rows.shape[0]
        if n == 0:
            return
        if self.dirty_since is None:
            self.dirty_since = time.monotonic() if now is None else now
        fill = self.fill
        if self.buf is not None and fill + n < self.chunk_rows:  # the usual step: no chunk ends
            self.buf[fill : fill + n] = rows
            self.fill = fill + n
            if self._inflight:
                self._drain(block=False)
            return
        i = 0
        while i < n:
            if self.buf is None:
                self._take_buf(*(self._free.pop() if self._free else self._new_buf()))
            k = min(self.chunk_rows - self.fill, n - i)
            self.buf[self.fill : self.fill + k] = rows[i : i + k]
            self.fill += k
            i += k
            if self.fill == self.chunk_rows:
                self._submit()
        self._drain(block=False)

    def append_from(self, src: memoryview, offset: int, n: int, now: float) -> None:
        """Append n rows laid out at src[offset:] in this log's dtype and row shape (the
        writer process's ring): the usual step, which ends no chunk, is one byte copy."""
        fill = self.fill
        dst = self._bytes
        if dst is not None and 0 < n and fill + n < self.chunk_rows:
            if self.dirty_since is None:
                self.dirty_since = now
            size = self.row_bytes
            dst[fill * size : (fill + n) * size] = src[offset : offset + n * size]
            self.fill = fill + n
            if self._inflight:
                self._drain(block=False)
            return
        rows = np.frombuffer(src, self.dtype, n * self.row_items, offset)
        self.append(rows.reshape(n, *self.row_shape), now)

    def _take_buf(self, buf: np.ndarray | None, block: np.ndarray | None) -> None:
        """Start filling buf (None: no chunk in hand)."""
        self.buf, self.block = buf, block
        self._bytes = None if buf is None else memoryview(buf.reshape(-1).view(np.uint8))
        self._stv[CR_DST] = 0 if buf is None else buf.ctypes.data

    def _new_buf(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(a chunk buffer, the aligned block it sits in after _HEAD bytes, or None)."""
        shape = (self.chunk_rows, *self.row_shape)
        if not self._aligned:
            return np.empty(shape, dtype=self.dtype), None
        n = self.chunk_rows * self.row_items * self.dtype.itemsize
        block = aligned_buffer(_HEAD + n)
        return block[_HEAD : _HEAD + n].view(self.dtype).reshape(shape), block

    def _out(self) -> np.ndarray | None:
        """A page-aligned buffer to compress a chunk into (reused once its chunk is written)."""
        if not self._aligned or not ENCODER.into:
            return None
        if self._outs:
            return self._outs.pop()
        n = self.chunk_rows * self.row_items * self.dtype.itemsize
        return aligned_buffer(n + blosc_into.MAX_OVERHEAD)

    def _submit(self) -> None:
        """Hand the full chunk in buf to the encoder (or to zarr when not a local store)."""
        chunk_no = self.encoded // self.chunk_rows
        self._ensure_capacity(self.encoded + self.chunk_rows)
        buf, block, self.fill = self.buf, self.block, 0
        self._take_buf(None, None)
        self._tails.reset()  # the next tail is of another buffer
        self.encoded += self.chunk_rows
        if self.dir is None:
            start = chunk_no * self.chunk_rows
            self.arr[start : start + self.chunk_rows] = buf
            self._free.append((buf, block))
            if self.encoded % self.unit == 0:
                self.flushed = self.encoded
                self.units_written += 1
            return
        while len(self._inflight) >= MAX_INFLIGHT:
            self._drain(block=True, upto=1)
        out = self._out()
        fut, raw = ENCODER.submit(buf, block, out)
        self.raw_chunks += raw
        self._inflight.append((chunk_no, fut, buf, block, out))
        self._gate()

    def _drain(self, block: bool, upto: int | None = None) -> None:
        """Write encoded chunks in order: append to their shard, or write the chunk file."""
        done = 0
        while self._inflight and (upto is None or done < upto):
            chunk_no, fut, buf, mem, out = self._inflight[0]
            if not block and not fut.done():
                return
            data = fut.result()  # a raw frame still points into buf: free it once written
            self._inflight.popleft()
            self._gate()
            done += 1
            per_unit = self.unit // self.chunk_rows
            unit_no, inner = divmod(chunk_no, per_unit)
            if not self.sharded:
                _write_chunk_file(self._key_path(unit_no), data)
                self._drop_tail_file(unit_no)
                self._free.append((buf, mem))
                if out is not None:
                    self._outs.append(out)
            else:
                if self._shard is None or self._shard_no != unit_no:
                    self._shard = _Shard(self._key_path(unit_no), per_unit, self._chunk_bytes)
                    self._shard_no = unit_no
                assert self._shard.done == inner
                # A raw chunk of a writer far behind goes through the page cache on this
                # thread, once the shard's earlier writes are done (no O_DIRECT write of the
                # same file in flight meanwhile). On the I/O thread that copy ran at 0.55-1.1
                # CPU s per GB, serialized behind the device writes, and the shipped firehose
                # fell from 1013-1725 to 721-1083 MB/s (alternated with the tree before).
                cached = isinstance(data, Aligned) and data.cached
                if cached:
                    self._written(block=True)
                write = self._shard.add(data, None if cached else ENCODER.io)
                # A raw frame is written from buf's own block; a compressed one from out.
                in_buf = isinstance(data, Aligned) and data.block is mem
                if write is None or not in_buf:
                    self._free.append((buf, mem))
                if write is None:
                    if out is not None:
                        self._outs.append(out)
                else:
                    self._writing.append((write, (buf, mem) if in_buf else None, out))
                    while len(self._writing) > MAX_WRITES:
                        self._written(block=True, upto=1)
                if inner < per_unit - 1:
                    continue
                self._written(block=True)  # every chunk of the shard is in its file
                self._shard.finish()
                self._shard = None
            self.flushed = (chunk_no + 1) * self.chunk_rows
            self.units_written += 1
            # The oldest row not on disk is now younger: age it from here, as a tail would.
            self.dirty_since = None if self.flushed >= self.total else time.monotonic()

    def _written(self, block: bool, upto: int | None = None) -> None:
        """Take back the memory of chunks the I/O thread has written, oldest first (a write
        that failed raises here, on the writer's thread: its OSError is the writer's fault)."""
        done = 0
        while self._writing and (upto is None or done < upto):
            write, held, out = self._writing[0]
            if not block and not write.done():
                return
            self._writing.popleft()
            done += 1
            write.result()
            if held is not None:
                self._free.append(held)
            if out is not None:
                self._outs.append(out)

    def drain(self) -> None:
        """Write whatever the encoder has finished (the writer calls this when idle)."""
        if self._inflight:
            self._drain(block=False)
        if self._writing:
            self._written(block=False)

    def needs_tail_flush(self, now: float, max_age_s: float) -> bool:
        return self.dirty_since is not None and now - self.dirty_since >= max_age_s

    def flush_tail(self) -> bool:
        """Make every appended row durable: wait for the encoder, and write the partly filled
        unit (a partial chunk padded with zeros; a shard with the chunks it has so far). The
        next whole-unit write replaces the same key."""
        if self.dirty_since is None:
            return False
        self._drain(block=True)
        self._written(block=True)  # a snapshot's index points only at chunks in the file
        if self.fill:
            start = self.encoded
            if self.dir is None:
                self._ensure_capacity(start + self.fill)
                self.arr[start : start + self.fill] = self.buf[: self.fill]
            else:
                data, unit_no = self._encode_tail()
                if not self.sharded:
                    self._tail_file_of(unit_no).write([data])
                else:
                    self._shard_of(unit_no).snapshot(data)
            self.tail_stored = start + self.fill
        elif self._shard is not None:
            self._shard.snapshot(None)  # whole chunks of an unfinished shard
            self.tail_stored = self.encoded
        self.dirty_since = None
        return True

    def _encode_tail(self) -> tuple[Any, int]:
        """The partly filled chunk, padded with zeros, as a frame; (frame, its unit). c-blosc,
        not the byte planes: LZ codes the padding to next to nothing, Huffman to a bit a byte;
        put together from the blocks of the last one where it can (blosc_tail.py)."""
        self._ensure_capacity(self.encoded + self.fill)
        if ENCODER.into:  # c-blosc's own call: the frame from the blocks that changed
            data = self._tails.frame(self.buf, self.fill * self.row_items * self.dtype.itemsize)
        else:
            self.buf[self.fill :] = 0
            data = ENCODER.codec(self.dtype.itemsize, False).encode(self.buf)
        return data, self.encoded // self.unit

    def _tail_file_of(self, unit_no: int) -> TailFile:
        """The tail flushes' file of unit_no (an unsharded column), a new one past the last."""
        if self._tail_file is None or self._tail_file_no != unit_no:
            self._drop_tail_file(None)
            self._tail_file = TailFile(self._key_path(unit_no))
            self._tail_file_no = unit_no
        return self._tail_file

    def _drop_tail_file(self, unit_no: int | None) -> None:
        """Remove the tail file's spare: of unit_no (now written whole), or whichever (None)."""
        t = self._tail_file
        if t is not None and (unit_no is None or self._tail_file_no == unit_no):
            self._tail_file = None
            t.drop()

    def _shard_of(self, unit_no: int) -> _Shard:
        """The shard being filled, opened for unit_no if none is."""
        if self._shard is None:
            self._shard = _Shard(
                self._key_path(unit_no), self.unit // self.chunk_rows, self._chunk_bytes
            )
            self._shard_no = unit_no
        return self._shard

    def _finish_tail_shard(self) -> None:
        """At close: the unfinished shard completed in place, its partly filled chunk (if
        any) appended as its last chunk, its index written, the file cut there (and renamed
        to its key, unless a tail flush made it live there already). A tail flush instead
        would put the partly filled chunk in a slot that the cut then drops."""
        self._drain(block=True)
        self._written(block=True)
        if self.fill:
            data, unit_no = self._encode_tail()
            self._shard_of(unit_no).add(data)  # written before it returns (no I/O thread)
            self.tail_stored = self.encoded + self.fill
        elif self._shard is not None:
            self.tail_stored = self.encoded
        if self._shard is not None:
            self._shard.finish()
            self._shard = None
        self.dirty_since = None

    def abort(self) -> None:
        """Stop after a write fault: drop this column's temp files (what the last tail flush
        or whole-unit write put at the keys stays)."""
        while self._writing:  # the I/O thread must be done with the files and the memory
            try:
                self._written(block=True, upto=1)
            except OSError:
                pass
        if self._shard is not None:
            self._shard.discard()
            self._shard = None
        self._drop_tail_file(None)
        self._inflight.clear()
        self._gate()

    def close(self) -> None:
        """Write the tail and trim the shape to the exact row count."""
        # An unfinished shard is finished even when a tail flush just made every row durable
        # (nothing dirty): else it stayed live at its key, sparse and with its slots.
        if (
            self.sharded
            and self.dir is not None
            and (self.dirty_since is not None or self._shard is not None)
        ):
            self._finish_tail_shard()
        else:
            self.flush_tail()
        self._written(block=True)  # (flush_tail waited already, unless nothing was dirty)
        self._drop_tail_file(None)  # the key holds the last tail: its spare goes
        if self._shard is not None:
            self._shard.discard()  # its chunks are in the key through the snapshot
            self._shard = None
        self.flushed = self.stored
        self.fill = 0
        self._set_rows(self.flushed)
        self.capacity = self.flushed
        self._take_buf(None, None)
        self._free.clear()
        self._outs.clear()
