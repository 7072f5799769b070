"""The numbers `hstrace show` prints: one dict, the same for the table view and `--json`.

Keys are documented in docs/trace-format.md ("Summary keys"). Acceptance follows the store's
convention: `accept_len` counts accepted draft tokens and excludes the bonus token.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hstrace.errors import TraceError
from hstrace.trace import acceptance_by_position as acc
from hstrace.trace.reader import TableView, Trace
from hstrace.trace.schema import MODE_PREFILL, SAMPLING_COLUMNS, SAMPLING_FLOAT
from hstrace.trace.validate import DRAFT_ID_COLUMNS, TARGET_ID_COLUMNS

ACCEPT_CONVENTION = "accept_len counts accepted draft tokens, excluding the bonus token"
DRAFT_TABLES = ("draft_extend", "draft_step")
# More draft positions than any engine proposes per step (SGLang/vLLM trees are <= 64 deep).
MAX_DEPTH = 4096


def _rows(t: TableView | None, axis: str) -> int:
    return 0 if t is None or axis not in t.axes else t.num_rows(axis)


def _col(t: TableView, axis: str, name: str) -> np.ndarray | None:
    return np.asarray(t.column(axis, name)) if name in t.columns.get(axis, []) else None


def summarize(trace: Trace) -> dict[str, Any]:
    meta = trace.meta
    per_rank: list[dict[str, Any]] = []
    req_keys: set[int] = set()
    accept_lens: list[np.ndarray] = []
    proposed_counts: list[np.ndarray] = []
    steps_total: dict[str, int] = {}
    dropped_total: dict[str, int] = {}
    errors: list[dict[str, Any]] = []
    request_list: list[dict[str, Any]] = []
    for r in trace.ranks:
        rv = trace.rank(r)
        steps = {name: rv.table(name).num_steps for name in rv.tables}
        for name, n in steps.items():
            steps_total[name] = steps_total.get(name, 0) + n
        target = rv.table("target")
        tokens = {"total": _rows(target, "tok"), "prefill": 0, "verify": 0}
        if (
            target is not None
            and target.num_steps
            and (mode := _col(target, "step", "mode")) is not None
        ):
            per_step = np.diff(target.offsets("tok"))
            tokens["prefill"] = int(per_step[mode == MODE_PREFILL].sum())
            tokens["verify"] = tokens["total"] - tokens["prefill"]
        draft = {name: _rows(rv.table(name), "tok") for name in DRAFT_TABLES}
        for name in rv.tables:
            t = rv.table(name)
            if (keys := _col(t, "req", "req_key")) is not None:
                req_keys.update(int(k) for k in np.unique(keys))
            # Token ids are a small share of a trace (8 bytes a token against kilobytes of
            # hidden state): reading them lets the reader check them against the vocabulary,
            # so `show` never summarises a trace whose ids are corrupt.
            for axis, col in sorted(TARGET_ID_COLUMNS | DRAFT_ID_COLUMNS):
                if col in t.columns.get(axis, []):
                    t.column(axis, col)
            for col in t.columns.get("step", []):  # one scalar per step: checked alike
                t.column("step", col)
        verify = rv.table("verify")
        if verify is not None and (al := _col(verify, "req", "accept_len")) is not None:
            accept_lens.append(al.astype(np.int64))
            n_prop = _col(verify, "req", "n_proposed")
            proposed_counts.append(
                (n_prop if n_prop is not None else np.full_like(al, -1)).astype(np.int64)
            )
        for name, n in rv.dropped_steps.items():
            dropped_total[name] = dropped_total.get(name, 0) + int(n)
        request_list += _request_metadata(rv.table("requests"), r)
        errors += [{"rank": r, "tap": e.get("tap"), "message": e.get("message")} for e in rv.errors]
        per_rank.append(
            {
                "rank": r,
                "clean_close": rv.clean_close,
                "steps": steps,
                "tokens": tokens,
                "draft_rows": {**draft, "total": sum(draft.values())},
                "dropped_steps": sum(int(v) for v in rv.dropped_steps.values()),
                "tap_errors": len(rv.errors),
            }
        )
    tokens_total = {
        k: sum(p["tokens"][k] for p in per_rank) for k in ("total", "prefill", "verify")
    }
    draft_total = {k: sum(p["draft_rows"][k] for p in per_rank) for k in (*DRAFT_TABLES, "total")}
    return {
        "path": str(trace.path),
        "schema_version": meta.get("schema_version"),
        "hstrace_version": meta.get("hstrace_version"),
        "engine": meta.get("engine", {}),
        "created": meta.get("created"),
        "host": (meta.get("host") or {}).get("hostname"),
        "command_line": meta.get("command_line", []),
        "ranks": list(trace.ranks),
        "clean_close": all(p["clean_close"] for p in per_rank) if per_rank else False,
        "steps": steps_total,
        "requests": len(req_keys),
        "request_list": request_list,
        "tokens": tokens_total,
        "draft_rows": draft_total,
        "acceptance": _acceptance(accept_lens, proposed_counts),
        "dropped_steps": {**dropped_total, "total": sum(dropped_total.values())},
        "tap_errors": errors,
        "per_rank": per_rank,
    }


def _request_metadata(t: TableView | None, rank: int) -> list[dict[str, Any]]:
    """One entry per `requests` row: the engine's request id, prompt length, prefix-cache hit
    and, where the engine recorded them, its resolved sampling parameters."""
    if t is None or not t.num_steps:
        return []
    req_cols = t.columns.get("req", [])
    rid_bytes = np.asarray(t.column("rid", "bytes")).astype(np.uint8).tobytes()
    rid_len = np.asarray(t.column("req", "rid_len")).astype(np.int64)
    n_prompt = np.asarray(t.column("req", "n_prompt")).astype(np.int64)
    cached = _col(t, "req", "n_cached")
    sampling = {c: np.asarray(t.column("req", c)) for c in SAMPLING_COLUMNS if c in req_cols}
    out: list[dict[str, Any]] = []
    at = 0
    for i, n in enumerate(rid_len.tolist()):
        entry: dict[str, Any] = {
            "rank": rank,
            "rid": rid_bytes[at : at + n].decode("utf-8", "replace"),
            "n_prompt": int(n_prompt[i]),
            "n_cached": None if cached is None else int(cached[i]),
        }
        at += n
        if sampling:
            entry["sampling"] = {c: _sampling_value(c, v[i]) for c, v in sampling.items()}
        out.append(entry)
    return out


def _sampling_value(name: str, value: Any) -> float | int | None:
    if name in SAMPLING_FLOAT:
        return None if np.isnan(value) else float(value)
    return None if int(value) < 0 else int(value)


def _acceptance(accept_lens: list[np.ndarray], proposed: list[np.ndarray]) -> dict[str, Any]:
    al = np.concatenate(accept_lens) if accept_lens else np.zeros(0, np.int64)
    out: dict[str, Any] = {"convention": ACCEPT_CONVENTION, "verify_rows": int(al.size)}
    if al.size == 0:
        return out | {
            "mean_accept_len": None,
            "mean_accept_len_incl_bonus": None,
            "histogram": {},
            "rate_by_position": [],
            "by_position": [],
            "by_position_conventions": dict(acc.CONVENTIONS),
        }
    values, counts = np.unique(al, return_counts=True)
    prop = np.concatenate(proposed)
    if al.min() < 0 or (prop.size and prop.min() < -1):
        raise TraceError(f"verify: accept_len {int(al.min())} / n_proposed are negative (corrupt)")
    # Both conventions of acceptance by position come from acceptance_by_position.py, the one
    # count every output uses. The reader has checked n_proposed against the proposed rows, so
    # the depth is bounded by the data.
    depth = acc.depth_of(al, prop)
    if depth > MAX_DEPTH:
        raise TraceError(
            f"verify: accept_len / n_proposed up to {depth}, more than {MAX_DEPTH} draft "
            "positions (corrupt)"
        )
    positions = acc.by_position(al, prop, depth)
    mean = float(al.mean())
    return out | {
        "mean_accept_len": round(mean, 6),
        "mean_accept_len_incl_bonus": round(mean + 1.0, 6),
        "histogram": {str(int(v)): int(c) for v, c in zip(values, counts, strict=True)},
        "rate_by_position": [p.to_json()[acc.OF_OFFERED] for p in positions],
        "by_position": [p.to_json() for p in positions],
        "by_position_conventions": dict(acc.CONVENTIONS),
    }
