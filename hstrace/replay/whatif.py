"""What-if search (pure): which single misreading makes the reference do what the engine did.

Each what-if is one hypothesis about the engine (a norm flag read the other way, `d2t` read as
a direct table, aux layers shifted by one, tokens shifted by one, ...), expressed as a function
that re-runs the reference under that hypothesis and returns its draft logits on the recorded
rows. The one whose log-probs match the engine's within the fp32-judged tolerance names the
fault. The one that reproduces the engine's ids names the fault.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hstrace.replay.compare import (
    AGREE_TOP1,
    WHATIF_MARGIN,
    RefRows,
    agreement,
    gap_at,
    with_topk,
)


@dataclass(frozen=True)
class WhatIf:
    name: str  # e.g. "norm_before_residual=False"
    code: str  # the finding code it would confirm
    fix: str
    run: Callable[[], torch.Tensor]  # draft logits [R, Vd] under the hypothesis, same rows


@dataclass(frozen=True)
class WhatIfResult:
    name: str
    code: str
    fix: str
    agreement: float  # top-1 agreement with the engine
    max_logprob_diff: float  # at the engine's top-k ids (NaN when it recorded no log-probs)

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "code": self.code,
            "agreement": round(self.agreement, 6),
            "max_logprob_diff": (
                round(self.max_logprob_diff, 6)
                if self.max_logprob_diff == self.max_logprob_diff
                else None
            ),
        }


def search(
    whatifs: Sequence[WhatIf],
    engine_ids: torch.Tensor,
    engine_logprobs: torch.Tensor | None = None,
) -> list[WhatIfResult]:
    """Every hypothesis scored against the engine's recorded top-k, best first (smallest
    log-prob difference, then highest argmax agreement). Rows without a top-k (id -1) are not
    scored; NaN log-probs are unknown (those rows count by their ids only)."""
    results = []
    for w in whatifs:
        try:
            logits = w.run()
        except (ValueError, RuntimeError, IndexError):
            # A hypothesis that cannot even run on this drafter (e.g. mutually exclusive
            # flags) cannot be what the engine did.
            continue
        ref = RefRows.of(logits, engine_ids, topk=False)
        results.append(score(w.name, w.code, w.fix, ref, engine_ids, engine_logprobs))
    return ranked(results)


def score(
    name: str,
    code: str,
    fix: str,
    ref: RefRows,
    engine_ids: torch.Tensor,
    engine_logprobs: torch.Tensor | None = None,
) -> WhatIfResult:
    """One hypothesis's reference rows (`RefRows`, every recorded row) against the engine's
    top-k, on the rows where the engine recorded one."""
    keep = with_topk(engine_ids)
    ids = engine_ids[keep]
    lps = engine_logprobs[keep] if engine_logprobs is not None else None
    top1 = agreement(ref.argmax[keep], ids[:, 0])
    diff = gap_at(ref.logprobs[keep], ids, lps) if lps is not None else float("nan")
    return WhatIfResult(name, code, fix, top1, diff)


def ranked(results: Sequence[WhatIfResult]) -> list[WhatIfResult]:
    """Best first: smallest log-prob difference, then highest argmax agreement."""
    return sorted(
        results,
        key=lambda r: (
            r.max_logprob_diff if r.max_logprob_diff == r.max_logprob_diff else 1e9,
            -r.agreement,
        ),
    )


def reproducing(
    results: Sequence[WhatIfResult], baseline: float, tolerance: float | None
) -> WhatIfResult | None:
    """The best hypothesis if it reproduces the engine: its log-probs within the fp32-judged
    tolerance (when the engine recorded log-probs), else a clear argmax win."""
    if not results:
        return None
    best = results[0]
    if tolerance is not None and best.max_logprob_diff == best.max_logprob_diff:
        return best if best.max_logprob_diff <= tolerance and best.agreement >= AGREE_TOP1 else None
    if best.agreement >= AGREE_TOP1 and best.agreement >= baseline + WHATIF_MARGIN:
        return best
    return None
