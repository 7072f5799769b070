"""What-if search (pure): which single misreading makes the reference do what the engine did.

Each what-if is one hypothesis about the engine (a norm flag read the other way, `d2t` read as
a direct table, aux layers shifted by one, tokens shifted by one, ...), expressed as a function
that re-runs the reference under that hypothesis and returns the ids it would have produced on
the recorded rows. The one that reproduces the engine's ids names the fault.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hstrace.replay.compare import AGREE_TOP1, WHATIF_MARGIN, agreement


@dataclass(frozen=True)
class WhatIf:
    name: str  # e.g. "norm_before_residual=False"
    code: str  # the finding code it would confirm
    fix: str
    run: Callable[[], torch.Tensor]  # ids under the hypothesis, same rows as the engine's


@dataclass(frozen=True)
class WhatIfResult:
    name: str
    code: str
    fix: str
    agreement: float

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "code": self.code, "agreement": round(self.agreement, 6)}


def search(whatifs: Sequence[WhatIf], engine_ids: torch.Tensor) -> list[WhatIfResult]:
    """Every hypothesis scored by argmax agreement with the engine, best first."""
    results = []
    for w in whatifs:
        try:
            ids = w.run()
        except (ValueError, RuntimeError, IndexError):
            # A hypothesis that cannot even run on this drafter (e.g. no input_norm weight to
            # apply) cannot be what the engine did.
            continue
        results.append(WhatIfResult(w.name, w.code, w.fix, agreement(ids, engine_ids)))
    return sorted(results, key=lambda r: -r.agreement)


def reproducing(results: Sequence[WhatIfResult], baseline: float) -> WhatIfResult | None:
    """The best hypothesis if it reproduces the engine and clearly beats the plain reference."""
    if (
        results
        and results[0].agreement >= AGREE_TOP1
        and results[0].agreement >= baseline + WHATIF_MARGIN
    ):
        return results[0]
    return None
