"""Acceptance figures read straight from a trace's `verify` table (no replay needed).

The counts per draft position (offered, reached, accepted) and both rates come from
`hstrace.trace.acceptance_by_position`, the one count `hstrace show`, `hstrace report` and a
bundle's REPORT.md all print: `accept_len` excludes the bonus token (tokens committed per verify =
accept_len + 1); `rate_of_offered` = accepted / rows that offered position i, `rate_of_reached`
= accepted / rows that reached it (offered it and accepted every draft before it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hstrace.trace.acceptance_by_position import CONVENTIONS, PositionCounts, by_position


@dataclass(frozen=True)
class Acceptance:
    rows: int  # (verify event, request) rows
    mean_accept_len: float  # excluding the bonus token
    by_position: list[PositionCounts]
    histogram: list[tuple[int, int]]  # (accept_len, rows)

    def conditional(self) -> list[float]:
        """rate_of_reached per position (NaN where no row reached it)."""
        return [
            float("nan") if p.rate_of_reached is None else p.rate_of_reached
            for p in self.by_position
        ]

    def of_offered(self) -> list[float]:
        """rate_of_offered per position (NaN where no row offered it)."""
        return [
            float("nan") if p.rate_of_offered is None else p.rate_of_offered
            for p in self.by_position
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "mean_accept_len": self.mean_accept_len,
            "convention": "accept_len excludes the bonus token",
            "by_position": [p.to_json() for p in self.by_position],
            "by_position_conventions": dict(CONVENTIONS),
            "histogram": {str(k): v for k, v in self.histogram},
        }


def acceptance_of(trace: Any, rank: int | None = None) -> Acceptance | None:
    """Acceptance over every rank's verify rows (or one rank's); None without a verify table."""
    lens: list[np.ndarray] = []
    props: list[np.ndarray] = []
    for r in [rank] if rank is not None else list(trace.ranks):
        t = trace.rank(r).table("verify")
        if t is None or t.num_steps == 0:
            continue
        cols = t.columns.get("req", [])
        if "accept_len" not in cols:
            continue
        a = np.asarray(t.column("req", "accept_len"), dtype=np.int64)
        p = (
            np.asarray(t.column("req", "n_proposed"), dtype=np.int64)
            if "n_proposed" in cols
            else np.full_like(a, -1)  # unknown: every position counts as offered
        )
        lens.append(a)
        props.append(p)
    if not lens:
        return None
    a = np.concatenate(lens)
    p = np.concatenate(props)
    if a.size == 0:
        return None
    values, counts = np.unique(a, return_counts=True)
    hist = dict(zip(values.tolist(), counts.tolist(), strict=True))
    histogram = [(k, int(hist.get(k, 0))) for k in range(0, int(a.max(initial=0)) + 1)]
    return Acceptance(
        rows=int(a.size),
        mean_accept_len=float(a.mean()),
        by_position=by_position(a, p),
        histogram=histogram,
    )
