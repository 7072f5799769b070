"""A partly filled chunk as a Blosc frame, at the cost of the rows added since the last one.

Every tail flush (each column, every `tail_flush_s`) stores the chunk being filled as a whole
chunk, the rows after its last one zero. Compressing that padded chunk from scratch costs the
whole chunk each time: 0.2-2 ms per column on the tiny world's 0.5-4 MiB chunks, a third of the
writer's CPU at a server's pace (bench/README.md). But c-blosc compresses a frame's blocks one
by one, each on its own: a block's bytes in the frame depend only on that block's contents and
size, the codec and the type size. So the frame of the padded chunk, at a block size of
TAIL_BLOCKSIZE, is put together from

* the blocks that were already whole at an earlier flush of the same buffer (kept from it: rows
  are only ever appended, so their bytes cannot have changed),
* the blocks rows arrived in since (compressed now, as one smaller frame whose blocks are cut
  out of it),
* the blocks past the last row, all zero (cut once per chunk size from the frame of a zero
  chunk),

under the header and block offsets c-blosc would write. The result is byte for byte the frame
c-blosc makes of the whole padded chunk (tests/test_blosc_tail.py), so any Blosc reader decodes
it; where that cannot be had (the chunk fits one block, a frame stored as it is, or one larger
than its chunk), `frame` compresses the whole chunk instead.

A tail is only ever read until the chunk is complete: the complete chunk is then encoded with
the writer's own block size and codec (rowlog.py).
"""

from __future__ import annotations

import struct
import threading

import numpy as np

from hstrace.trace.codecs import blosc_into

# Small enough that a flush compresses little beyond the rows it adds (a tail of the tiny
# world's hidden-state column gains ~0.6 MB per 2 s flush), large enough that the bytes of a
# zero block and its offset cost next to nothing beside the chunk.
TAIL_BLOCKSIZE = 64 << 10
_HEADER = 16
_MEMCPYED = 0x02  # Blosc 1 header flags: the frame holds the buffer as it is


def _compress(src: np.ndarray, cname: str, clevel: int, shuffle: int) -> bytes:
    out = np.empty(src.nbytes + blosc_into.MAX_OVERHEAD, np.uint8)
    n = blosc_into.compress_into(src, out, cname, clevel, shuffle, TAIL_BLOCKSIZE)
    return out[:n].tobytes()


def _blocks(frame: bytes) -> list[bytes] | None:
    """The compressed bytes of each block of a Blosc 1 frame, in order; None where the frame
    holds its buffer as it is (no blocks to cut)."""
    flags = frame[2]
    nbytes, blocksize, cbytes = struct.unpack_from("<III", frame, 4)
    if flags & _MEMCPYED or cbytes != len(frame):
        return None
    n = -(-nbytes // blocksize)
    starts = [*struct.unpack_from(f"<{n}i", frame, _HEADER), cbytes]
    if starts[0] != _HEADER + 4 * n:
        return None
    return [frame[starts[j] : starts[j + 1]] for j in range(n)]


class TailFrames:
    """The tail frames of one column: the blocks of its current chunk buffer kept from the last
    flush. `reset` when the buffer is handed on (a new chunk starts)."""

    _zero: dict[tuple, tuple[bytes, list[bytes]]] = {}  # (nbytes, typesize, codec) -> zero chunk
    _zero_lock = threading.Lock()

    def __init__(self, cname: str, clevel: int, shuffle: int) -> None:
        self.codec = (cname, clevel, shuffle)
        self.kept: list[bytes] = []  # blocks 0..len-1 of the buffer: whole at an earlier flush

    def reset(self) -> None:
        self.kept = []

    def _zero_chunk(self, nbytes: int, dtype: np.dtype) -> tuple[bytes, list[bytes]] | None:
        key = (nbytes, dtype.itemsize, self.codec)
        z = self._zero.get(key)
        if z is None:
            frame = _compress(np.zeros(nbytes // dtype.itemsize, dtype), *self.codec)
            blocks = _blocks(frame)
            if blocks is None:
                return None
            with self._zero_lock:
                z = self._zero.setdefault(key, (frame, blocks))
        return z

    def _whole(self, buf: np.ndarray, flat: np.ndarray, zero_from: int) -> bytes:
        """The fallback: the whole chunk compressed, zeros from `zero_from` on; nothing kept."""
        flat[zero_from:] = 0
        self.reset()
        return _compress(buf.reshape(-1), *self.codec)

    def frame(self, buf: np.ndarray, filled: int) -> bytes:
        """The Blosc frame of `buf` (a C-contiguous chunk) with every byte from `filled` on
        zero. Writes those zeros into buf where the frame reads them."""
        flat = buf.reshape(-1).view(np.uint8)
        n = flat.nbytes
        nblocks = -(-n // TAIL_BLOCKSIZE)
        touched = -(-filled // TAIL_BLOCKSIZE)  # blocks holding rows
        start = len(self.kept)
        zero = self._zero_chunk(n, buf.dtype) if nblocks > 1 else None
        if zero is None or start > filled // TAIL_BLOCKSIZE:
            return self._whole(buf, flat, filled)
        end = min(n, touched * TAIL_BLOCKSIZE)
        flat[filled:end] = 0
        fresh: list[bytes] = []
        if touched > start:
            # From one block earlier where only the last, shorter block is new: alone, it
            # would be compressed as a whole frame's one block, not as a frame's last block.
            lo = start if end - start * TAIL_BLOCKSIZE >= TAIL_BLOCKSIZE else start - 1
            frame = _compress(flat[lo * TAIL_BLOCKSIZE : end].view(buf.dtype), *self.codec)
            cut = _blocks(frame)
            if cut is None or frame[:4] != zero[0][:4]:  # stored as is, or another header
                return self._whole(buf, flat, end)
            fresh = cut[start - lo :]
        blocks = [*self.kept, *fresh, *zero[1][touched:]]
        at = _HEADER + 4 * nblocks
        starts = np.empty(nblocks, "<i4")
        for j, b in enumerate(blocks):
            starts[j] = at
            at += len(b)
        if at > n + blosc_into.MAX_OVERHEAD:  # c-blosc would store this chunk as it is
            return self._whole(buf, flat, end)
        self.kept.extend(fresh[: filled // TAIL_BLOCKSIZE - start])
        head = zero[0][:12] + struct.pack("<I", at)
        return b"".join([head, starts.tobytes(), *blocks])
