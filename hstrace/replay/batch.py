"""Evidence `BatchCoupling`: rows of a request that belong to another request of its batch.

Decided from the trace's own batch composition (the `req` axis of each step): within one
target step, a request's captured row that equals another co-batched request's row although
their token prefixes differ was copied from it (a hidden state depends on every token before
it, so two different prefixes never give the same state); within one draft-extend step, a
request fed the other request's tokens. Beside it, the accept lengths by verify batch size
(sglang#16274, PR #20492, TensorRT-LLM#9208: acceptance that depends on batch size or DP rank).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hstrace.replay.sides import Alignment
from hstrace.replay.unavailable import Unavailable


@dataclass(frozen=True)
class BatchCoupling:
    aux_rows: list[dict[str, Any]]  # a request's captured rows that are another's
    draft_inputs: list[dict[str, Any]]  # a request fed another request's tokens
    accept_len_by_verify_batch_size: dict[str, dict[str, float]]
    unavailable: dict[str, str] = field(default_factory=dict)

    @property
    def coupled(self) -> bool:
        return bool(self.aux_rows or self.draft_inputs)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if len(self.accept_len_by_verify_batch_size) > 1:
            out["accept_len_by_verify_batch_size"] = self.accept_len_by_verify_batch_size
        if self.coupled:
            out["batch_coupling"] = {
                "aux_rows": self.aux_rows[:20],
                "draft_inputs": self.draft_inputs[:20],
            }
        return out


def build_batch_coupling(al: Alignment) -> BatchCoupling:
    u = Unavailable()
    by_size = u.guarded("batch coupling", lambda: acceptance_by_batch_size(al)) or {}
    aux = u.guarded("batch coupling", lambda: coupled_aux_rows(al)) or []
    fed = u.guarded("batch coupling", lambda: coupled_draft_inputs(al)) or []
    return BatchCoupling(aux, fed, by_size, u.frozen())


# A copied row is bit-identical; bf16 rounding of the same state computed twice stays above.
COPY_COS = 0.9999
# Fed tokens: at most this share matches the request's own tokens, at least MATCH the other's.
OWN_AT_MOST = 0.5
OTHER_AT_LEAST = 0.9


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def _rows_in_step(r: Any, step: int) -> np.ndarray:
    return np.flatnonzero(np.asarray(r.aux_steps) == step)


def _same_context(a: Any, ia: int, b: Any, ib: int) -> bool:
    """The two rows' states must be equal: same position, same tokens up to it."""
    pa, pb = ia + a.aux_start, ib + b.aux_start
    return pa == pb and np.array_equal(a.tokens[: pa + 1], b.tokens[: pb + 1])


def _own_fit(al, r: Any, rows: np.ndarray) -> float | None:
    """Mean cosine of r's captured rows with the training rows of r's own tokens (None: r is
    not aligned with a training sample or widths differ). A copy leaves two requests with the
    same rows; the one whose rows fit its own tokens is the owner."""
    for a in al.aligned:
        if a.serving is not r:
            continue
        seq = rows + r.aux_start
        keep = seq < a.n
        if not keep.any():
            return None
        t = a.sample.aux[seq[keep]].float().flatten(1)
        x = r.aux[rows[keep]].float()
        if t.shape[-1] != x.shape[-1]:
            return None
        return float((_unit(x) * _unit(t)).sum(-1).mean())
    return None


# Rows of batched target steps read at a time (several steps; a step is never split).
BLOCK_ROWS = 4096


def _batched_steps(al) -> list[tuple[int, list[int], list[tuple[Any, np.ndarray]]]]:
    """(step, keys, [(request, its rows in the step)]) of every target step where at least two
    requests have captured rows: decided from the narrow columns."""
    by_key = al.serving.by_key()
    out = []
    for step, keys in enumerate(al.serving.target_batches):
        if len(set(keys)) < 2:
            continue
        reqs = [by_key[k] for k in dict.fromkeys(keys) if k in by_key and by_key[k].aux_rows]
        parts = [(r, _rows_in_step(r, step)) for r in reqs]
        parts = [(r, rows) for r, rows in parts if len(rows)]
        if len(parts) >= 2:
            out.append((step, keys, parts))
    return out


