"""The writer's encoder for 2-byte columns (bf16 activations and logits): Blosc frames whose
byte planes are Huffman-coded streams (hstrace/trace/_planes.c says why and how).

The frames are plain Blosc 1 (zstd, byte shuffle, split blocks): numcodecs, zarr-python and
xarray read them as they read c-blosc's, and the arrays' zarr.json stays as it is. zstd is the
copy numcodecs bundles. `AVAILABLE` is False where the extension was not built or that copy
lacks what it needs; the writer then encodes with c-blosc (blosc_into.py).
"""

from __future__ import annotations

import os

import numpy as np

# c-blosc's frame overhead, which this encoder never exceeds either
from hstrace.trace.blosc_into import MAX_OVERHEAD  # noqa: F401 (re-exported)

try:
    from hstrace.trace import _planes
except ImportError:  # built without a C compiler: c-blosc's encoder does the work
    _planes = None

# Below this a chunk goes to c-blosc (a frame of a few hundred bytes gains nothing here).
MIN_BYTES = 4096


def _bind() -> int | None:
    # HSTRACE_PLANES=0: c-blosc encodes everything (a comparison, or a zstd that misbehaves)
    if _planes is None or os.environ.get("HSTRACE_PLANES", "1") == "0":
        return None
    import numcodecs.blosc
    import numcodecs.zstd

    for module in (numcodecs.zstd, numcodecs.blosc):
        try:
            return _planes.bind(module.__file__)
        except OSError:
            continue
    return None


ZSTD_VERSION = _bind()
AVAILABLE = ZSTD_VERSION is not None
# A fast negative zstd level: with literals forced through Huffman, each stream is a byte-wise
# Huffman code per 128 KiB zstd block, plus the matches that long runs (padding, repeated
# rows) make cheap to find. On the bench's bf16 chunks it stores what zstd's very fastest
# level does (0.678) at the same speed, and unlike that level it codes repeated rows as
# c-blosc zstd-1 does (tests/test_blosc_planes.py).
LEVEL = -1000
HUFFMAN = 1  # ZSTD_c_literalCompressionMode = ZSTD_ps_enable


def applies(chunk: np.ndarray) -> bool:
    """Whether this encoder takes the chunk: 2-byte values, C-contiguous, big enough."""
    return (
        AVAILABLE
        and chunk.dtype.itemsize == 2
        and chunk.flags.c_contiguous
        and chunk.nbytes >= MIN_BYTES
    )


def compress_into(
    chunk: np.ndarray, dest: np.ndarray, blocksize: int, level: int = LEVEL, huffman: int = HUFFMAN
) -> int:
    """Encode `chunk` (see `applies`) into `dest` (uint8, at least chunk.nbytes + 16 bytes) as
    one Blosc frame; its length. Runs without the GIL. `level` and `huffman` are zstd's
    (tests set c-blosc's to compare frames byte for byte)."""
    return _planes.compress(chunk.reshape(-1).view(np.uint8), dest, blocksize, level, huffman)


def decompress_into(frame, dest: np.ndarray) -> bool:
    """Decode `frame` into all of `dest` (C-contiguous) if it is a split-block Blosc frame of
    2-byte values (this encoder's, or c-blosc's ALWAYS_SPLIT ones) that decodes to exactly
    dest.nbytes; False otherwise (dest then holds nothing meaningful: decode it with
    numcodecs, which also names what is wrong with a corrupt frame). A stream stored as it is
    is read where it lies and each block's planes go into dest in one pass, where c-blosc
    copies the stream out first and unshuffles after: 10-15 % faster on the bench's chunks."""
    if not AVAILABLE:
        return False
    return _planes.decompress(frame, dest.reshape(-1).view(np.uint8))
