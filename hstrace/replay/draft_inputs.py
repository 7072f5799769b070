"""Evidence `DraftInputs`: what the drafter was fed next to the aux states.

- the token pairing: agreement of the fed token ids with the committed token t+1+shift for
  shift -1, 0, +1 (EAGLE-3 pairs aux row t with token t+1);
- the position offsets: recorded draft position minus the row's sequence index;
- the chunked-prefill seams: at the last row of every non-final prefill chunk the drafter must
  get the next chunk's first prompt token (one target step per chunk in the trace), the rows
  where it got another one, and whether that is the target's own prediction there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hstrace.reference.target import ReferenceTarget
from hstrace.replay.compare import agreement
from hstrace.replay.serving import ServingData, ServingRequest
from hstrace.replay.unavailable import Unavailable


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
