"""Reading chosen rows of a column: only the stored chunks that hold them, a window at a time.

Replay needs the committed rows of `target.aux_hidden` (and the draft rows it compares), not
the rejected drafts between them. Rows of one chunk are decoded together whatever is asked
(chunkread.py), so a read is planned in chunks: the chunks that hold a wanted row, grouped into
runs of neighbouring chunks (one `column()` call each, so no chunk is decoded twice), a run
capped at MAX_WINDOW_CHUNKS so at most one window of unwanted rows is in memory at a time.
Only the wanted rows are kept. Chunks with no wanted row are not read at all.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Chunks per window: writer chunks are ~4 MiB (schema.CHUNK_TARGET_BYTES), so ~64 MiB at most.
MAX_WINDOW_CHUNKS = 16


def windows(rows: np.ndarray, unit: int, n: int, max_chunks: int = MAX_WINDOW_CHUNKS):
    """[(start, stop), ...] row windows covering every row of the sorted unique `rows`:
    whole chunks of `unit` rows (clipped to the column's `n` rows), neighbouring chunks
    merged up to `max_chunks` per window."""
    if len(rows) == 0:
        return []
    unit = max(1, int(unit))
    chunks = np.unique(np.asarray(rows, dtype=np.int64) // unit)
    out: list[tuple[int, int]] = []
    first = prev = int(chunks[0])
    for c in (int(c) for c in chunks[1:]):
        if c == prev + 1 and c - first < max_chunks:
            prev = c
            continue
        out.append((first * unit, min(n, (prev + 1) * unit)))
        first = prev = c
    out.append((first * unit, min(n, (prev + 1) * unit)))
    return out


def read_unit(table: Any, axis: str, name: str) -> int:
    """Rows per stored chunk of a column (1 where the table cannot say: exact windows)."""
    unit = getattr(table, "read_unit", None)
    return int(unit(axis, name)) if unit is not None else 1


class LastWindow:
    """The last window `gather` read of each column, kept for the next call: replay reads a
    request (or a batch of them) at a time, and neighbouring requests share a chunk, which is
    then decoded once, not once per request. One window per column is held (≤
    MAX_WINDOW_CHUNKS chunks); `clear` drops it."""

    def __init__(self) -> None:
        self._last: dict[tuple[int, str, str], tuple[int, int, Any]] = {}

    def read(self, table: Any, axis: str, name: str, lo: int, hi: int) -> Any:
        key = (id(table), axis, name)
        got = self._last.get(key)
        if got is not None and got[0] <= lo < got[1]:
            c_lo, c_hi, data = got
            if hi <= c_hi:
                return data[lo - c_lo : hi - c_lo]
            tail = table.column(axis, name, c_hi, hi)
            head = data[lo - c_lo :]
            if isinstance(tail, np.ndarray):
                data = np.concatenate([head, tail])
            else:
                import torch

                data = torch.cat([head, tail])
        else:
            data = table.column(axis, name, lo, hi)
        self._last[key] = (lo, hi, data)
        return data

    def clear(self) -> None:
        self._last.clear()


def gather(
    table: Any, axis: str, name: str, idx: np.ndarray, cache: LastWindow | None = None
) -> Any:
    """Rows `idx` (any order, repeats allowed) of a committed column, as `table.column` returns
    them (numpy, or torch for bf16), read window by window (`windows`) straight into the
    result: at most the result and one window are in memory (two with a `cache`, which
    keeps the last window for the next call)."""
    idx = np.asarray(idx, dtype=np.int64).reshape(-1)
    n = table.num_rows(axis)
    if len(idx) and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(f"rows of {axis}/{name} outside its {n} committed rows")
    order = np.argsort(idx, kind="stable")
    ordered = idx[order]
    out: np.ndarray | None = None
    torch_dtype = None
    for lo, hi in windows(np.unique(ordered), read_unit(table, axis, name), n):
        data = cache.read(table, axis, name, lo, hi) if cache else table.column(axis, name, lo, hi)
        if not isinstance(data, np.ndarray):  # torch (bf16): copied as its bits, by numpy
            torch_dtype, data = data.dtype, _bits(data)
        a, b = np.searchsorted(ordered, [lo, hi])
        if out is None:
            out = np.empty((len(idx), *data.shape[1:]), dtype=data.dtype)
        out[order[a:b]] = data[ordered[a:b] - lo]
        del data  # before the next window is read
    if out is None:
        return table.column(axis, name, 0, 0)  # the column's dtype and row shape, no rows
    if torch_dtype is None:
        return out
    import torch

    return torch.from_numpy(out).view(torch_dtype)


def _bits(x: Any) -> np.ndarray:
    """A torch tensor's memory as a numpy integer array of the same item size (no copy):
    numpy's row gather is several times torch's for bf16."""
    import torch

    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return x.contiguous().view(ints[x.element_size()]).numpy()
