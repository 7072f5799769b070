"""Stage compare: every rank of a multi-rank trace next to rank 0 (entry `build_ranks`).

Under tensor parallelism every rank runs the same requests through the same steps: the target's
aux hidden states are all-reduced (replicated: the same values on every rank), every rank's
drafter gets the same inputs and, with a full-vocab argmax, drafts the same ids, and the
rejection sampler commits the same tokens. So rank r is compared with rank 0 request by
request (the requests both ranks served; with data parallelism each rank serves its own and
nothing is shared):

- aux states, row by row at the same sequence index: equal within bf16 (|a - b| <= 2^-7
  (|a| + rms of the row), one bf16 step at the value's magnitude), else the first row is named;
- draft top-k ids, extend rows by position and chain rows by round and draft step;
- accepted lengths per verify round and the committed tokens;
- the static load audits (what each rank loaded, whether its drafter shares the target's
  embedding and head, its d2t, norm flags, capture layers, checkpoint hashes).

For every rank, the evidence also says how often its top-1 draft id (draft-extend rows, draft
step 0) falls in its own shard of the draft vocab (the rank's `lm_head` rows, `static.tp.lm_head` when recorded, else an even
split): a rank whose top-1 always does while rank 0's does not takes its argmax over its local
shard instead of the gathered logits (TRT-LLM PR #16440).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hstrace.replay.read import ServingData, ServingRequest
from hstrace.replay.unavailable import Unavailable

# The static audit items that must be the same on every rank (the drafter each rank built).
REPLICATED_STATIC = (
    "weights",
    "embed_head",
    "d2t",
    "norm_flags",
    "capture",
    "aux_layer_ids",
    "draft_config_served",
    "draft_class",
    "checkpoint_sha256",
    "spec",
)
BF16_STEP = 2.0**-7  # one bf16 step relative to the value (8 significant bits)
KEEP = 10  # divergences kept per rank and kind (the first ones, by step)


@dataclass(frozen=True)
class RankDivergence:
    """One place where rank `rank` differs from rank `against` (rank 0)."""

    rank: int
    against: int
    what: str  # "draft ids", "aux states", "accepted tokens", "committed tokens", "load audit"
    request: str | None = None
    step: int | None = None  # the table step on rank `against` (draft_extend / target / verify)
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "against": self.against, "what": self.what}
        if self.request is not None:
            out["request"] = self.request
        if self.step is not None:
            out["step"] = self.step
        out.update(self.detail)
        return out


KINDS = ("load audit", "aux states", "draft ids", "accepted tokens", "committed tokens")


def _order(d: RankDivergence) -> tuple[int, bool, int]:
    return (KINDS.index(d.what), d.step is None, d.step or 0)


@dataclass(frozen=True)
class RankComparison:
    ranks: tuple[int, ...]
    coverage: dict[str, dict[str, Any]]  # per rank: steps, requests, rows
    compared: dict[str, dict[str, Any]]  # per rank r > 0: what was compared with rank 0
    shards: dict[str, dict[str, Any]]  # per rank: its draft-vocab shard and its top-1 in it
    divergences: list[RankDivergence] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        return bool(self.divergences)

    def first(self, rank: int | None = None) -> RankDivergence | None:
        """The first divergence (of `rank`) in dataflow order (load audit, aux states, draft
        ids, accepted tokens, committed tokens), the earliest step first within a kind."""
        mine = [d for d in self.divergences if rank is None or d.rank == rank]
        return min(mine, key=_order) if mine else None

    def first_of(self, rank: int, what: str) -> RankDivergence | None:
        mine = [d for d in self.divergences if d.rank == rank and d.what == what]
        return min(mine, key=_order) if mine else None

    def to_json(self) -> dict[str, Any]:
        return {
            "ranks": list(self.ranks),
            "coverage": self.coverage,
            "compared": self.compared,
            "vocab_shards": self.shards,
            "divergences": [d.to_json() for d in self.divergences],
        }


def _coverage(rank: int, data: ServingData, view: Any) -> dict[str, Any]:
    steps = {}
    for name in getattr(view, "tables", []) or []:
        t = view.table(name)
        steps[name] = int(t.num_steps) if t is not None else 0
    return {
        "steps": steps,
        "requests": len(data.requests),
        "aux_rows": sum(r.aux_rows for r in data.requests),
        "draft_rows": sum(len(r.draft.positions) for r in data.requests if r.draft is not None),
        "chain_rows": sum(len(c.step_index) for r in data.requests for c in r.chains),
        "verify_rows": sum(len(v) for v in data.accept_by_key.values()),
        "clean_close": bool(getattr(view, "clean_close", True)),
    }


def _top1(t: torch.Tensor | np.ndarray | None) -> np.ndarray:
    if t is None:
        return np.zeros(0, np.int64)
    a = t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    return a.reshape(len(a), -1)[:, 0].astype(np.int64) if len(a) else np.zeros(0, np.int64)


def _ids(t: torch.Tensor | np.ndarray | None) -> np.ndarray | None:
    if t is None:
        return None
    a = t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    return a.reshape(len(a), -1).astype(np.int64)


def vocab_shard(static: dict[str, Any], rank: int, size: int, draft_vocab: int | None) -> dict:
    """Rank `rank`'s rows of the drafter's head: as the rank recorded them (`static.tp.lm_head`),
    else an even split of the draft vocab over `size` ranks (vLLM's VocabParallelEmbedding
    without padding)."""
    head = ((static.get("tp") or {}).get("lm_head")) or {}
    if isinstance(head.get("vocab_start"), int) and isinstance(head.get("vocab_end"), int):
        return {"start": head["vocab_start"], "end": head["vocab_end"], "from": "static.tp.lm_head"}
    if not draft_vocab or size < 1:
        return {}
    per = -(-draft_vocab // size)
    return {
        "start": min(rank * per, draft_vocab),
        "end": min((rank + 1) * per, draft_vocab),
        "from": f"even split of the draft vocab ({draft_vocab}) over {size} ranks (not recorded)",
    }


def _in_shard(data: ServingData, shard: dict) -> dict[str, Any]:
    # the draft-extend rows (draft step 0, one per committed position)
    top1 = [_top1(r.draft.topk_draft_ids) for r in data.requests if r.draft is not None]
    ids = np.concatenate(top1) if top1 else np.zeros(0, np.int64)
    if not len(ids) or not shard:
        return {**shard, "top1_rows": int(len(ids))}
    inside = (ids >= shard["start"]) & (ids < shard["end"])
    return {
        **shard,
        "top1_rows": int(len(ids)),
        "top1_in_own_shard": round(float(inside.mean()), 4),
        "always_in_own_shard": bool(inside.all()),
    }


def _aux_compare(
    r: int, name: str, a: ServingRequest, b: ServingRequest, out: dict, divs: list
) -> None:
    if not (a.has_aux and b.has_aux):
        return
    lo, hi = max(a.aux_start, b.aux_start), min(a.aux_end, b.aux_end)
    if hi <= lo:
        return
    xa = a.aux_head(hi - a.aux_start)[lo - a.aux_start :].float()
    xb = b.aux_head(hi - b.aux_start)[lo - b.aux_start :].float()
    if xa.shape != xb.shape:
        divs.append(
            RankDivergence(
                r, 0, "aux states", name, None, {"shapes": [list(xa.shape), list(xb.shape)]}
            )
        )
        return
    diff = (xa - xb).abs()
    rms = xa.pow(2).mean(-1, keepdim=True).sqrt()
    tol = BF16_STEP * (xa.abs() + rms)
    bad_rows = (diff > tol).any(-1).nonzero().flatten()
    out["requests"] += 1
    out["rows"] += int(len(xa))
    out["max_abs_diff"] = max(out["max_abs_diff"], float(diff.max()) if diff.numel() else 0.0)
    if len(bad_rows):
        i = int(bad_rows[0])
        steps = a.aux_steps
        divs.append(
            RankDivergence(
                r,
                0,
                "aux states",
                name,
                int(steps[lo - a.aux_start + i]) if len(steps) > lo - a.aux_start + i else None,
                {
                    "position": a.position_base + lo + i,
                    "rows_beyond_bf16": int(len(bad_rows)),
                    "max_abs_diff": round(float(diff[i].max()), 6),
                },
            )
        )


def _draft_compare(
    r: int, name: str, a: ServingRequest, b: ServingRequest, out: dict, divs: list
) -> None:
    if a.draft is not None and b.draft is not None:
        ia, ib = _ids(a.draft.topk_draft_ids), _ids(b.draft.topk_draft_ids)
        if ia is not None and ib is not None:
            at = {int(p): i for i, p in enumerate(a.draft.positions)}
            for j, p in enumerate(b.draft.positions):
                i = at.get(int(p))
                if i is None:
                    continue
                k = min(ia.shape[1], ib.shape[1])
                same1 = ia[i, 0] == ib[j, 0]
                out["rows"] += 1
                out["top1_equal"] += int(same1)
                out["topk_equal"] += int((ia[i, :k] == ib[j, :k]).all())
                if not same1:
                    divs.append(
                        RankDivergence(
                            r,
                            0,
                            "draft ids",
                            name,
                            int(a.draft.steps[i]) if len(a.draft.steps) > i else None,
                            {
                                "position": int(p),
                                "draft_step": 0,
                                "top1": {"0": int(ia[i, 0]), str(r): int(ib[j, 0])},
                            },
                        )
                    )
    for n, (ca, cb) in enumerate(zip(a.chains, b.chains, strict=False)):
        ta, tb = _top1(ca.topk_draft_ids), _top1(cb.topk_draft_ids)
        m = min(len(ta), len(tb))
        out["chain_rows"] += m
        out["chain_top1_equal"] += int((ta[:m] == tb[:m]).sum())
        bad = np.nonzero(ta[:m] != tb[:m])[0]
        if len(bad):
            i = int(bad[0])
            divs.append(
                RankDivergence(
                    r,
                    0,
                    "draft ids",
                    name,
                    None,
                    {
                        "round": n,
                        "draft_step": int(ca.step_index[i]),
                        "top1": {"0": int(ta[i]), str(r): int(tb[i])},
                    },
                )
            )


def _accept_compare(
    r: int, name: str, a: ServingRequest, b: ServingRequest, acc: tuple, out: dict, divs: list
) -> None:
    la, lb = acc
    m = min(len(la), len(lb))
    out["verify_rounds"] += m
    bad = [i for i in range(m) if la[i] != lb[i]]
    if bad or len(la) != len(lb):
        i = bad[0] if bad else m
        divs.append(
            RankDivergence(
                r,
                0,
                "accepted tokens",
                name,
                None,
                {
                    "round": i,
                    "accept_len": {
                        "0": la[i] if i < len(la) else None,
                        str(r): lb[i] if i < len(lb) else None,
                    },
                },
            )
        )
    n = min(len(a.tokens), len(b.tokens))
    out["committed_tokens"] += n
    diff = np.nonzero(a.tokens[:n] != b.tokens[:n])[0]
    if len(diff) or len(a.tokens) != len(b.tokens):
        i = int(diff[0]) if len(diff) else n
        divs.append(
            RankDivergence(
                r,
                0,
                "committed tokens",
                name,
                None,
                {"position": a.position_base + i, "lengths": [len(a.tokens), len(b.tokens)]},
            )
        )


def _static_compare(r: int, s0: dict, sr: dict, out: dict, divs: list) -> None:
    # an item one rank did not record is not a difference of the drafters: said, not judged
    keys = [k for k in REPLICATED_STATIC if k in s0 and k in sr]
    out["load_audit_items"] = keys
    one_sided = {k: (0 if k in s0 else r) for k in REPLICATED_STATIC if (k in s0) != (k in sr)}
    if one_sided:
        out["recorded_on_one_rank_only"] = one_sided
    differ = [k for k in keys if s0.get(k) != sr.get(k)]
    for k in differ:
        a, b = s0.get(k), sr.get(k)
        detail: dict[str, Any] = {"item": k}
        if isinstance(a, dict) and isinstance(b, dict):
            sub = sorted(x for x in set(a) | set(b) if a.get(x) != b.get(x))
            detail["differs_at"] = sub[:10]
            detail["values"] = {x: {"0": a.get(x), str(r): b.get(x)} for x in sub[:3]}
        else:
            detail["values"] = {"0": a, str(r): b}
        divs.append(RankDivergence(r, 0, "load audit", None, None, detail))


def build_ranks(
    by_rank: dict[int, ServingData],
    views: dict[int, Any],
    draft_vocab: int | None,
) -> RankComparison | None:
    """Every rank next to rank 0 (None: a single-rank trace). `views`: each rank's trace view
    (its tables' steps, its own static audit)."""
    if len(by_rank) < 2:
        return None
    ranks = tuple(sorted(by_rank))
    base_rank = ranks[0]
    base = by_rank[base_rank]
    static = {r: dict(getattr(views[r], "static", None) or {}) for r in ranks}
    size = max(
        [len(ranks)]
        + [int((static[r].get("tp") or {}).get("size") or 0) for r in ranks if static[r].get("tp")]
    )
    notes = Unavailable()
    coverage = {str(r): _coverage(r, by_rank[r], views[r]) for r in ranks}
    shards = {
        str(r): _in_shard(by_rank[r], vocab_shard(static[r], r, size, draft_vocab)) for r in ranks
    }
    compared: dict[str, dict[str, Any]] = {}
    divs: list[RankDivergence] = []
    keyed = base.by_key()
    for r in ranks[1:]:
        data = by_rank[r]
        aux = {"requests": 0, "rows": 0, "max_abs_diff": 0.0}
        draft = {
            "rows": 0,
            "top1_equal": 0,
            "topk_equal": 0,
            "chain_rows": 0,
            "chain_top1_equal": 0,
        }
        acc = {"verify_rounds": 0, "committed_tokens": 0}
        stat: dict[str, Any] = {}
        mine: list[RankDivergence] = []
        shared = [(keyed[q.key], q) for q in data.requests if q.key in keyed]
        for a, b in shared:
            name = a.name
            with base.holding([a], kinds=("aux",)), data.holding([b], kinds=("aux",)):
                _aux_compare(r, name, a, b, aux, mine)
            _draft_compare(r, name, a, b, draft, mine)
            lens = (base.accept_by_key.get(a.key, []), data.accept_by_key.get(b.key, []))
            _accept_compare(r, name, a, b, lens, acc, mine)
        _static_compare(r, static[base_rank], static[r], stat, mine)
        aux["within_bf16"] = not any(d.what == "aux states" for d in mine)
        aux["max_abs_diff"] = round(aux["max_abs_diff"], 6)
        compared[str(r)] = {
            "against": base_rank,
            "requests_shared": len(shared),
            "requests_only_here": len(data.requests) - len(shared),
            "aux": aux,
            "draft": draft,
            "acceptance": acc,
            "load_audit": stat,
        }
        if not shared:
            notes.note(
                f"rank {r} vs rank {base_rank}",
                "no request served on both ranks (data parallel): only the load audits compared",
            )
        # the first divergences of each kind, earliest step first
        for what in KINDS:
            divs.extend(sorted((d for d in mine if d.what == what), key=_order)[:KEEP])
    return RankComparison(
        ranks=ranks,
        coverage=coverage,
        compared=compared,
        shards=shards,
        divergences=divs,
        unavailable=notes.frozen(),
    )
