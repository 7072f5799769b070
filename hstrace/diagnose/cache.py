"""Stage `draft-logits`: `draft-kv-stale`, the drafter's KV after a prefix-cache hit.

With prefix caching (SGLang's radix cache, vLLM's prefix caching, HiCache load-back, PD
transfer) a request whose prompt prefix is cached is prefilled only for its suffix, and the
drafter attends over KV for the cached span that an earlier request wrote. When that KV is
stale, zero or foreign, the drafter's logits on the cache-hit request are wrong while fresh
requests are fine. The reference rebuilds the cached span's draft KV from recorded captures
(`DrafterRunner.cached_aux`), so engine-vs-reference agreement is split by cache hit / miss:
fresh requests agree, cache hits do not, is the signature. A what-if reruns the cache hits with
the cached span's states zeroed, which names a never-restored cache when it reproduces them.
"""

from __future__ import annotations

from typing import Any

from hstrace.engines.registry import prefix_cache_off
from hstrace.findings import Finding, finding
from hstrace.replay.compare import AGREE_TOP1
from hstrace.replay.evidence import Evidence


def draft_kv_stale(ev: Evidence) -> list[Finding]:
    cache = ev.agreement.cache  # engine vs reference split by cache hit (`replay.agreement`)
    if cache is None:
        return []
    split = cache.split
    if split["cache_hit"] is None or split["cache_hit"]["agrees"]:
        return []
    hit, fresh = split["cache_hit"], split["fresh"]
    zeroed = cache.zeroed_span_top1
    if fresh is None:
        # No fresh request to compare with: only a reproduction by a zeroed cached span is
        # evidence enough (otherwise the fault need not be about the cache at all).
        if zeroed is None or zeroed < AGREE_TOP1:
            return []
    elif not fresh["agrees"]:
        return []  # fresh requests disagree as well: not a cache question
    engine = str((ev.serving.meta.get("engine") or {}).get("name", ""))
    check = prefix_cache_off(engine)  # the recording engine's flag, else every engine's
    evidence: dict[str, Any] = {
        "cache_hit": hit,
        "fresh": fresh,
        "tolerance": split["tolerance"],
        "cache_hit_requests": (cache.per_request or [])[:10],
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
    return [finding("draft-kv-stale", summary, evidence, confirm=check)]
