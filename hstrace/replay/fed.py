"""Stage compare, what the drafter was fed: `build_draft_inputs` (token pairing, positions,
chunk seams), `build_vocab_readings` (how draft ids became target ids), `build_batch_coupling`
(rows of another request of the batch).

Evidence `DraftInputs`: what the drafter was fed next to the aux states.

- the token pairing: agreement of the fed token ids with the committed token t+1+shift for
  shift -1, 0, +1 (EAGLE-3 pairs aux row t with token t+1);
- the position offsets: recorded draft position minus the row's sequence index;
- the chunked-prefill seams: at the last row of every non-final prefill chunk the drafter must
  get the next chunk's first prompt token (one target step per chunk in the trace), the rows
  where it got another one, and whether that is the target's own prediction there.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hstrace.drafter.vocab import D2T_READINGS, map_draft_ids
from hstrace.reference.target import ReferenceTarget
from hstrace.replay.align import Alignment
from hstrace.replay.compare import agreement, with_topk
from hstrace.replay.read import ServingData, ServingRequest
from hstrace.replay.unavailable import Unavailable


# -- draft_inputs ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Seams:
    rows: int  # seam rows seen
    wrong: list[dict[str, Any]]  # seam rows fed another token than the next prompt token
    other_ok: int  # rows outside the seams paired right
    other_total: int


@dataclass(frozen=True)
class DraftInputs:
    token_agreement_by_shift: dict[int, float] | None  # None: no draft rows
    position_offsets: list[int]  # distinct (position - index) over the draft rows
    seams: Seams
    unavailable: dict[str, str] = field(default_factory=dict)

    @property
    def by_shift_json(self) -> dict[str, float] | None:
        if self.token_agreement_by_shift is None:
            return None
        return {f"{k:+d}": round(v, 6) for k, v in self.token_agreement_by_shift.items()}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.token_agreement_by_shift is not None:
            out["draft_input_token_agreement"] = self.by_shift_json
        if len(self.position_offsets) == 1 and self.position_offsets[0] != 0:
            out["draft_position_base"] = int(self.position_offsets[0])
        if self.seams.rows:
            out["chunk_seams"] = {"rows": self.seams.rows, "wrong": len(self.seams.wrong)}
        return out


def build_draft_inputs(
    serving: ServingData,
    rows: Any,  # hstrace.replay.agreement.EngineRows | None
    requests: list[ServingRequest],
    target: ReferenceTarget | None,
) -> DraftInputs:
    u = Unavailable()
    scores, offsets = None, []
    if rows is not None:
        scores = u.guarded("token pairing", lambda: _pairing(rows, requests))
        offsets = np.unique((rows.positions - rows.index).numpy()).tolist()
    seams = u.guarded("chunked-prefill seams", lambda: _seams(serving, target))
    return DraftInputs(scores, offsets, seams or Seams(0, [], 0, 0), u.frozen())


def _pairing(rows: Any, requests: list[ServingRequest]) -> dict[int, float]:
    fed = torch.cat([torch.as_tensor(it.input_ids).long() for it in rows.items])
    scores = {}
    for shift in (-1, 0, 1):
        expected = []
        for req in requests:
            tok = torch.as_tensor(req.tokens).long()
            idx = torch.as_tensor(req.draft.index) + 1 + shift
            exp = torch.full((len(idx),), -1, dtype=torch.long)
            ok = (idx >= 0) & (idx < len(tok))
            exp[ok] = tok[idx[ok]]
            expected.append(exp)
        exp = torch.cat(expected)
        known = exp >= 0
        scores[shift] = agreement(fed[known], exp[known]) if known.any() else 0.0
    return scores


def _seams(serving: ServingData, target: ReferenceTarget | None) -> Seams:
    seams_seen, wrong, other_ok, other_total = 0, [], 0, 0
    for r in serving.requests:
        d = r.draft
        if d is None or len(r.prefill_chunks) < 2:
            continue
        seams = set(r.seams)
        idx = np.asarray(d.index)
        fed = np.asarray(d.input_ids)
        ok = idx + 1 < len(r.tokens)
        expected = np.full(len(idx), -1, dtype=np.int64)
        expected[ok] = np.asarray(r.tokens)[idx[ok] + 1]
        at_seam = np.array([int(i) in seams for i in idx], dtype=bool) & ok
        rest = ok & ~at_seam
        other_ok += int((fed[rest] == expected[rest]).sum())
        other_total += int(rest.sum())
        seams_seen += int(at_seam.sum())
        for row in np.flatnonzero(at_seam & (fed != expected)):
            item = {
                "request": r.name,
                "position": int(idx[row]),
                "fed_token": int(fed[row]),
                "next_prompt_token": int(expected[row]),
                "chunk": next(list(c) for c in r.prefill_chunks if c[1] - 1 == int(idx[row])),
            }
            if target is not None:
                pred = target.forward(torch.as_tensor(r.tokens[: idx[row] + 1]).long())
                item["fed_is_target_prediction"] = int(pred.logits[-1].argmax()) == int(fed[row])
            wrong.append(item)
    return Seams(seams_seen, wrong, other_ok, other_total)


# -- vocab -------------------------------------------------------------------------------------
# Evidence `VocabReadings`: how the engine turned draft ids into target ids.
#
# The engine recorded both its draft-space top-k and the target ids it proposed. Applying each
# reading of `d2t` to the engine's own draft ids shows which one it used: offsets
# (`target = i + d2t[i]`, every library), a direct table (`target = d2t[i]`), or none at all.


@dataclass(frozen=True)
class VocabReadings:
    scores: dict[str, float] | None  # per reading: share of proposed target ids it explains
    draft: torch.Tensor | None = None  # [R, k] the engine's draft ids on the judged rows
    served: torch.Tensor | None = None  # [R, k] the target ids it proposed
    d2t: torch.Tensor | None = None
    unavailable: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        if self.scores is None:
            return {}
        return {
            "target_space_top1": round(self.scores["offsets"], 6),
            "vocab_readings": {k: round(v, 6) for k, v in self.scores.items()},
        }


def build_vocab_readings(drafter: Any, rows: Any) -> VocabReadings:
    """`rows`: hstrace.replay.agreement.EngineRows (or None)."""
    u = Unavailable()
    if drafter is None or rows is None or rows.topk_target_ids is None:
        u.note("vocab map", "no recorded target-space draft ids")
        return VocabReadings(None, unavailable=u.frozen())
    # Only rows where the engine drafted: SGLang writes id -1 on the rest (no draft logits).
    keep = with_topk(rows.topk_draft_ids) & (rows.topk_target_ids[:, 0].long() >= 0)
    if not keep.any():
        u.note("vocab map", "no draft row with a recorded top-k")
        return VocabReadings(None, unavailable=u.frozen())
    d2t = drafter.d2t.long()
    vocab = int(drafter.cfg.vocab_size)
    draft = rows.topk_draft_ids[keep].long().clamp(0, len(d2t) - 1)
    served = rows.topk_target_ids[keep].long()
    real = (rows.topk_draft_ids[keep].long() >= 0) & (served >= 0)  # padded entries: none
    scores = {
        name: agreement(map_draft_ids(draft, d2t, name, vocab)[real], served[real])
        for name in D2T_READINGS
    }
    return VocabReadings(scores, draft, served, d2t, u.frozen())


# -- batch -------------------------------------------------------------------------------------
# Evidence `BatchCoupling`: rows of a request that belong to another request of its batch.
#
# Decided from the trace's own batch composition (the `req` axis of each step): within one
# target step, a request's captured row that equals another co-batched request's row although
# their token prefixes differ was copied from it (a hidden state depends on every token before
# it, so two different prefixes never give the same state); within one draft-extend step, a
# request fed the other request's tokens. Beside it, the accept lengths by verify batch size
# (sglang#16274, PR #20492, TensorRT-LLM#9208: acceptance that depends on batch size or DP rank).


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