def coupled_aux_rows(al) -> list[dict[str, Any]]:
    """[{request, rows_of, step, positions, rows, ...}] for every request whose captured rows
    in a batched target step are another co-batched request's rows. One cosine matrix per
    batched step (all its rows against all its rows), so a long trace of large decode batches
    costs one small matmul per step. The rows of the batched steps are read a block of steps
    at a time (a second read of them: the first, `CaptureScan`, goes request by request)."""
    if al.sketched or al.slot_width is None:
        return []
    by_key = al.serving.by_key()
    found = []
    steps = _batched_steps(al)
    block: list[tuple[int, list[int], list[tuple[Any, np.ndarray]]]] = []
    for i, item in enumerate(steps):
        block.append(item)
        rows = sum(len(p) for _s, _k, parts in block for _r, p in parts)
        if rows < BLOCK_ROWS and i + 1 < len(steps):
            continue
        got = iter(al.serving.rows_of("aux", [p for _s, _k, parts in block for p in parts]))
        for step, keys, parts in block:
            aux = [next(got) for _ in parts]
            found.extend(_coupled_in_step(al, by_key, step, keys, parts, aux))
        block = []
    return found


def _coupled_in_step(al, by_key, step, keys, parts, aux) -> list[dict[str, Any]]:
    found = []
    owner = torch.cat([torch.full((len(rows),), i) for i, (_r, rows) in enumerate(parts)])
    x = _unit(torch.cat([a.float() for a in aux]))
    cos = x @ x.T
    cos[owner[:, None] == owner[None, :]] = -1.0  # a request's own rows do not count
    best, j = cos.max(dim=1)
    base = np.cumsum([0] + [len(rows) for _r, rows in parts])
    for i, (r, mine) in enumerate(parts):
        sel = range(int(base[i]), int(base[i + 1]))
        by_other: dict[int, list[int]] = defaultdict(list)
        for g in sel:
            if float(best[g]) < COPY_COS:
                continue
            o_i = int(owner[j[g]])
            o, theirs = parts[o_i]
            row, other_row = int(mine[g - base[i]]), int(theirs[int(j[g]) - base[o_i]])
            if not _same_context(r, row, o, other_row):
                by_other[o_i].append(row)
        if not by_other:
            continue
        o_i, copied = max(by_other.items(), key=lambda kv: len(kv[1]))
        fit = _own_fit(al, r, np.asarray(copied))
        if fit is not None and fit >= COPY_COS:
            continue  # r's rows are its own: the other request got a copy of them
        found.append(
            {
                "request": r.name,
                "rows_of": parts[o_i][0].name,
                "step": step,
                "batch": [by_key[k].name for k in keys if k in by_key],
                "positions": [c + r.aux_start + r.position_base for c in copied][:32],
                "rows": len(copied),
                "of_rows_in_step": len(mine),
                "own_tokens_cos": round(fit, 4) if fit is not None else None,
            }
        )
    return found


def coupled_draft_inputs(al) -> list[dict[str, Any]]:
    """Requests whose draft-extend rows in a batched step were fed another co-batched
    request's tokens (own tokens mostly wrong, the other's right)."""
    by_key = al.serving.by_key()
    found = []
    for step, keys in enumerate(al.serving.draft_batches):
        if len(set(keys)) < 2:
            continue
        reqs = [by_key[k] for k in dict.fromkeys(keys) if k in by_key and by_key[k].draft]
        expected: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for r in reqs:
            d = r.draft
            m = np.flatnonzero(np.asarray(d.steps) == step)
            idx = np.asarray(d.index)[m] + 1
            ok = idx < len(r.tokens)
            expected[r.key] = (np.asarray(d.input_ids)[m][ok], np.asarray(r.tokens)[idx[ok]])
        for r in reqs:
            fed, own = expected[r.key]
            if len(fed) < 2 or float((fed == own).mean()) > OWN_AT_MOST:
                continue
            for o in reqs:
                if o is r:
                    continue
                theirs = expected[o.key][1]
                n = min(len(fed), len(theirs))
                if n >= 2 and float((fed[:n] == theirs[:n]).mean()) >= OTHER_AT_LEAST:
                    found.append(
                        {
                            "request": r.name,
                            "tokens_of": o.name,
                            "step": step,
                            "rows": int(n),
                            "own_token_agreement": round(float((fed == own).mean()), 4),
                        }
                    )
                    break
    return found


def acceptance_by_batch_size(al) -> dict[str, dict[str, float]]:
    lens: dict[int, list[int]] = defaultdict(list)
    for key, accepts in al.serving.accept_by_key.items():
        sizes = al.serving.verify_batch_sizes.get(key) or []
        for a, b in zip(accepts, sizes, strict=False):
            lens[b].append(a)
    return {
        str(b): {"verify_rows": len(v), "mean_accept_len": round(sum(v) / len(v), 4)}
        for b, v in sorted(lens.items())
    }
