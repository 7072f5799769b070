"""`rank-divergence`: tensor-parallel ranks that should agree do not.

Read from the rank comparison (`replay.ranks`): every rank next to rank 0 on the requests both
served. Under tensor parallelism the aux states are replicated, every rank drafts from the
gathered logits and commits the same tokens, and every rank built the same drafter; the first
place they part is named (ranks, request, step). When the diverging rank's top-1 draft id always
falls in its own shard of the draft vocab while rank 0's does not, the rank took its argmax over
its local shard (TRT-LLM PR #16440): the evidence and the fix say so.
"""

from __future__ import annotations

from typing import Any

from hstrace.findings import Finding, finding
from hstrace.replay.evidence import Evidence


def rank_divergence(ev: Evidence) -> list[Finding]:
    rc = ev.ranks
    if rc is None or not rc.diverged:
        return []
    first = rc.first()
    assert first is not None
    r = first.rank
    shard = rc.shards.get(str(r), {})
    base_shard = rc.shards.get(str(first.against), {})
    local = bool(shard.get("always_in_own_shard")) and not base_shard.get("always_in_own_shard")
    draft_first = rc.first_of(r, "draft ids")
    evidence: dict[str, Any] = {
        "ranks": [first.against, r],
        "first": first.to_json(),
        "first_draft_divergence": draft_first.to_json() if draft_first else None,
        "compared": rc.compared.get(str(r), {}),
        "vocab_shards": {str(first.against): base_shard, str(r): shard},
        "local_argmax": local,
        "divergences": [d.to_json() for d in rc.divergences[:20]],
        "coverage": rc.coverage,
    }
    where = f"request {first.request}" if first.request else "the static audit"
    step = f", step {first.step}" if first.step is not None else ""
    what = first.what
    if first.what == "load audit":
        what = f"load audit ({first.detail.get('item')})"
    summary = f"rank {r} and rank {first.against} diverge at {where}{step}: different {what}" + (
        f" (position {first.detail['position']})" if "position" in first.detail else ""
    )
    if local:
        summary += (
            f"; rank {r}'s top-1 draft id falls in its own vocab shard [{shard['start']}, "
            f"{shard['end']}) on all {shard['top1_rows']} rows (rank {first.against}: "
            f"{base_shard.get('top1_in_own_shard')}): a local argmax"
        )
        return [
            finding(
                "rank-divergence",
                summary,
                evidence,
                variant="local-argmax",
                rank=r,
                start=shard["start"],
                end=shard["end"],
            )
        ]
    if first.what == "load audit":
        items = ", ".join(
            str(d.detail.get("item")) for d in rc.divergences if d.what == "load audit"
        )
        return [
            finding("rank-divergence", summary, evidence, variant="load-audit", items=items, rank=r)
        ]
    if first.what == "aux states":
        return [finding("rank-divergence", summary, evidence, variant="states", rank=r)]
    return [finding("rank-divergence", summary, evidence)]
