"""The byte-plane codec for 2-byte columns (bf16 activations and logits): the writer encodes
them into Blosc frames whose byte planes are Huffman-coded streams
(hstrace/trace/codecs/_planes.c says why and how); the reader's fast path decodes them.

The frames are plain Blosc 1 (zstd, byte shuffle, split blocks): numcodecs, zarr-python and
xarray read them as they read c-blosc's, and the arrays' zarr.json stays as it is. zstd is the
copy numcodecs bundles. The extension is imported and bound to that zstd on first use, never
at import. `available()` is False where the extension was not built or that copy lacks what it
needs; `enabled()` also reads HSTRACE_PLANES (0: c-blosc encodes and decodes everything), and
is asked when a writer or a reader is built; the writer then encodes with c-blosc
(blosc_into.py).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

# c-blosc's frame overhead, which this encoder never exceeds either
from hstrace.trace.codecs.blosc_into import MAX_OVERHEAD  # noqa: F401 (re-exported)

# Below this a chunk goes to c-blosc (a frame of a few hundred bytes gains nothing here).
MIN_BYTES = 4096

_UNBOUND: Any = object()
_bound: Any = _UNBOUND  # (the extension module, zstd's version number), or None: not usable
_bind_lock = threading.Lock()


def _bind() -> tuple[Any, int] | None:
    try:
        from hstrace.trace.codecs import _planes
    except ImportError:  # built without a C compiler: c-blosc's encoder does the work
        return None
    import numcodecs.blosc
    import numcodecs.zstd

    for module in (numcodecs.zstd, numcodecs.blosc):
        try:
            return _planes, _planes.bind(module.__file__)
        except OSError:
            continue
    return None


def _binding() -> tuple[Any, int] | None:
    """The extension and zstd's version, bound on the first call (once per process)."""
    global _bound
    if _bound is _UNBOUND:
        with _bind_lock:
            if _bound is _UNBOUND:
                _bound = _bind()
    return _bound


def zstd_version() -> int | None:
    """The version of the zstd the extension is bound to, or None where it cannot be."""
    b = _binding()
    return None if b is None else b[1]


def available() -> bool:
    """Whether the extension is built and bound (binds it on the first call)."""
    return _binding() is not None


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether byte planes are used: the extension is available and HSTRACE_PLANES is not 0
    (a comparison, or a zstd that misbehaves). Read when a writer or reader is built."""
    env = os.environ if environ is None else environ
    return env.get("HSTRACE_PLANES", "1") != "0" and available()


# A fast negative zstd level: with literals forced through Huffman, each stream is a byte-wise
# Huffman code per 128 KiB zstd block, plus the matches that long runs (padding, repeated
# rows) make cheap to find. On the bench's bf16 chunks it stores what zstd's very fastest
# level does (0.678) at the same speed, and unlike that level it codes repeated rows as
# c-blosc zstd-1 does (tests/test_blosc_planes.py).
LEVEL = -1000
HUFFMAN = 1  # ZSTD_c_literalCompressionMode = ZSTD_ps_enable


def applies(chunk: np.ndarray) -> bool:
    """Whether this encoder can take the chunk: the extension is available, 2-byte values,
    C-contiguous, big enough (HSTRACE_PLANES is the caller's: `enabled`)."""
    return (
        chunk.dtype.itemsize == 2
        and chunk.flags.c_contiguous
        and chunk.nbytes >= MIN_BYTES
        and available()
    )


def compress_into(
    chunk: np.ndarray, dest: np.ndarray, blocksize: int, level: int = LEVEL, huffman: int = HUFFMAN
) -> int:
    """Encode `chunk` (see `applies`) into `dest` (uint8, at least chunk.nbytes + 16 bytes) as
    one Blosc frame; its length. Runs without the GIL. `level` and `huffman` are zstd's
    (tests set c-blosc's to compare frames byte for byte)."""
    planes = _binding()
    if planes is None:
        raise RuntimeError("the byte-plane extension is not available (blosc_planes.available)")
    return planes[0].compress(chunk.reshape(-1).view(np.uint8), dest, blocksize, level, huffman)


def decompress_into(frame, dest: np.ndarray) -> bool:
    """Decode `frame` into all of `dest` (C-contiguous) if it is a split-block Blosc frame of
    2-byte values (this encoder's, or c-blosc's ALWAYS_SPLIT ones) that decodes to exactly
    dest.nbytes; False otherwise (dest then holds nothing meaningful: decode it with
    numcodecs, which also names what is wrong with a corrupt frame). A stream stored as it is
    is read where it lies and each block's planes go into dest in one pass, where c-blosc
    copies the stream out first and unshuffles after: 10-15 % faster on the bench's chunks."""
    planes = _binding()
    if planes is None:
        return False
    return planes[0].decompress(frame, dest.reshape(-1).view(np.uint8))
