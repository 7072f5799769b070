"""A third-party trace producer for the field scenarios (tests only).

What someone adding a producer (a vLLM fork, TensorRT-LLM) has: `docs/trace-format.md` and the
public `TraceWriter`. The field scenarios inject their faults here, outside the reference
engine: a clean reference trace is read back as events (one per table step, in engine order),
specific rows or requests are corrupted as a faulty engine would corrupt them, the drafter's
outputs on corrupted inputs are recomputed with the drafter (an engine computes its draft
top-k from what it fed), and the events are written again through `TraceWriter`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hstrace.trace import TraceWriter, create_trace, open_trace

TOPK = 8
STEP_COLUMNS_KEPT = ("mode", "step_index")  # seq and t_ns are the writer's to fill


@dataclass(eq=False)  # events are compared by identity (list.index / remove)
class Event:
    table: str
    axes: dict[str, dict[str, Any]]

    @property
    def keys(self) -> list[int]:
        return [int(k) for k in np.asarray(self.axes["req"]["req_key"])]

    def blocks(self) -> list[tuple[int, int, int]]:
        """(req_key, first tok row, stop) of each request block of a table with a tok axis."""
        out, start = [], 0
        for k, n in zip(self.keys, np.asarray(self.axes["req"]["n_tok"]), strict=True):
            out.append((k, start, start + int(n)))
            start += int(n)
        return out


@dataclass
class Trace:
    meta: dict[str, Any]
    events: list[Event]
    column_attrs: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)

    def of(self, table: str) -> list[Event]:
        return [e for e in self.events if e.table == table]


def read(path: Path) -> Trace:
    with open_trace(path) as tr:
        view = tr.rank(0)
        stamped = []
        attrs: dict[str, dict[str, dict[str, Any]]] = {}
        for name in view.tables:
            t = view.table(name)
            for axis, cols in t.columns.items():
                for col in cols:
                    a = {k: v for k, v in t.column_attrs(axis, col).items() if k != "hstrace_dtype"}
                    if a:
                        attrs.setdefault(name, {})[f"{axis}/{col}"] = a
            for s in range(t.num_steps):
                step = t.step(s)
                seq = int(np.asarray(step["step"]["seq"]).reshape(-1)[0])
                axes = {
                    axis: {
                        c: (v.clone() if isinstance(v, torch.Tensor) else np.array(v))
                        for c, v in cols.items()
                        if axis != "step" or c in STEP_COLUMNS_KEPT
                    }
                    for axis, cols in step.items()
                }
                axes["step"] = {
                    c: int(np.asarray(v).reshape(-1)[0]) for c, v in axes["step"].items()
                }
                if not axes["step"]:
                    del axes["step"]
                stamped.append((seq, Event(name, axes)))
        meta = copy.deepcopy(dict(tr.meta))
    stamped.sort(key=lambda x: x[0])
    return Trace(meta, [e for _s, e in stamped], attrs)


def write(
    trace: Trace, path: Path, rank: int = 0, rank_static: dict[str, Any] | None = None
) -> Path:
    """Every event through the public writer, in order (a new seq is stamped on each), as
    rank `rank` (a rank > 0 joins the trace rank 0 created, as each tensor-parallel rank of
    a server opens its own writer); `rank_static`: this rank's own static audit items."""
    meta = trace.meta
    if rank == 0:
        create_trace(
            path,
            engine=meta.get("engine") or {"name": "third-party", "version": "0"},
            command_line=meta.get("command_line") or [],
            static=meta.get("static") or {},
        )
    seen: set[str] = set()
    with TraceWriter(path, rank=rank, process=False) as w:
        if rank_static:
            w.update_static(rank_static)
        for e in trace.events:
            kwargs: dict[str, Any] = dict(e.axes)
            if e.table not in seen and e.table in trace.column_attrs:
                kwargs["column_attrs"] = trace.column_attrs[e.table]
            seen.add(e.table)
            assert w.write(e.table, **kwargs)
    return path


# -- what a faulty engine's drafter would have output ------------------------------------------
def topk_columns(model: torch.nn.Module, logits: torch.Tensor) -> dict[str, Any]:
    logits = logits.float()
    top = logits.topk(min(TOPK, logits.shape[-1]), dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    return {
        "topk_draft_ids": top.indices.numpy(),
        "topk_target_ids": model.draft_to_target(top.indices).numpy(),
        "topk_logprobs": (top.values - lse[:, None]).numpy(),
        "lse": lse.numpy(),
    }


@torch.inference_mode()
def redraft(
    trace: Trace, key: int, model: torch.nn.Module, shard: tuple[int, int] | None = None
) -> None:
    """Recompute one request's draft-extend top-k from its recorded (possibly corrupted) draft
    inputs: the request's rows in position order form one sequence (the reference engine
    records each committed position once), the drafter runs over it, each row gets its own
    logits back. `shard` = (start, end): the top-k is taken over those draft ids only, as a
    tensor-parallel rank that skips the gather takes it over its own vocab shard."""
    rows = []  # (event, first, stop)
    for e in trace.of("draft_extend"):
        for k, a, b in e.blocks():
            if k == key:
                rows.append((e, a, b))
    tok = {
        name: np.concatenate([np.asarray(e.axes["tok"][name][a:b]) for e, a, b in rows])
        for name in ("input_ids", "positions")
    }
    hidden = torch.cat([e.axes["tok"]["hidden_in"][a:b] for e, a, b in rows])
    order = np.argsort(tok["positions"], kind="stable")
    assert (np.diff(tok["positions"][order]) == 1).all(), "one row per position expected"
    out = model(
        torch.as_tensor(tok["input_ids"][order]).long()[None],
        hidden[order].float()[None],
        positions=torch.as_tensor(tok["positions"][order]).long()[None],
    )
    logits = torch.empty_like(out.logits[0])
    logits[torch.as_tensor(order)] = out.logits[0]
    if shard is not None:  # a local argmax: the other ranks' rows never gathered
        outside = torch.ones(logits.shape[-1], dtype=torch.bool)
        outside[shard[0] : shard[1]] = False
        logits[:, outside] = float("-inf")
    cols = topk_columns(model, logits)
    start = 0
    for e, a, b in rows:
        for name, value in cols.items():
            if name in e.axes["tok"]:
                e.axes["tok"][name][a:b] = value[start : start + (b - a)]
        start += b - a


def request_rows(trace: Trace, table: str, key: int) -> list[tuple[Event, int, int]]:
    return [(e, a, b) for e in trace.of(table) for k, a, b in e.blocks() if k == key]


def merge_steps(first: Event, second: Event) -> Event:
    """One batched step out of two single-request steps of the same table (the second's
    request rides in the first's batch)."""
    assert first.table == second.table
    axes: dict[str, dict[str, Any]] = {}
    for axis, cols in first.axes.items():
        if axis == "step":
            axes[axis] = dict(cols)
            continue
        axes[axis] = {}
        for c, v in cols.items():
            w = second.axes[axis][c]
            axes[axis][c] = (
                torch.cat([v, w]) if isinstance(v, torch.Tensor) else np.concatenate([v, w])
            )
    return Event(first.table, axes)
