"""One request's life in a trace, as an ordered list of events (for `hstrace diff`).

Each request gets its prompt ids and the sequence of events that touched it, in the order the
engine recorded them (`seq`), with only that request's rows. Consecutive events of the same
table (and, for `target`, the same mode) are merged, so a prefill chunked into two forwards in
one engine and one forward in the other still line up token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hstrace.trace.schema import REQ_AXIS, REQUEST_ROW_COUNTS, STEP_AXIS
from hstrace.trace.stepcache import WindowedSteps

COMPARED_TABLES = ("target", "verify", "draft_extend", "draft_step")
# Columns that identify rather than describe: never compared.
IGNORED = {"seq", "t_ns", "req_key", "rid_len"}


@dataclass
class ReqEvent:
    table: str
    kind: str  # table, or "target:prefill" / "target:verify"
    seqs: list[int]
    steps: list[int]
    rows: dict[str, dict[str, Any]]  # axis -> column -> this request's rows (concatenated)


@dataclass
class RequestLife:
    key: int
    rid: str
    prompt: np.ndarray | None
    events: list[ReqEvent] = field(default_factory=list)


def _cat(parts: list[Any]) -> Any:
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return np.concatenate([np.asarray(p) for p in parts])


def _rows_of(table: str, step: dict[str, dict[str, Any]], i: int) -> dict[str, dict[str, Any]]:
    """Request row i of one step, with the rows it owns on every axis."""
    req = step.get(REQ_AXIS, {})
    out: dict[str, dict[str, Any]] = {}
    for axis, cols in step.items():
        if axis == STEP_AXIS:
            out[axis] = {c: a for c, a in cols.items() if c not in IGNORED}
        elif axis == REQ_AXIS:
            out[axis] = {c: a[i : i + 1] for c, a in cols.items() if c not in IGNORED}
        else:
            count = REQUEST_ROW_COUNTS.get((table, axis))
            if count is None or count not in req:
                out[axis] = cols
                continue
            n = np.asarray(req[count], dtype=np.int64)
            lo, hi = int(n[:i].sum()), int(n[: i + 1].sum())
            out[axis] = {c: a[lo:hi] for c, a in cols.items()}
    return out


def _merge(a: ReqEvent, b: ReqEvent) -> None:
    a.seqs += b.seqs
    a.steps += b.steps
    for axis, cols in b.rows.items():
        if axis == STEP_AXIS:
            continue  # keep the first event's step values
        for c, v in cols.items():
            a.rows[axis][c] = _cat([a.rows[axis][c], v])


def request_lives(trace: Any, rank: int) -> dict[int, RequestLife]:
    view = trace.rank(rank)
    lives: dict[int, RequestLife] = {}
    req_t = view.table("requests")
    if req_t is not None:
        for s in range(req_t.num_steps):
            step = req_t.step(s)
            keys = np.asarray(step[REQ_AXIS]["req_key"], dtype=np.int64)
            for i, k in enumerate(keys.tolist()):
                rows = _rows_of("requests", step, i)
                rid = bytes(
                    np.asarray(rows.get("rid", {}).get("bytes", np.zeros(0, np.uint8)), np.uint8)
                ).decode("utf-8", "replace")
                prompt = rows.get("tok", {}).get("prompt_ids")
                lives[k] = RequestLife(
                    k, rid or str(k), None if prompt is None else np.asarray(prompt)
                )
    raw: list[tuple[int, ReqEvent, int]] = []
    for name in COMPARED_TABLES:
        t = view.table(name)
        if t is None:
            continue
        seq = np.asarray(t.column(STEP_AXIS, "seq"), dtype=np.int64)
        steps = WindowedSteps(t)
        for s in range(t.num_steps):
            step = steps.step(s)
            keys = np.asarray(step.get(REQ_AXIS, {}).get("req_key", np.zeros(0)), dtype=np.int64)
            kind = name
            if name == "target" and "mode" in step[STEP_AXIS]:
                kind = (
                    "target:prefill"
                    if int(np.asarray(step[STEP_AXIS]["mode"]).reshape(-1)[0]) == 0
                    else "target:verify"
                )
            for i, k in enumerate(keys.tolist()):
                raw.append(
                    (
                        int(seq[s]),
                        ReqEvent(name, kind, [int(seq[s])], [s], _rows_of(name, step, i)),
                        k,
                    )
                )
    raw.sort(key=lambda e: e[0])
    for _, ev, k in raw:
        life = lives.setdefault(k, RequestLife(k, str(k), None))
        if life.events and life.events[-1].kind == ev.kind:
            _merge(life.events[-1], ev)
        else:
            life.events.append(ev)
    for life in lives.values():  # no requests table: the prefill's tokens are the prompt
        if life.prompt is None and life.events and life.events[0].kind == "target:prefill":
            life.prompt = np.asarray(life.events[0].rows["tok"]["input_ids"])
    return lives
