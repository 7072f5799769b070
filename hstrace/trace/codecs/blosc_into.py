"""Blosc compression into a buffer the caller owns (the writer's encode, issue 14).

numcodecs' `Blosc.encode` returns a new bytes object per chunk: a fresh ~4 MiB allocation per
encode, page-faulted and zeroed by the kernel, then copied again into the page cache. The
writer instead compresses each chunk into one of a few page-aligned buffers it reuses, and
writes them with O_DIRECT (rowlog.py). This calls the very c-blosc that numcodecs bundles (its
extension module exports `blosc_compress_ctx`), with the same parameters numcodecs passes, so
the frames are byte-identical to `Blosc.encode`'s (tests/test_rowlog.py). The call runs
without the GIL (ctypes releases it), on one Blosc thread, with no global state. Where the
symbol cannot be found (another numcodecs build), `available()` is False and the writer uses
numcodecs' own encode. The symbol is looked up on first use, not at import.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from typing import Any

import numpy as np

# Blosc 1 frames: 16 header bytes; an incompressible chunk is stored as is behind them.
MAX_OVERHEAD = 16
# O_DIRECT wants buffers, offsets and lengths in multiples of the logical block size; 4096
# covers every block device Linux has (STATX_DIOALIGN reports at most that in practice).
ALIGN = 4096


def _bind() -> Any:
    import numcodecs.blosc

    try:
        f = ctypes.CDLL(numcodecs.blosc.__file__).blosc_compress_ctx
    except (OSError, AttributeError):
        return None
    f.restype = ctypes.c_int
    f.argtypes = [
        ctypes.c_int,  # clevel
        ctypes.c_int,  # doshuffle
        ctypes.c_size_t,  # typesize
        ctypes.c_size_t,  # nbytes
        ctypes.c_void_p,  # src
        ctypes.c_void_p,  # dest
        ctypes.c_size_t,  # destsize
        ctypes.c_char_p,  # compressor
        ctypes.c_size_t,  # blocksize
        ctypes.c_int,  # numinternalthreads
    ]
    return f


_UNBOUND: Any = object()
_compress_ctx: Any = _UNBOUND  # c-blosc's blosc_compress_ctx, or None: not found
_bind_lock = threading.Lock()


def _function() -> Any:
    """blosc_compress_ctx, looked up on the first call (once per process), or None."""
    global _compress_ctx
    if _compress_ctx is _UNBOUND:
        with _bind_lock:
            if _compress_ctx is _UNBOUND:
                _compress_ctx = _bind()
    return _compress_ctx


def available() -> bool:
    """Whether c-blosc's blosc_compress_ctx was found (looks it up on the first call)."""
    return _function() is not None


def padded(n: int) -> int:
    """n rounded up to a whole number of ALIGN blocks."""
    return -(-n // ALIGN) * ALIGN


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 buffer of at least nbytes, padded to whole ALIGN blocks (anonymous
    memory: the kernel maps it zeroed, once; it is reused from then on)."""
    return np.frombuffer(mmap.mmap(-1, padded(max(1, nbytes))), dtype=np.uint8)


def compress_into(
    src: np.ndarray, dest: np.ndarray, cname: str, clevel: int, shuffle: int, blocksize: int
) -> int:
    """Compress the C-contiguous `src` into `dest` (uint8, at least src.nbytes + MAX_OVERHEAD);
    the frame's length. The same call numcodecs makes for `Blosc(cname, clevel, shuffle,
    blocksize, typesize=src.itemsize).encode(src)`."""
    compress_ctx = _function()
    if compress_ctx is None:
        raise RuntimeError("c-blosc's blosc_compress_ctx is not available")
    if not src.flags.c_contiguous or dest.nbytes < src.nbytes + MAX_OVERHEAD:
        raise ValueError("compress_into: a C-contiguous source and room for its frame")
    n = compress_ctx(
        clevel,
        shuffle,
        src.dtype.itemsize,
        src.nbytes,
        src.ctypes.data,
        dest.ctypes.data,
        # Exactly numcodecs' room: with more, Blosc would keep a frame bigger than the chunk
        # where numcodecs stores the chunk as is (memcpyed), and the bytes would differ.
        src.nbytes + MAX_OVERHEAD,
        cname.encode(),
        blocksize,
        1,
    )
    if n <= 0:
        raise RuntimeError(f"blosc compression failed ({n})")
    return n
