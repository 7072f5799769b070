"""Where things lie in a shard file that is live at its key: the writer (rowlog._Shard) lays
it out, the reader (chunkread) needs to know which inner chunk may still move.

A tail flush makes a shard durable before it is full. The file is then sparse, `size` bytes:
room for every inner chunk (each block-aligned) and the final index, two tail slots, then the
index, which ends the file as in any shard. Whole inner chunks are written once, below the
slots, and never move. The partly filled chunk moves: each tail flush writes it into the slot
the index on disk does not point at, then rewrites the index in place. Finishing the shard
writes the final index after the last chunk and cuts the file there.
"""

from __future__ import annotations

from typing import NamedTuple

from hstrace.trace.codecs.blosc_into import MAX_OVERHEAD, padded


class LiveLayout(NamedTuple):
    slots: tuple[int, int]  # file offsets of the two tail slots
    size: int  # the live file's size


def index_bytes(n_inner: int) -> int:
    """A shard index: (offset, nbytes) uint64 per inner chunk, then its crc32c."""
    return n_inner * 16 + 4


def live_layout(n_inner: int, chunk_bytes: int) -> LiveLayout:
    """The layout of a live shard of `n_inner` chunks of `chunk_bytes` decoded bytes each."""
    frame, index = padded(chunk_bytes + MAX_OVERHEAD), padded(index_bytes(n_inner))
    first = n_inner * frame + index
    return LiveLayout((first, first + frame), first + 2 * frame + index)


def live_shard_bytes(n_inner: int, chunk_bytes: int) -> int:
    """Size of a shard file that is live at its key."""
    return live_layout(n_inner, chunk_bytes).size


def in_tail_slot(offset: int, file_size: int, n_inner: int, chunk_bytes: int) -> bool:
    """Whether an inner chunk at `offset` of a shard file of `file_size` bytes is the live
    shard's partly filled chunk: the one a later tail flush may overwrite."""
    lay = live_layout(n_inner, chunk_bytes)
    return file_size == lay.size and offset >= lay.slots[0]
