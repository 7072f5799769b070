"""One append-only column on disk: whole-unit writes, an age-bounded tail, capacity growth.

Why this shape (reference/trace-storage.md §1, §6): `Array.append` rewrites metadata and
re-encodes a partial chunk on every call, and under SIGKILL leaves a shape that runs ahead of
the data. Here rows are staged in RAM and written one whole unit (a chunk, or a whole shard)
at a time, so no key is ever read-modify-written on the hot path; the shape is a capacity
grown in big steps, and how many rows are valid lives only in the rank's commit record.
"""

from __future__ import annotations

import math
import time

import numpy as np
import zarr
from zarr.codecs import BloscCodec

from hstrace.trace.schema import unit_rows

# Blosc zstd-1, byte shuffle, 1 MiB blocks: ~1.4x on bf16, releases the GIL (§3).
COMPRESSORS = [BloscCodec(cname="zstd", clevel=1, shuffle="shuffle", blocksize=1 << 20)]
# Capacity grows by this many units at a time, so zarr.json is rewritten rarely.
GROW_UNITS = 64


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
        self.row_shape = tuple(int(x) for x in row_shape)
        self.dtype = np.dtype(dtype)
        self.row_items = math.prod(self.row_shape)
        row_bytes = self.dtype.itemsize * math.prod(self.row_shape)
        chunk_rows, shard_rows = unit_rows(row_bytes)
        self.chunk_rows = chunk_rows
        self.unit = shard_rows or chunk_rows
        extra = {"shards": (shard_rows, *self.row_shape)} if shard_rows else {}
        self.arr = group.create_array(
            name,
            shape=(0, *self.row_shape),
            chunks=(chunk_rows, *self.row_shape),
            dtype=self.dtype,
            compressors=COMPRESSORS,
            fill_value=0,
            attributes={"hstrace_dtype": logical_dtype, **(attributes or {})},
            config={"write_empty_chunks": True},
            **extra,
        )
        self.buf: np.ndarray | None = None  # allocated on first rows (units can be 128 MiB)
        self.fill = 0  # rows staged in buf
        self.flushed = 0  # rows written as whole units
        self.tail_stored = 0  # rows durable through the last tail flush
        self.capacity = 0
        self.dirty_since: float | None = None  # monotonic time of the oldest unwritten row
        self.units_written = 0

    @property
    def stored(self) -> int:
        """Rows that are on disk (whole units plus the last tail flush)."""
        return max(self.flushed, self.tail_stored)

    @property
    def total(self) -> int:
        return self.flushed + self.fill

    def _ensure_capacity(self, end: int) -> None:
        if end > self.capacity:
            grow = GROW_UNITS * self.unit
            self.capacity = -(-end // grow) * grow
            self.arr.resize((self.capacity, *self.row_shape))

    def append(self, rows: np.ndarray, now: float | None = None) -> None:
        n = rows.shape[0]
        if n == 0:
            return
        if self.buf is None:
            self.buf = np.empty((self.unit, *self.row_shape), dtype=self.dtype)
        if self.dirty_since is None:
            self.dirty_since = time.monotonic() if now is None else now
        i = 0
        while i < n:
            k = min(self.unit - self.fill, n - i)
            self.buf[self.fill : self.fill + k] = rows[i : i + k]
            self.fill += k
            i += k
            if self.fill == self.unit:
                start = self.flushed
                self._ensure_capacity(start + self.unit)
                self.arr[start : start + self.unit] = self.buf  # a whole unit: no read
                self.flushed += self.unit
                self.fill = 0
                self.units_written += 1
                self.dirty_since = None if i == n else (time.monotonic() if now is None else now)

    def needs_tail_flush(self, now: float, max_age_s: float) -> bool:
        return self.dirty_since is not None and now - self.dirty_since >= max_age_s

    def flush_tail(self) -> bool:
        """Write the staged partial unit; the next whole-unit write replaces the same key.

        In a shard, inner chunks that an earlier tail flush already wrote whole are not
        re-encoded: the write starts at the first inner chunk that gained rows."""
        if self.dirty_since is None:
            return False
        if self.fill:
            done = max(0, self.tail_stored - self.flushed)
            a = done // self.chunk_rows * self.chunk_rows
            start = self.flushed
            self._ensure_capacity(start + self.fill)
            self.arr[start + a : start + self.fill] = self.buf[a : self.fill]
            self.tail_stored = start + self.fill
        self.dirty_since = None
        return True

    def close(self) -> None:
        """Write the tail and trim the shape to the exact row count."""
        self.flush_tail()
        self.flushed = self.stored
        self.fill = 0
        self.arr.resize((self.flushed, *self.row_shape))
        self.capacity = self.flushed
        self.buf = None
