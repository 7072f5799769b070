"""Tail frames put together from kept, fresh and zero blocks are c-blosc's own frame of the
padded chunk, byte for byte, at every flush of a filling chunk (hstrace/trace/codecs/blosc_tail.py)."""

from __future__ import annotations

import numcodecs.blosc
import numpy as np
import pytest
from numcodecs import Blosc

from hstrace.trace.codecs import blosc_into
from hstrace.trace.codecs.blosc_tail import TAIL_BLOCKSIZE, TailFrames
from hstrace.trace.write.rowlog import CLEVEL, CNAME

pytestmark = pytest.mark.skipif(
    not blosc_into.available(), reason="this numcodecs build does not export blosc_compress_ctx"
)


def reference(chunk: np.ndarray, filled: int) -> bytes:
    """numcodecs' encode of the chunk with every byte from `filled` on zero."""
    numcodecs.blosc.use_threads = False
    padded = chunk.copy().reshape(-1).view(np.uint8)
    padded[filled:] = 0
    codec = Blosc(
        cname=CNAME,
        clevel=CLEVEL,
        shuffle=Blosc.SHUFFLE,
        blocksize=TAIL_BLOCKSIZE,
        typesize=chunk.dtype.itemsize,
    )
    return bytes(codec.encode(padded.view(chunk.dtype)))


def rows(kind: str, n: int, row_shape: tuple, dtype, rng) -> np.ndarray:
    if kind == "random":  # incompressible bytes: c-blosc stores streams (or the chunk) as is
        return rng.integers(0, 256, (n, *row_shape, np.dtype(dtype).itemsize), np.uint8).view(
            dtype
        )[..., 0]
    # activation-like: bf16 bits of normal values (compressible exponents)
    if np.dtype(dtype).itemsize == 2:
        f = rng.standard_normal((n, *row_shape)).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(dtype)
    return rng.integers(0, 1000, (n, *row_shape)).astype(dtype)


@pytest.mark.parametrize(
    "dtype, row_shape, chunk_rows",
    [
        (np.uint16, (3, 64), 8192),  # 3 MiB: 48 whole blocks
        (np.int64, (), 65536),  # 512 KiB: 8 blocks
        (np.float32, (5,), 3000),  # 60000 B: one block, the whole-chunk path
        (np.uint16, (7,), 20000),  # 280000 B: 4 whole blocks and a shorter last one
        (np.int32, (3,), 6000),  # 72000 B: one whole block and a shorter last one
    ],
)
@pytest.mark.parametrize("kind", ["normal", "random"])
def test_every_tail_is_cblosc_frame_of_the_padded_chunk(dtype, row_shape, chunk_rows, kind):
    rng = np.random.default_rng(7)
    buf = np.full((chunk_rows, *row_shape), 0x5A, dtype)  # stale bytes of a reused buffer
    tails = TailFrames(CNAME, CLEVEL, Blosc.SHUFFLE)
    row_bytes = buf[0].nbytes
    fill = 0
    flushes = 0
    # uneven steps: some flushes add nothing, some cross several blocks, the last fills it
    for add in [1, 0, 37, 500, 1, 0, 2000, 3, 90000]:
        k = min(add, chunk_rows - fill)
        buf[fill : fill + k] = rows(kind, k, row_shape, dtype, rng)
        fill += k
        got = tails.frame(buf, fill * row_bytes)
        want = reference(buf, fill * row_bytes)
        assert got == want, f"flush {flushes}: fill {fill} rows of {chunk_rows}"
        out = np.empty_like(buf)
        numcodecs.blosc.decompress(got, out)
        same = out[:fill].view(np.uint8) == buf[:fill].view(np.uint8)  # NaN bits compare too
        assert same.all() and not out[fill:].view(np.uint8).any()
        flushes += 1
    assert fill == chunk_rows
    # a new chunk in the same buffer: kept blocks of the old one must not leak into it
    tails.reset()
    buf[:5] = rows(kind, 5, row_shape, dtype, rng)
    assert tails.frame(buf, 5 * row_bytes) == reference(buf, 5 * row_bytes)


def test_kept_blocks_are_reused_not_recompressed(monkeypatch):
    """The second flush compresses only the blocks rows arrived in since the first."""
    from hstrace.trace.codecs import blosc_tail

    sizes: list[int] = []
    real = blosc_tail._compress
    monkeypatch.setattr(
        blosc_tail, "_compress", lambda src, *c: sizes.append(src.nbytes) or real(src, *c)
    )
    buf = np.zeros((8192, 3, 64), np.uint16)  # 3 MiB, 48 blocks
    row = buf[0].nbytes  # 384 B
    tails = TailFrames(CNAME, CLEVEL, Blosc.SHUFFLE)
    rng = np.random.default_rng(0)
    buf[:2000] = rng.integers(0, 1 << 16, (2000, 3, 64)).astype(np.uint16)
    tails.frame(buf, 2000 * row)  # the zero chunk (once per size) and blocks 0-11
    buf[2000:2100] = rng.integers(0, 1 << 16, (100, 3, 64)).astype(np.uint16)
    sizes.clear()
    assert tails.frame(buf, 2100 * row) == reference(buf, 2100 * row)
    # rows 2000-2099 are bytes 768000-806399: blocks 11 (partly filled before) and 12; 0-10 kept
    assert sizes == [2 * TAIL_BLOCKSIZE]
