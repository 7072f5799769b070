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
    sums = ChainSums()
    has_prefix = (lambda r: prefix_of(r) is not None) if prefix_of is not None else None
    for r, chain in chosen_chains(requests, has_prefix):
        sums.run(model, r, chain, prefix_of)
    return sums.result()


def chosen_chains(
    requests: list[Any], has_prefix: Callable[[Any], bool] | None = None
) -> list[tuple[Any, Any]]:
    """The (request, chain) pairs replayed, at most MAX_CHAINS, in request order, decided from
    the narrow columns alone (a request's hidden input is read only when its chains run)."""
    out: list[tuple[Any, Any]] = []
    for r in requests:
        d = r.draft
        if d is None or not d.has_hidden:
            continue
        for chain in r.chains:
            if len(out) >= MAX_CHAINS:
                return out
            T = min(int(chain.rows), len(d.input_ids))
            ks = chain.step_index.tolist()
            if T <= 0 or ks != list(range(1, len(ks) + 1)):
                continue  # a chain recorded with gaps cannot be rerun step by step
            if r.aux_start and (has_prefix is None or not has_prefix(r)):
                continue  # a cache hit whose cached span cannot be rebuilt
            out.append((r, chain))
    return out


class ChainSums:
    """Per draft step: argmax hits, rows compared, max log-prob gap; chains added in any order
    give the same result (sums and maxima)."""

    def __init__(self) -> None:
        self.hits: dict[int, int] = defaultdict(int)
        self.diff: dict[int, float] = defaultdict(float)
        self.total: dict[int, int] = defaultdict(int)

    def run(
        self,
        model: torch.nn.Module,
        r: Any,
        chain: Any,
        prefix_of: Callable[[Any], Any] | None,
    ) -> None:
        """Rerun one chain from its recorded draft-extend inputs (r's hidden input: hold it)."""
        from hstrace.reference.step0 import Step0Input
        from hstrace.replay.compare import logprob_gap

        d = r.draft
        T = min(int(chain.rows), len(d.input_ids))
        item = Step0Input(
            torch.as_tensor(d.input_ids[:T]).long(),
            d.hidden_in[:T].float(),
            torch.as_tensor(d.positions[:T]).long(),
            prefix=prefix_of(r) if prefix_of is not None and r.aux_start else None,
        )
        item = item.with_prefix()
        out = model(item.input_ids, item.aux.float(), positions=item.positions)
        for j, k in enumerate(chain.step_index.tolist()):
            fed = torch.full((len(item.input_ids),), int(chain.input_ids[j]), dtype=torch.long)
            out = model.step(fed, out.hidden, out.cache)
            engine_ids = torch.as_tensor(chain.topk_draft_ids[j]).long()
            if int(engine_ids[0]) < 0:
                continue  # no draft recorded at this step: nothing to compare
            self.hits[k] += int(int(out.logits[-1].argmax()) == int(engine_ids[0]))
            if chain.topk_logprobs is not None:
                lps = torch.as_tensor(chain.topk_logprobs[j])[None]
                gap = logprob_gap(out.logits[-1:], engine_ids[None], lps)
                if gap == gap:  # NaN: log-probs not recorded, the ids alone count
                    self.diff[k] = max(self.diff[k], gap)
            self.total[k] += 1

    def result(self) -> list[dict[str, float | int]]:
        return [
            {
                "draft_step": k,
                "rows": self.total[k],
                "top1_agreement": round(self.hits[k] / self.total[k], 6),
                "max_logit_diff": round(self.diff[k], 6),
            }
            for k in sorted(self.total)
        ]


def pooled(by_step: list[dict[str, float | int]]) -> float | None:
    rows = sum(int(p["rows"]) for p in by_step)
    if not rows:
        return None
    return sum(float(p["top1_agreement"]) * int(p["rows"]) for p in by_step) / rows
