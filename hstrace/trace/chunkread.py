"""Reading rows of a trace array straight from its chunk and shard files.

zarr's read path (asyncio, a task per inner chunk, copies) ran at ~165 MB/s here against
~1.3 GB/s for Blosc's decoder alone and ~4 GB/s for a raw read (bench/README.md). The arrays
hstrace writes have one layout (rowlog.py): rows split only along the first dimension, the
default chunk keys `c/<i>/0/...`, bytes little-endian + Blosc, inside a sharding codec with a
crc32c'd index at the end for wide rows. For exactly that layout, in a directory store, this
module reads the needed files itself: each needed chunk is read and decoded by one thread of
a small pool (Blosc and `preadv` release the GIL), so one thread reads while the other
decodes, straight into the output rows (the writer's byte-plane frames through
blosc_planes.decompress_into, the rest through c-blosc); a chunk stored uncompressed is read
into its output rows directly, with no decode copy. Any
other array (another codec, a zip, another writer's layout) returns None: the caller uses
zarr. A chunk file that is missing, a link, or fails its checks is an error here, never the
fill value: the commit record says these rows exist. A trace still recording reads too: the
one chunk a tail flush may move, a live shard's partly filled chunk (liveshard.py), is
re-checked against the index and followed (read_moving).
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import google_crc32c
import numcodecs.blosc
import numpy as np
from numcodecs import Blosc

from hstrace.trace.codecs import blosc_planes
from hstrace.trace.guard import index_overlap
from hstrace.trace.liveshard import in_tail_slot, index_bytes

# Decode in parallel once a read spans this many chunks (below, threads cost more than they save).
PARALLEL_MIN_CHUNKS = 3
THREADS = 2

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_BLOSC = Blosc()  # decoding reads every parameter from the frame header
_EMPTY = 2**64 - 1


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            # One Blosc thread per call whichever thread calls (no global lock, no fan-out).
            numcodecs.blosc.use_threads = False
            _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="hstrace-decode")
        return _pool


class _Layout:
    """What is needed to find rows: chunk rows, shard rows (or None), the array's directory."""

    def __init__(
        self, root: str, directory: str, chunk_rows: int, shard_rows: int | None, ndim: int
    ) -> None:
        self.root = root
        self.dir = directory
        self.chunk_rows = chunk_rows
        self.shard_rows = shard_rows
        self.ndim = ndim

    def key_path(self, unit: int) -> str:
        return os.path.join(self.dir, "c", str(unit), *(["0"] * (self.ndim - 1)))


def _is_chain(codecs: list) -> bool:
    """bytes (little-endian) + blosc: the only chunk codec chain hstrace writes."""
    if len(codecs) != 2 or not all(isinstance(c, dict) for c in codecs):
        return False
    b, z = codecs
    return (
        b.get("name") == "bytes"
        and (b.get("configuration") or {}).get("endian", "little") == "little"
        and z.get("name") == "blosc"
    )


def layout_of(arr: Any) -> _Layout | None:
    """The array's layout if this module can read it, else None (use zarr)."""
    try:
        from zarr.storage import LocalStore, WrapperStore

        store = arr.store
        while isinstance(store, WrapperStore):  # the reader's GuardedStore: this module
            store = store._store  # does its checks itself (see _open)
        if not isinstance(store, LocalStore) or np.dtype(arr.dtype).byteorder == ">":
            return None
        meta = arr.metadata.to_dict()
        if meta.get("zarr_format") != 3 or meta.get("chunk_key_encoding") != {
            "name": "default",
            "configuration": {"separator": "/"},
        }:
            return None
        grid = meta["chunk_grid"]["configuration"]["chunk_shape"]
        shape = tuple(arr.shape)
        if tuple(grid[1:]) != shape[1:]:
            return None
        codecs = meta["codecs"]
        root = os.path.realpath(str(store.root))
        directory = os.path.join(root, *arr.path.split("/"))
        if _is_chain(codecs):
            return _Layout(root, directory, int(grid[0]), None, len(shape))
        if len(codecs) != 1 or codecs[0].get("name") != "sharding_indexed":
            return None
        cfg = codecs[0]["configuration"]
        inner = cfg["chunk_shape"]
        index_codecs = [c.get("name") for c in cfg.get("index_codecs", [])]
        if (
            tuple(inner[1:]) != shape[1:]
            or not _is_chain(cfg["codecs"])
            or index_codecs != ["bytes", "crc32c"]
            or cfg.get("index_location", "end") != "end"
            or int(grid[0]) % int(inner[0])
        ):
            return None
        return _Layout(root, directory, int(inner[0]), int(grid[0]), len(shape))
    except Exception:  # noqa: BLE001 - anything unexpected: let zarr read it
        return None


