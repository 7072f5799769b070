"""Acceptance by draft position, counted once for every output (show, report, bundle, JSON).

`accept_len` counts accepted draft tokens and excludes the bonus token. For draft position i
(0-based) and the verify rows of a trace:

- offered:  rows that proposed position i (`n_proposed > i`; every row when it is unknown:
  the column absent or -1),
- reached:  offered rows that also accepted the i drafts before it (`accept_len >= i`),
- accepted: offered rows with `accept_len > i`.

Two rates follow and both are shown, each under its own name, because they answer different
questions: `rate_of_offered` = accepted / offered (how often position i lands, whatever came
before it: `hstrace show`'s historical "rate_by_position"), `rate_of_reached` = accepted /
reached (how often position i lands once the chain got there: the conditional rate the HTML
chart plots). Counts come from one histogram per quantity, O(depth + rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

OF_OFFERED = "rate_of_offered"
OF_REACHED = "rate_of_reached"
# The names each convention goes by wherever it is printed.
CONVENTIONS = {
    OF_OFFERED: "accepted / rows that offered position i",
    OF_REACHED: "accepted / rows that reached position i (offered it, accepted all before it)",
}


@dataclass(frozen=True)
class PositionCounts:
    position: int
    offered: int
    reached: int
    accepted: int

    @property
    def rate_of_offered(self) -> float | None:
        return self.accepted / self.offered if self.offered else None

    @property
    def rate_of_reached(self) -> float | None:
        return self.accepted / self.reached if self.reached else None

    def to_json(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "offered": self.offered,
            "reached": self.reached,
            "accepted": self.accepted,
            OF_OFFERED: _round(self.rate_of_offered),
            OF_REACHED: _round(self.rate_of_reached),
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def _count_greater(values: np.ndarray, depth: int) -> np.ndarray:
    """[depth] array: entry i = how many values are > i."""
    v = np.clip(values, 0, depth).astype(np.int64)
    hist = np.bincount(v, minlength=depth + 1)
    return (hist[::-1].cumsum()[::-1])[1:]


def depth_of(accept_len: np.ndarray, n_proposed: np.ndarray | None) -> int:
    """How many draft positions the rows speak of: the largest known n_proposed or accept_len."""
    a = np.asarray(accept_len, dtype=np.int64)
    if a.size == 0:
        return 0
    d = int(a.max())
    if n_proposed is not None:
        p = np.asarray(n_proposed, dtype=np.int64)
        if p.size and (p >= 0).any():
            d = max(d, int(p[p >= 0].max()))
    return d


def by_position(
    accept_len: np.ndarray, n_proposed: np.ndarray | None, depth: int | None = None
) -> list[PositionCounts]:
    """Offered / reached / accepted per draft position (see the module docstring)."""
    a = np.asarray(accept_len, dtype=np.int64)
    depth = depth_of(a, n_proposed) if depth is None else depth
    if a.size == 0 or depth <= 0:
        return []
    # Unknown n_proposed (absent, or -1): the row offered every position.
    p = np.full_like(a, depth) if n_proposed is None else np.asarray(n_proposed, dtype=np.int64)
    p = np.where(p < 0, depth, p)
    offered = _count_greater(p, depth)
    reached = _count_greater(np.minimum(a + 1, p), depth)  # i <= accept_len and i < n_proposed
    accepted = _count_greater(np.minimum(a, p), depth)  # i < accept_len and i < n_proposed
    return [
        PositionCounts(i, int(offered[i]), int(reached[i]), int(accepted[i])) for i in range(depth)
    ]
