"""Stage `draft-logits`: `draft-kv-stale`, the drafter's KV after a prefix-cache hit.

With prefix caching (SGLang's radix cache, vLLM's prefix caching, HiCache load-back, PD
transfer) a request whose prompt prefix is cached is prefilled only for its suffix, and the
drafter attends over KV for the cached span that an earlier request wrote. When that KV is
stale, zero or foreign, the drafter's logits on the cache-hit request are wrong while fresh
requests are fine. The reference rebuilds the cached span's draft KV from recorded captures
(`ReplayContext.cached_aux`), so engine-vs-reference agreement is split by cache hit / miss:
fresh requests agree, cache hits do not, is the signature. A what-if reruns the cache hits with
the cached span's states zeroed, which names a never-restored cache when it reproduces them.
"""

from __future__ import annotations

from typing import Any

import torch

from hstrace.findings import Finding
from hstrace.reference.step0 import Step0Input
from hstrace.replay.compare import (
    AGREE_TOP1,
    agreement,
    compare_topk,
    gathered_logprobs,
    logprob_gap,
    with_topk,
)

FIX = {
    "sglang": "serve once with --disable-radix-cache (and without --enable-hierarchical-cache)",
    "vllm": "serve once with --no-enable-prefix-caching",
}
UPSTREAM = (
    "known upstream fixes: sglang PR #19897 (spec-v2 draft KV uninitialised on radix hits), "
    "PR #17338 and #30393 (HiCache did not manage the draft KV), PR #11215 (HiCache) and "
    "#11231 (SWA radix cache); vllm#41838 (block hashes committed before the forward wrote the "
    "KV); TensorRT-LLM PR #5285 (last draft token's KV never written)"
)


def _split(ctx) -> dict[str, Any] | None:
    """Engine vs reference on the rows of cache-hit requests and of fresh ones, apart."""
    rows = ctx.engine_rows
    if ctx.reference_logits is None or rows is None or rows.request is None:
        return None
    reqs = ctx.engine_requests
    hit = torch.tensor([reqs[int(i)].cache_hit for i in rows.request], dtype=torch.bool)
    if not hit.any():
        return None
    keep = with_topk(rows.topk_draft_ids)
    tol = ctx.agreement.tolerance

    def part(mask: torch.Tensor) -> dict[str, Any] | None:
        m = mask & keep
        if not m.any():
            return None
        lps = rows.topk_logprobs[m] if rows.topk_logprobs is not None else None
        a = compare_topk(rows.topk_draft_ids[m], lps, ctx.reference_logits[m])
        known = a.max_logprob_diff == a.max_logprob_diff
        members = {int(i) for i in rows.request[m]}
        accepts = [x for i in members for x in ctx.serving.accept_by_key.get(reqs[i].key, [])]
        return {
            "requests": len(members),
            "mean_accept_len": round(sum(accepts) / len(accepts), 4) if accepts else None,
            "rows": a.rows,
            "top1_agreement": round(a.top1, 4),
            "max_logprob_diff": round(a.max_logprob_diff, 4) if known else None,
            "agrees": a.agrees and (not known or a.max_logprob_diff <= tol),
        }

    return {"cache_hit": part(hit), "fresh": part(~hit), "tolerance": round(tol, 6)}


def _per_request(ctx) -> list[dict[str, Any]]:
    rows = ctx.engine_rows
    keep = with_topk(rows.topk_draft_ids)
    ref = ctx.reference_logits.argmax(-1)
    out = []
    for i, r in enumerate(ctx.engine_requests):
        if not r.cache_hit:
            continue
        m = (rows.request == i) & keep
        if not m.any():
            continue
        same = ref[m] == rows.topk_draft_ids[m][:, 0].long()
        pos = rows.index[m]
        # The first row the engine's top-1 differs on, or else its log-probs do.
        off = same.clone()
        if rows.topk_logprobs is not None:
            lp = gathered_logprobs(ctx.reference_logits[m], rows.topk_draft_ids[m])
            diff = (lp - rows.topk_logprobs[m].float()).abs().nan_to_num(0.0).amax(-1)
            off = same & (diff <= ctx.agreement.tolerance)
        first = pos[~off][0].item() if (~off).any() else None
        accepts = ctx.serving.accept_by_key.get(r.key) or []
        got = ctx.cached_aux(r)
        lps = rows.topk_logprobs[m] if rows.topk_logprobs is not None else None
        gap = logprob_gap(ctx.reference_logits[m], rows.topk_draft_ids[m], lps)
        out.append(
            {
                "request": r.name,
                "n_cached": r.aux_start,
                "n_cached_recorded": r.n_cached,
                "rows": int(m.sum()),
                "top1_agreement": round(float(same.float().mean()), 4),
                "max_logprob_diff": round(gap, 4) if gap == gap else None,
                "first_disagreeing_position": first,
                "mean_accept_len": round(sum(accepts) / len(accepts), 4) if accepts else None,
                "cached_span_rebuilt_from": got[1] if got is not None else None,
            }
        )
    return out


