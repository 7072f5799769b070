"""Acceptance figures read straight from a trace's `verify` table (no replay needed).

Conventions, stated wherever these numbers are shown: `accept_len` counts accepted draft
tokens and excludes the bonus token (tokens committed per verify = accept_len + 1). Draft
position i (0-based) is *reached* by a verify row when the engine proposed more than i tokens
and accepted the first i; it is *accepted* when accept_len > i. The conditional rate is
accepted / reached; the unconditional rate is accepted / all verify rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Acceptance:
    rows: int  # (verify event, request) rows
    mean_accept_len: float  # excluding the bonus token
    by_position: list[tuple[int, int, int]]  # (position, reached, accepted)
    histogram: list[tuple[int, int]]  # (accept_len, rows)

    def conditional(self) -> list[float]:
        return [a / r if r else float("nan") for _, r, a in self.by_position]

    def unconditional(self) -> list[float]:
        return [a / self.rows if self.rows else float("nan") for _, _, a in self.by_position]

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "mean_accept_len": self.mean_accept_len,
            "convention": "accept_len excludes the bonus token",
            "by_position": [
                {"position": p, "reached": r, "accepted": a, "rate": (a / r if r else None)}
                for p, r, a in self.by_position
            ],
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
            else np.full_like(a, a.max(initial=0))
        )
        lens.append(a)
        props.append(p)
    if not lens:
        return None
    a = np.concatenate(lens)
    p = np.concatenate(props)
    if a.size == 0:
        return None
    depth = int(max(p.max(initial=0), a.max(initial=0)))
    by_pos = []
    for i in range(depth):
        reached = int(np.count_nonzero((p > i) & (a >= i)))
        accepted = int(np.count_nonzero(a > i))
        by_pos.append((i, reached, accepted))
    values, counts = np.unique(a, return_counts=True)
    hist = dict(zip(values.tolist(), counts.tolist(), strict=True))
    histogram = [(k, int(hist.get(k, 0))) for k in range(0, int(a.max(initial=0)) + 1)]
    return Acceptance(
        rows=int(a.size), mean_accept_len=float(a.mean()), by_position=by_pos, histogram=histogram
    )
