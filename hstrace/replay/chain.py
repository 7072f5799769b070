"""Replay of the recorded draft chains (steps k >= 1, the `draft_step` table).

Step 0 does not depend on what the drafter feeds back to itself, so a fed-back-state mismatch
(speculators/vLLM `norm_output` = `feed_normed`: step k gets norm(h) instead of h) passes every
step-0 check. Here each recorded chain is rerun through the reference drafter from the same
recorded draft-extend inputs, feeding at step k the token the engine fed, and the reference's
step-k argmax is compared with the engine's recorded step-k top-1.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

# Chains replayed per trace at most: each costs one step-0 forward over its committed rows.
MAX_CHAINS = 256


def chain_agreement(
    model: torch.nn.Module,
    requests: list[Any],
    prefix_of: Callable[[Any], Any] | None = None,
) -> list[dict[str, float | int]]:
    """[{draft_step, rows, top1_agreement, max_logit_diff}] over the chains of `requests`
    (`hstrace.replay.serving.ServingRequest` with draft rows and hidden inputs). `prefix_of(r)`
    gives a prefix-cache hit's cached span as a `Step0Input` (None: no cached span)."""
    from hstrace.reference.step0 import Step0Input
    from hstrace.replay.compare import logprob_gap

    hits: dict[int, int] = defaultdict(int)
    diff: dict[int, float] = defaultdict(float)
    total: dict[int, int] = defaultdict(int)
    done = 0
    for r in requests:
        d = r.draft
        if d is None or d.hidden_in is None:
            continue
        for chain in r.chains:
            if done >= MAX_CHAINS:
                break
            T = min(int(chain.rows), len(d.input_ids))
            ks = chain.step_index.tolist()
            if T <= 0 or ks != list(range(1, len(ks) + 1)):
                continue  # a chain recorded with gaps cannot be rerun step by step
            item = Step0Input(
                torch.as_tensor(d.input_ids[:T]).long(),
                d.hidden_in[:T].float(),
                torch.as_tensor(d.positions[:T]).long(),
                prefix=prefix_of(r) if prefix_of is not None and r.aux_start else None,
            )
            if r.aux_start and item.prefix is None:
                continue  # a cache hit whose cached span cannot be rebuilt
            done += 1
            item = item.with_prefix()
            out = model(item.input_ids, item.aux.float(), positions=item.positions)
            for j, k in enumerate(ks):
                fed = torch.full((len(item.input_ids),), int(chain.input_ids[j]), dtype=torch.long)
                out = model.step(fed, out.hidden, out.cache)
                engine_ids = torch.as_tensor(chain.topk_draft_ids[j]).long()
                if int(engine_ids[0]) < 0:
                    continue  # no draft recorded at this step: nothing to compare
                hits[k] += int(int(out.logits[-1].argmax()) == int(engine_ids[0]))
                if chain.topk_logprobs is not None:
                    lps = torch.as_tensor(chain.topk_logprobs[j])[None]
                    gap = logprob_gap(out.logits[-1:], engine_ids[None], lps)
                    if gap == gap:  # NaN: log-probs not recorded, the ids alone count
                        diff[k] = max(diff[k], gap)
                total[k] += 1
    return [
        {
            "draft_step": k,
            "rows": total[k],
            "top1_agreement": round(hits[k] / total[k], 6),
            "max_logit_diff": round(diff[k], 6),
        }
        for k in sorted(total)
    ]


def pooled(by_step: list[dict[str, float | int]]) -> float | None:
    rows = sum(int(p["rows"]) for p in by_step)
    if not rows:
        return None
    return sum(float(p["top1_agreement"]) * int(p["rows"]) for p in by_step) / rows
