"""Blosc frames both sides of the trace store use: the writer encodes with them, the reader's
fast path (`hstrace.trace.chunkread`) decodes the byte-plane frames with them.

    blosc_into.py    c-blosc compression into a buffer the caller owns (ctypes, no copy);
                     the frame overhead and block alignment the live-shard layout is built on
    blosc_planes.py  the byte-plane encoder/decoder for 2-byte columns (bf16)
    _planes.c        its C extension (optional; setup.py builds it)

Nothing here imports anything of hstrace; the extension and c-blosc's symbol are bound on
first use, not at import.
"""
