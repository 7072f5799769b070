"""Read a table's steps in windows: one zarr read per column per window, not per step.

`TableView.step(s)` reads every column once per step; a bundle or a diff walks thousands of
steps in order, so per-read overhead (~1 ms, plus decoding the whole chunk each time)
dominates. This reads `window` consecutive steps at once and serves slices from memory. The
window is also capped in rows so a window of prefill steps stays small.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hstrace.trace.schema import STEP_AXIS

DEFAULT_WINDOW = 64
MAX_WINDOW_BYTES = 64 << 20


class WindowedSteps:
    def __init__(self, table: Any, window: int = DEFAULT_WINDOW) -> None:
        self.t = table
        self.window = max(1, window)
        self.lo = self.hi = 0
        self.data: dict[str, dict[str, Any]] = {}
        self.offs = {a: np.asarray(table.offsets(a), dtype=np.int64) for a in table.columns}
        self.row_bytes = {
            a: sum(self._row_nbytes(a, c) for c in cols) for a, cols in table.columns.items()
        }

    def _row_nbytes(self, axis: str, col: str) -> int:
        n = self.t.num_rows(axis) if axis != STEP_AXIS else self.t.num_steps
        if n == 0:
            return 0
        a = self.t.column(axis, col, start=0, stop=1)
        return int(a.element_size() * a.numel()) if hasattr(a, "element_size") else int(a.nbytes)

    def _load(self, s: int) -> None:
        hi = min(self.t.num_steps, s + self.window)
        while hi > s + 1:  # shrink until the window's rows fit the byte cap
            size = sum(self.row_bytes[a] * int(o[hi] - o[s]) for a, o in self.offs.items())
            if size <= MAX_WINDOW_BYTES:
                break
            hi = s + max(1, (hi - s) // 2)
        self.data = {
            a: {c: self.t.column(a, c, int(self.offs[a][s]), int(self.offs[a][hi])) for c in cols}
            for a, cols in self.t.columns.items()
        }
        self.lo, self.hi = s, hi

    def step(self, s: int) -> dict[str, dict[str, Any]]:
        if not self.lo <= s < self.hi:
            self._load(s)
        out: dict[str, dict[str, Any]] = {}
        for a, cols in self.data.items():
            o = self.offs[a]
            b0, b1 = int(o[s] - o[self.lo]), int(o[s + 1] - o[self.lo])
            out[a] = {c: v[b0:b1] for c, v in cols.items()}
        return out