def _open(lay: _Layout, path: str) -> int:
    """A chunk file that is a regular file inside the store (no link out of it, no FIFO)."""
    real = os.path.realpath(path)
    if not real.startswith(lay.root + os.sep):
        raise ValueError(f"chunk file {path} links outside the trace; refusing to read it")
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; O_NOFOLLOW: no last-hop link.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ValueError(
            f"chunk file {path} is missing (the commit record says it exists)"
        ) from None
    except OSError as exc:
        raise ValueError(f"chunk file {path} cannot be opened ({exc.strerror})") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"chunk file {path} is not a regular file")
    return fd


def _pread_exact(fd: int, n: int, offset: int, path: str) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise ValueError(f"chunk file {path} is truncated")
    return data


class _Buffer:
    """A read buffer reused from call to call (one per thread): encoded bytes land in memory
    that is already mapped. A fresh `pread` result per shard is new memory every time, and
    the kernel zeroing those pages cost more than the Blosc decode (bench/README.md)."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def view(self, n: int) -> memoryview:
        if len(self.buf) < n:
            self.buf = bytearray(n)
        return memoryview(self.buf)[:n]

    def release(self) -> None:
        if len(self.buf) > KEEP_BYTES:  # a one-off huge chunk: do not keep its memory
            self.buf = bytearray()


# A thread's read buffer is kept between reads up to this size (a chunk is at most ~4 MiB).
KEEP_BYTES = 32 << 20
_local = threading.local()


def _buffer() -> _Buffer:
    b = getattr(_local, "buffer", None)
    if b is None:
        b = _local.buffer = _Buffer()
    return b


def _read_into(fd: int, view: memoryview, offset: int, path: str) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise ValueError(f"chunk file {path} is truncated")
        got += n


_MEMCPYED = 0x02  # Blosc 1 header flag: the frame holds the bytes as they are


def _read_raw_frame(fd: int, off: int, n: int, dest: memoryview) -> bool:
    """Read a chunk stored uncompressed (a Blosc level-0 frame: 16 header bytes, then the
    rows) straight into its rows of the output: one copy, from the page cache, where a decode
    would add a second. False (dest then holds nothing meaningful) where the frame turns out
    not to be one: the caller decodes it instead."""
    head = bytearray(16)
    if os.preadv(fd, [head, dest], off) != n:
        return False  # a short read: the ordinary path reads it in a loop
    nbytes = int.from_bytes(head[4:8], "little")
    cbytes = int.from_bytes(head[12:16], "little")
    return bool(head[2] & _MEMCPYED) and nbytes == dest.nbytes and cbytes == n


class ReadFlags(NamedTuple):
    """The environment's say on reading, taken when a reader is built (`open_trace`), not at
    import."""

    planes: bool  # byte-plane frames decoded by blosc_planes (HSTRACE_PLANES=0: by c-blosc)
    prefetch: bool  # ask the kernel to read a shard's wanted chunks ahead (HSTRACE_PREFETCH)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ReadFlags:
        env = os.environ if environ is None else environ
        return cls(
            planes=blosc_planes.enabled(env), prefetch=env.get("HSTRACE_PREFETCH", "1") != "0"
        )


def read_rows(arr: Any, start: int, stop: int, flags: ReadFlags | None = None) -> np.ndarray | None:
    """Rows [start, stop) of `arr`, or None where this module does not handle the array.
    `flags`: the reader's (None: the environment's now)."""
    lay = layout_of(arr)
    if lay is None:
        return None
    dtype = np.dtype(arr.dtype)
    row_shape = tuple(arr.shape[1:])
    out = np.empty((max(0, stop - start), *row_shape), dtype=dtype)
    if stop <= start:
        return out
    if flags is None:
        flags = ReadFlags.from_env()
    planes, prefetch = flags
    cr = lay.chunk_rows
    first, last = start // cr, (stop - 1) // cr
    row_bytes = dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
    chunk_bytes = cr * row_bytes
    # Blosc stores at most 16 header bytes plus 4 per block beyond the data: no chunk file can
    # be bigger than this (a sparse 8 GiB "chunk" is refused before it is read).
    max_chunk = chunk_bytes + 16 + 4 * (chunk_bytes // (1 << 16) + 1) + 1024

    def decode(data: memoryview, row0: int) -> None:
        head = bytes(data[:16])  # Blosc 1 header: nbytes at 4:8, cbytes at 12:16 (LE)
        nbytes = int.from_bytes(head[4:8], "little") if len(head) == 16 else -1
        cbytes = int.from_bytes(head[12:16], "little") if len(head) == 16 else -1
        if nbytes != chunk_bytes or cbytes != len(data):
            raise ValueError(
                f"a chunk at row {row0} holds {nbytes} bytes in {len(data)} (want {chunk_bytes}): corrupt"
            )
        a, b = max(start, row0), min(stop, row0 + cr)
        if a == row0 and b == row0 + cr:  # the whole chunk is wanted: decode in place
            dest = out[a - start : b - start]
            # byte planes first, then c-blosc
            if not (planes and blosc_planes.decompress_into(data, dest)):
                _BLOSC.decode(data, out=dest)
            return
        raw = np.frombuffer(_BLOSC.decode(data), dtype=dtype)
        out[a - start : b - start] = raw.reshape(cr, *row_shape)[a - row0 : b - row0]

    def read_one(job: tuple[int, int, int, int, str]) -> None:
        """Read one chunk and decode it into `out`, on whichever thread runs it: each thread
        reads its next chunk while the other decodes, so the read is not a serial phase."""
        fd, off, n, row0, path = job
        whole = row0 >= start and row0 + cr <= stop
        if whole and n == chunk_bytes + 16:  # the size of a chunk stored uncompressed
            dest = memoryview(out[row0 - start : row0 - start + cr]).cast("B")
            if _read_raw_frame(fd, off, n, dest):
                return
        buf = _buffer()
        view = buf.view(n)
        _read_into(fd, view, off, path)
        decode(view, row0)
        # Drops only a one-off huge chunk's buffer; it is replaced, never resized, so the
        # view above may still be alive.
        buf.release()

    def read_moving(job: tuple[int, int, int, int, str], per: int, k: int) -> None:
        """Inner chunk k of a shard live at its key, its partly filled chunk: a tail flush
        may overwrite its slot while it is read (the one after next reuses it), or the shard
        may be finished under it (liveshard.py). Its bytes are read twice around a fresh look
        at the index, and decoded only once the index still points at them and both reads
        agree; where the index moved the chunk (whole now, or the shard finished), from there."""
        fd, off, n, row0, path = job
        for _ in range(MOVING_TRIES):
            data = None
            try:
                first = _pread_exact(fd, n, off, path)
                now, size = _index_entry(fd, path, per, k, max_chunk)
                if now == (off, n) and _pread_exact(fd, n, off, path) == first:
                    data = first
            except ValueError:  # a read racing the index's rewrite or the shard's final cut
                now, size = _index_entry(fd, path, per, k, max_chunk)
            if data is not None:
                decode(memoryview(data), row0)
                return
            if not in_tail_slot(now[0], size, per, chunk_bytes):
                read_one((fd, *now, row0, path))
                return
            off, n = now
        raise ValueError(
            f"shard file {path}: its partly filled chunk moved at each of {MOVING_TRIES} reads "
            "(its writer flushes faster than this reader reads)"
        )

    group: list[tuple[int, int, int, int, str]] = []  # (fd, file offset, nbytes, row0, path)

    def run_group() -> None:
        if len(group) >= PARALLEL_MIN_CHUNKS:
            list(_executor().map(read_one, group))
        else:
            for job in group:
                read_one(job)
        group.clear()

    fds: list[int] = []
    try:
        if lay.shard_rows is None:
            for c in range(first, last + 1):
                path = lay.key_path(c)
                fd = _open(lay, path)
                fds.append(fd)
                size = os.fstat(fd).st_size
                if size > max_chunk:
                    raise ValueError(f"chunk file {path} is {size} bytes, more than a chunk can be")
                group.append((fd, 0, size, c * cr, path))
                if len(fds) > 64:  # do not hold too many files open: decode what is open
                    run_group()
                    _close(fds)
        else:
            per = lay.shard_rows // cr
            for shard in range(first // per, last // per + 1):
                lo = max(first, shard * per) - shard * per
                hi = min(last, shard * per + per - 1) - shard * per
                path = lay.key_path(shard)
                fd = _open(lay, path)
                fds.append(fd)
                row0 = shard * per * cr
                spans, size = _shard_index(fd, path, per, lo, hi, max_chunk)
                if prefetch:
                    _prefetch(fd, spans)
                moving = []
                for j, (off, n) in enumerate(spans):
                    job = (fd, off, n, row0 + (lo + j) * cr, path)
                    if in_tail_slot(off, size, per, chunk_bytes):
                        moving.append((job, lo + j))
                    else:
                        group.append(job)
                run_group()  # before the shard's file is closed
                for job, k in moving:
                    read_moving(job, per, k)
                _close(fds)
        run_group()
    finally:
        group.clear()
        _close(fds)
    return out


def _prefetch(fd: int, spans: list[tuple[int, int]]) -> None:
    """Ask the kernel to read a shard's wanted chunks ahead (POSIX_FADV_WILLNEED: asynchronous),
    so that the device reads the next group while the pool decodes this one."""
    if not spans or not hasattr(os, "posix_fadvise"):
        return
    start = min(off for off, _ in spans)
    end = max(off + n for off, n in spans)
    try:
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass  # advice only


def _close(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


def _index_ok(tail: bytes) -> bool:
    return np.uint32(google_crc32c.value(tail[:-4])).astype("<u4").tobytes() == tail[-4:]


# A partly filled chunk of a live shard is read again at most this many times while its
# writer's tail flushes move it (each flush is tail_flush_s apart, 2 s by default).
MOVING_TRIES = 8
INDEX_TRIES = 3


def _read_index(fd: int, path: str, per: int) -> tuple[np.ndarray, int]:
    """(the checked index of a shard of `per` inner chunks, the file's size). A shard live at
    its key has its index rewritten in place at each tail flush and is cut when finished
    (liveshard.py): a read racing either may see half an index, or none. Read it again."""
    n_index = index_bytes(per)
    for _ in range(INDEX_TRIES):
        size = os.fstat(fd).st_size
        if size < n_index:
            raise ValueError(f"shard file {path} is truncated")
        tail = os.pread(fd, n_index, size - n_index)
        if len(tail) == n_index and _index_ok(tail):
            return np.frombuffer(tail[:-4], dtype="<u8").reshape(per, 2), size
    if len(tail) != n_index:
        raise ValueError(f"shard file {path} is truncated")
    raise ValueError(f"shard file {path}: index checksum mismatch (corrupt)")


def _index_entry(
    fd: int, path: str, per: int, k: int, max_chunk: int
) -> tuple[tuple[int, int], int]:
    """((offset, nbytes) of inner chunk k, the file's size), from a fresh read of the index."""
    spans, size = _shard_index(fd, path, per, k, k, max_chunk)
    return spans[0], size


def _shard_index(
    fd: int, path: str, per: int, lo: int, hi: int, max_chunk: int
) -> tuple[list[tuple[int, int]], int]:
    """((offset, nbytes) of inner chunks lo..hi of a shard, from its checked index; the file's
    size when that index was read)."""
    index, size = _read_index(fd, path, per)
    alias = index_overlap(index)
    if alias is not None:
        raise ValueError(
            f"shard file {path}: inner chunk {alias} overlaps another chunk's bytes (corrupt)"
        )
    want = index[lo : hi + 1]
    if np.any(want[:, 0] == _EMPTY):
        missing = lo + int(np.argmax(want[:, 0] == _EMPTY))
        raise ValueError(f"shard file {path}: inner chunk {missing} is missing")
    if np.any(want[:, 1] > max_chunk):
        raise ValueError(f"shard file {path}: an inner chunk is bigger than a chunk can be")
    end = int((want[:, 0] + want[:, 1]).max())
    if end > size - index_bytes(per):
        raise ValueError(f"shard file {path}: index points past the data (corrupt)")
    return [(int(off), int(n)) for off, n in want.tolist()], size
