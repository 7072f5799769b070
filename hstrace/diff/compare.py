"""`hstrace diff A B`: align two traces by request token ids and step, report the first
difference in dataflow order.

Requests are matched by their prompt token ids (engine request ids differ between runs). For
each matched pair, the n-th event of each kind (prefill, verify forward, verify result, draft
extend, draft chain) is compared with the n-th of the other trace, in the order the engine ran
them: target forward -> verify/accept -> draft inputs -> draft top-k -> next target forward.
Within an event, inputs come before outputs: prompt ids -> target aux hidden -> draft inputs ->
draft top-k -> verify/accept. The first difference is the earliest one in that order (earliest
round across requests), since everything after it may only be its consequence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from hstrace.diff.streams import RequestLife, request_lives
from hstrace.diff.tolerance import (
    DEFAULT_ULPS,
    Tolerance,
    as_float,
    compute_dtype_of,
    is_float,
    row_rel_error,
)

# Dataflow stages, in order, and which columns belong to which stage.
STAGES = (
    "prompt ids",
    "target inputs",
    "target aux hidden",
    "verify/accept",
    "draft inputs",
    "draft top-k",
)
_DRAFT_OUT = {"topk_draft_ids", "topk_target_ids", "topk_logprobs", "lse", "logits"}
_SET_COLUMNS = {"topk_draft_ids", "topk_target_ids"}  # order among near-ties is not a difference


def stage_of(table: str, column: str) -> str:
    if table == "requests":
        return "prompt ids"
    if table == "target":
        return (
            "target inputs" if column in ("input_ids", "positions", "mode") else "target aux hidden"
        )
    if table == "verify":
        return "verify/accept"
    return "draft top-k" if column in _DRAFT_OUT else "draft inputs"


@dataclass
class StreamStats:
    stream: str
    stage: str
    compared_rows: int = 0
    differing_rows: int = 0
    max_rel_err: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Difference:
    stream: str
    stage: str
    request: str
    round: int  # how many target forwards of this request came before
    event: str
    detail: str
    row: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    def order(self) -> tuple[int, int]:
        return (self.round, STAGES.index(self.stage))

    def to_json(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "stage": self.stage,
            "request": self.request,
            "round": self.round,
            "event": self.event,
            "row": self.row,
            "detail": self.detail,
            "evidence": self.evidence,
        }


@dataclass
class DiffResult:
    a: dict[str, Any]
    b: dict[str, Any]
    tolerance: Tolerance
    matched: int
    only_a: list[str]
    only_b: list[str]
    first: Difference | None
    streams: list[StreamStats]
    notes: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.first is None

    @property
    def exit_code(self) -> int:
        return 0 if self.identical else 1

    def to_json(self) -> dict[str, Any]:
        return {
            "identical": self.identical,
            "a": self.a,
            "b": self.b,
            "tolerance": {
                "compute_dtype": self.tolerance.compute_dtype,
                "ulps": self.tolerance.ulps,
                "rel_l2": self.tolerance.rel,
                "rule": self.tolerance.describe(),
            },
            "requests": {"matched": self.matched, "only_a": self.only_a, "only_b": self.only_b},
            "dataflow_order": list(STAGES),
            "first_difference": self.first.to_json() if self.first else None,
            "streams": [s.to_json() for s in self.streams],
            "notes": list(self.notes),
        }


def _match(
    la: dict[int, RequestLife], lb: dict[int, RequestLife]
) -> tuple[list[tuple[RequestLife, RequestLife]], list[RequestLife], list[RequestLife]]:
    """Pair requests with equal prompt ids (first come, first paired; request ids differ)."""
    pool: dict[bytes, list[RequestLife]] = {}
    for life in lb.values():
        if life.prompt is not None:
            pool.setdefault(np.asarray(life.prompt, np.int64).tobytes(), []).append(life)
    pairs, only_a = [], []
    for life in la.values():
        cands = (
            pool.get(np.asarray(life.prompt, np.int64).tobytes())
            if life.prompt is not None
            else None
        )
        if cands:
            pairs.append((life, cands.pop(0)))
        else:
            only_a.append(life)
    used = {id(b) for _, b in pairs}
    only_b = [life for life in lb.values() if id(life) not in used]
    return pairs, only_a, only_b


def _float_dtypes(trace: Any, rank: int) -> list[str]:
    out = []
    view = trace.rank(rank)
    for name in view.tables:
        t = view.table(name)
        for axis, cols in t.columns.items():
            out += [t.logical_dtype(axis, c) for c in cols]
    return out


def diff_traces(ta: Any, tb: Any, *, rank: int = 0, ulps: float = DEFAULT_ULPS) -> DiffResult:
    for tr, side in ((ta, "A"), (tb, "B")):
        if rank not in tr.ranks:
            from hstrace.errors import TraceError

            raise TraceError(f"{tr.path}: trace {side} has no rank {rank} (ranks: {tr.ranks})")
    tol = Tolerance(compute_dtype_of(_float_dtypes(ta, rank) + _float_dtypes(tb, rank)), ulps)
    la, lb = request_lives(ta, rank), request_lives(tb, rank)
    pairs, only_a, only_b = _match(la, lb)
    stats: dict[str, StreamStats] = {}
    diffs: list[Difference] = []
    if only_a or only_b:
        who = (only_a or only_b)[0]
        diffs.append(
            Difference(
                "requests/prompt_ids",
                "prompt ids",
                who.rid,
                0,
                "requests",
                f"{len(only_a)} request(s) of A and {len(only_b)} of B have no request with the same prompt ids on the other side",
                evidence={
                    "only_a": [x.rid for x in only_a][:20],
                    "only_b": [x.rid for x in only_b][:20],
                },
            )
        )
    for a, b in pairs:
        d = _diff_request(a, b, tol, stats)
        if d is not None:
            diffs.append(d)
    first = min(diffs, key=Difference.order) if diffs else None
    ordered = sorted(stats.values(), key=lambda s: (STAGES.index(s.stage), s.stream))
    return DiffResult(
        a=_side(ta),
        b=_side(tb),
        tolerance=tol,
        matched=len(pairs),
        only_a=[x.rid for x in only_a],
        only_b=[x.rid for x in only_b],
        first=first,
        streams=ordered,
        notes=_redaction_notes(ta, tb),
    )


def _redaction_notes(ta: Any, tb: Any) -> list[str]:
    """Redacted bundles compare only with traces redacted the same way: say so up front."""
    notes = []
    for tr, side in ((ta, "A"), (tb, "B")):
        r = ((tr.meta.get("static") or {}).get("bundle") or {}).get("redaction") or {}
        modes = r.get("modes") or []
        if "ids" in modes:
            notes.append(
                f"{side}'s token ids are salted hashes (--redact ids, salt sha256 "
                f"{str(r.get('salt_sha256'))[:12]}...); they align only with a trace redacted with the same salt"
            )
        if "hidden" in modes:
            notes.append(
                f"{side}'s hidden states were replaced by per-slot statistics and sketches "
                "(--redact hidden); hidden-state streams cannot be compared"
            )
    return notes


def _side(tr: Any) -> dict[str, Any]:
    eng = tr.meta.get("engine") or {}
    return {
        "path": str(tr.path),
        "engine": eng.get("name"),
        "engine_version": eng.get("version"),
        "ranks": list(tr.ranks),
    }


def _diff_request(
    a: RequestLife, b: RequestLife, tol: Tolerance, stats: dict[str, StreamStats]
) -> Difference | None:
    first: Difference | None = None
    counts_a: dict[str, int] = {}
    counts_b: dict[str, int] = {}
    by_kind_b: dict[str, list] = {}
    for ev in b.events:
        by_kind_b.setdefault(ev.kind, []).append(ev)
    rounds = 0
    for ev in a.events:
        if ev.table == "target":
            rounds += 1
        n = counts_a.get(ev.kind, 0)
        counts_a[ev.kind] = n + 1
        others = by_kind_b.get(ev.kind, [])
        if n >= len(others):
            d = Difference(
                f"{ev.table}/events",
                stage_of(ev.table, "input_ids" if ev.table == "target" else "accept_len"),
                a.rid,
                rounds - 1,
                f"{ev.kind} #{n}",
                f"A has a {ev.kind} event #{n} for this request, B has only {len(others)}",
            )
            if first is None or d.order() < first.order():
                first = d
            break
        counts_b[ev.kind] = n + 1
        d = _diff_event(ev, others[n], tol, stats, a.rid, max(0, rounds - 1), f"{ev.kind} #{n}")
        if d is not None and (first is None or d.order() < first.order()):
            first = d
        if first is not None and first.round < rounds - 1:
            break  # later rounds cannot come first
    if first is None:
        for kind, evs in by_kind_b.items():
            if len(evs) > counts_a.get(kind, 0):
                return Difference(
                    f"{evs[0].table}/events",
                    stage_of(
                        evs[0].table, "input_ids" if evs[0].table == "target" else "accept_len"
                    ),
                    a.rid,
                    rounds,
                    f"{kind} #{counts_a.get(kind, 0)}",
                    f"B has {len(evs)} {kind} events for this request, A has {counts_a.get(kind, 0)}",
                )
    return first


def _diff_event(
    ea, eb, tol: Tolerance, stats: dict[str, StreamStats], rid: str, rnd: int, event: str
) -> Difference | None:
    found: list[Difference] = []
    for axis, cols in ea.rows.items():
        for col, va in cols.items():
            stream = f"{ea.table}/{axis}/{col}"
            stage = stage_of(ea.table, col)
            st = stats.setdefault(stream, StreamStats(stream, stage))
            vb = eb.rows.get(axis, {}).get(col)
            if vb is None:
                found.append(
                    Difference(
                        stream, stage, rid, rnd, event, f"column {axis}/{col} is absent in B"
                    )
                )
                continue
            d = _diff_column(np.asarray(va) if not hasattr(va, "dim") else va, vb, col, tol, st)
            if d is not None:
                row, detail, ev = d
                found.append(Difference(stream, stage, rid, rnd, event, detail, row, ev))
    for axis, cols in eb.rows.items():
        for col in cols:
            if col not in ea.rows.get(axis, {}):
                found.append(
                    Difference(
                        f"{eb.table}/{axis}/{col}",
                        stage_of(eb.table, col),
                        rid,
                        rnd,
                        event,
                        f"column {axis}/{col} is absent in A",
                    )
                )
    return min(found, key=Difference.order) if found else None


def _diff_column(
    va, vb, col: str, tol: Tolerance, st: StreamStats
) -> tuple[int | None, str, dict[str, Any]] | None:
    sa, sb = tuple(va.shape), tuple(vb.shape)
    if sa[1:] != sb[1:]:
        return None, f"row shapes differ: A {list(sa[1:])} vs B {list(sb[1:])}", {}
    n = min(sa[0] if sa else 1, sb[0] if sb else 1)
    if is_float(va) and is_float(vb):
        err = row_rel_error(va[:n], vb[:n]) if n else row_rel_error(va, vb)[:0]
        bad = (err > tol.rel) | err.isnan()
        st.compared_rows += n
        st.differing_rows += int(bad.sum())
        if n:
            st.max_rel_err = max(st.max_rel_err, float(err.nan_to_num(float("inf")).max()))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            xa, xb = as_float(va[i]).reshape(-1), as_float(vb[i]).reshape(-1)
            delta = (xa - xb).abs()
            j = int(delta.nan_to_num(float("inf")).argmax())
            evidence = {
                "rel_err": float(err[i]),
                "tolerance": tol.rel,
                "max_abs_diff": float(delta[j]),
                "at_element": j,
                "a": float(xa[j]),
                "b": float(xb[j]),
            }
            ratio = float(err[i]) / tol.rel
            return (
                i,
                (
                    f"row {i}: relative L2 error {float(err[i]):.3g} > tolerance {tol.rel:.3g} "
                    f"({ratio:.1f}x what {tol.compute_dtype} rounding explains)"
                ),
                evidence,
            )
    else:
        a = np.asarray(va)
        b = np.asarray(vb)
        a2 = a[:n].reshape(n, int(np.prod(a.shape[1:]))) if a.ndim else a.reshape(1, 1)
        b2 = b[:n].reshape(n, int(np.prod(b.shape[1:]))) if b.ndim else b.reshape(1, 1)
        if col in _SET_COLUMNS:
            eq = np.array(
                [np.array_equal(np.sort(x), np.sort(y)) for x, y in zip(a2, b2, strict=True)], bool
            )
        else:
            eq = (a2 == b2).all(axis=1) if a2.size else np.ones(len(a2), bool)
        st.compared_rows += len(eq)
        st.differing_rows += int((~eq).sum())
        if eq.size and not eq.all():
            i = int(np.flatnonzero(~eq)[0])
            return (
                i,
                f"row {i}: A {a2[i][:8].tolist()} vs B {b2[i][:8].tolist()}",
                {"a": a2[i][:16].tolist(), "b": b2[i][:16].tolist()},
            )
    if sa[0:1] != sb[0:1]:
        return (
            n,
            f"A has {sa[0]} rows, B has {sb[0]} (the first {n} agree)",
            {"rows_a": sa[0], "rows_b": sb[0]},
        )
    return None