def _zeroed_span_agreement(ctx) -> float | None:
    """Top-1 agreement with the engine on cache-hit rows when the reference's cached span is
    fed zero states (a cache that never held the drafter's KV)."""
    rows = ctx.engine_rows
    items, masks = [], []
    for i, (it, r) in enumerate(zip(rows.items, ctx.engine_requests, strict=True)):
        if not r.cache_hit or it.prefix is None:
            continue
        p = it.prefix
        items.append(
            Step0Input(
                it.input_ids,
                it.aux,
                it.positions,
                prefix=Step0Input(p.input_ids, torch.zeros_like(p.aux), p.positions),
            )
        )
        masks.append(with_topk(rows.topk_draft_ids[rows.request == i]))
    if not items:
        return None
    logits = ctx.run_drafter(ctx.drafter, items)
    engine = torch.cat(
        [
            rows.topk_draft_ids[rows.request == i][:, 0]
            for i, (it, r) in enumerate(zip(rows.items, ctx.engine_requests, strict=True))
            if r.cache_hit and it.prefix is not None
        ]
    ).long()
    m = torch.cat(masks)
    return agreement(logits.argmax(-1)[m], engine[m])


def confined_to_cache_hits(ctx) -> bool:
    """Fresh requests agree with the reference and cache hits do not (the what-if search and
    the weights fallback then stand aside: no single misreading explains one group only)."""
    split = ctx.guarded("cache hit / miss split", lambda: _split(ctx))
    if split is None:
        return False
    ctx.metrics["engine_vs_reference_by_cache"] = split
    hit, fresh = split["cache_hit"], split["fresh"]
    return hit is not None and fresh is not None and fresh["agrees"] and not hit["agrees"]


def draft_kv_stale(ctx) -> list[Finding]:
    if ctx.drafter is None or ctx.no_forward or ctx.agreement is None:
        return []
    split = ctx.metrics.get("engine_vs_reference_by_cache")
    if split is None and not confined_to_cache_hits(ctx):
        split = ctx.metrics.get("engine_vs_reference_by_cache")
    if split is None or split["cache_hit"] is None or split["cache_hit"]["agrees"]:
        return []
    hit, fresh = split["cache_hit"], split["fresh"]
    zeroed = ctx.guarded("draft-kv-stale what-if", lambda: _zeroed_span_agreement(ctx))
    if fresh is None:
        # No fresh request to compare with: only a reproduction by a zeroed cached span is
        # evidence enough (otherwise the fault need not be about the cache at all).
        if zeroed is None or zeroed < AGREE_TOP1:
            return []
    elif not fresh["agrees"]:
        return []  # fresh requests disagree as well: not a cache question
    engine = str((ctx.serving.meta.get("engine") or {}).get("name", ""))
    check = FIX.get(engine, f"{FIX['sglang']} (SGLang) or {FIX['vllm']} (vLLM)")
    evidence: dict[str, Any] = {
        "cache_hit": hit,
        "fresh": fresh,
        "tolerance": split["tolerance"],
        "cache_hit_requests": _per_request(ctx)[:10],
    }
    if zeroed is not None:
        evidence["what_if_cached_span_zero_top1"] = round(zeroed, 4)
    summary = (
        f"after prefix-cache hits the drafter attends over stale KV: on {hit['requests']} "
        f"cache-hit request(s) the engine agrees with the reference on {hit['top1_agreement']:.0%} "
        "of draft rows (the reference rebuilds the cached span's draft KV from recorded "
        "captures)"
        + (
            f", on {fresh['requests']} fresh request(s) on {fresh['top1_agreement']:.0%}"
            if fresh
            else ""
        )
        + (
            f"; a zeroed cached span reproduces the engine ({zeroed:.0%})"
            if zeroed is not None and zeroed >= AGREE_TOP1
            else ""
        )
    )
    return [
        Finding(
            "draft-kv-stale",
            summary,
            evidence=evidence,
            fix=(
                f"confirm: {check}; if the cache-hit requests' acceptance recovers, the "
                f"engine's draft KV for cached prefixes is stale: upgrade to a version with the "
                f"fix ({UPSTREAM}), or keep the prefix cache off for the drafter"
            ),
        )
    ]
