"""Which rows of a trace go into a bundle: whole engine steps, optionally narrowed to requests.

An *engine step* is one target forward (a row of the `target` table) plus every event of the
other tables recorded after it and before the next target forward (the verify result, the
draft extend and draft steps it fed). Events recorded before the first target forward belong
to step 0. `--steps` counts these engine steps, per rank, from 0.

Narrowing to requests keeps, inside each chosen event, only the rows of those requests: the
per-request row counts (`n_tok`, `n_proposed`, ...) say which rows of each axis a request owns.
A table whose axis has no such count keeps the whole event when any chosen request is in it.
The `requests` table is kept for every request that appears in a chosen step, whatever its
step, so that a subset still carries the prompts that alignment needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hstrace.errors import HstraceError
from hstrace.trace.schema import REQ_AXIS, REQUEST_ROW_COUNTS, STEP_AXIS


@dataclass(frozen=True)
class Event:
    seq: int
    table: str
    step: int  # the table's own step index
    engine_step: int


@dataclass
class RankPlan:
    rank: int
    events: list[Event]  # every event of the rank, in seq order
    num_engine_steps: int
    req_keys_by_event: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)


def parse_steps(spec: str | None, total: int) -> list[int]:
    """`5`, `0:40` (half-open), `10:` or `:8`, comma-separated: engine step indices, sorted."""
    if spec is None:
        return list(range(total))
    chosen: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if ":" in part:
                lo_s, hi_s = part.split(":", 1)
                lo = int(lo_s) if lo_s.strip() else 0
                hi = int(hi_s) if hi_s.strip() else total
                if lo < 0 or hi < lo:
                    raise ValueError
                chosen.update(range(lo, min(hi, total)))
            else:
                v = int(part)
                if v < 0:
                    raise ValueError
                if v < total:
                    chosen.add(v)
        except ValueError:
            raise HstraceError(
                f"--steps {spec!r}: expected N, A:B (half-open) or a comma list of those"
            ) from None
    if not chosen:
        raise HstraceError(f"--steps {spec!r} selects no step; the trace has {total} engine steps")
    return sorted(chosen)


def parse_requests(spec: str | None, request_key: Any) -> set[int] | None:
    """Request ids (as the engine named them) or request keys (ints), comma-separated."""
    if spec is None:
        return None
    keys: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        keys.add(request_key(part))
        if part.isdigit():
            keys.add(int(part))
    if not keys:
        raise HstraceError(f"--requests {spec!r} names no request")
    return keys


def plan_rank(rank_view: Any, rank: int) -> RankPlan:
    """All events of one rank in seq order, each tagged with its engine step."""
    raw: list[tuple[int, str, int]] = []
    for name in rank_view.tables:
        t = rank_view.table(name)
        if t is None or t.num_steps == 0:
            continue
        seq = np.asarray(t.column(STEP_AXIS, "seq"), dtype=np.int64)[: t.num_steps]
        raw.extend((int(q), name, i) for i, q in enumerate(seq))
    raw.sort()
    target_seq = np.array([q for q, name, _ in raw if name == "target"], dtype=np.int64)
    events = []
    for q, name, i in raw:
        if len(target_seq):
            es = max(0, int(np.searchsorted(target_seq, q, side="right")) - 1)
        else:
            es = len(events)  # no target table: every event is its own step
        events.append(Event(q, name, i, es))
    total = (len(target_seq) if len(target_seq) else len(events)) if events else 0
    plan = RankPlan(rank=rank, events=events, num_engine_steps=total)
    for name in rank_view.tables:
        t = rank_view.table(name)
        if t is None or t.num_steps == 0 or "req_key" not in t.columns.get(REQ_AXIS, []):
            continue
        keys = np.asarray(t.column(REQ_AXIS, "req_key"), dtype=np.int64)
        off = np.asarray(t.offsets(REQ_AXIS), dtype=np.int64)
        for i in range(t.num_steps):
            plan.req_keys_by_event[(name, i)] = keys[off[i] : off[i + 1]]
    return plan


def choose_events(
    plan: RankPlan, engine_steps: list[int], requests: set[int] | None
) -> list[tuple[Event, np.ndarray | None]]:
    """Events to keep, in seq order, each with a request mask over its req rows (None = all)."""
    steps = set(engine_steps)
    chosen: list[tuple[Event, np.ndarray | None]] = []
    seen_reqs: set[int] = set()
    for ev in plan.events:
        if ev.table == "requests" or ev.engine_step not in steps:
            continue
        keys = plan.req_keys_by_event.get((ev.table, ev.step))
        mask = None
        if requests is not None:
            if keys is None:
                continue
            mask = np.isin(keys, np.fromiter(requests, np.int64, len(requests)))
            if not mask.any():
                continue
        if keys is not None:
            seen_reqs.update(int(k) for k in (keys if mask is None else keys[mask]))
        chosen.append((ev, mask))
    # The prompts of every request that appears, whatever step recorded them.
    for ev in plan.events:
        if ev.table != "requests":
            continue
        keys = plan.req_keys_by_event.get((ev.table, ev.step))
        if keys is None:
            continue
        mask = np.isin(keys, np.fromiter(seen_reqs, np.int64, len(seen_reqs)))
        if mask.any():
            chosen.append((ev, None if mask.all() else mask))
    chosen.sort(key=lambda e: e[0].seq)
    return chosen


def slice_requests(
    table: str, rows: dict[str, dict[str, Any]], mask: np.ndarray | None
) -> dict[str, dict[str, Any]]:
    """Keep only the req rows in `mask` and the rows they own on every other axis."""
    if mask is None:
        return rows
    req = rows.get(REQ_AXIS, {})
    out: dict[str, dict[str, Any]] = {}
    for axis, cols in rows.items():
        if axis == STEP_AXIS:
            out[axis] = cols
            continue
        if axis == REQ_AXIS:
            out[axis] = {c: a[mask] for c, a in cols.items()}
            continue
        count_col = REQUEST_ROW_COUNTS.get((table, axis))
        if count_col is None or count_col not in req:
            out[axis] = cols  # no per-request ownership known: keep the event's rows whole
            continue
        counts = np.asarray(req[count_col], dtype=np.int64)
        bounds = np.concatenate([[0], np.cumsum(counts)])
        idx = np.concatenate(
            [np.arange(bounds[i], bounds[i + 1]) for i in np.flatnonzero(mask)]
            or [np.zeros(0, np.int64)]
        ).astype(np.int64)
        out[axis] = {c: a[idx] for c, a in cols.items()}
    return out
