"""When two recorded float tensors are "the same": judged against what rounding can explain.

Engines compute in fp32 (accumulators) and store bf16. Two runs whose fp32 values agree to
fp32 precision can still store bf16 values one ulp apart, when a value sits next to a rounding
boundary. One bf16 ulp is at most 2u relative (u = 2^-8, the unit roundoff), so a row whose
relative L2 error is within `ulps * u` is explained by rounding; anything beyond is a real
difference. fp32 columns computed from bf16 data (log-probs, lse) get the same bound, from the
compute dtype, since their inputs carry that rounding; pure fp32 traces get u = 2^-24.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24, "float64": 2.0**-53}
DEFAULT_ULPS = 2.0


@dataclass(frozen=True)
class Tolerance:
    compute_dtype: str
    ulps: float = DEFAULT_ULPS

    @property
    def rel(self) -> float:
        return self.ulps * UNIT_ROUNDOFF[self.compute_dtype]

    def describe(self) -> str:
        return (
            f"float rows: relative L2 error <= {self.rel:.3g} = {self.ulps:g} x u({self.compute_dtype}) "
            f"with u = 2^{int(np.log2(UNIT_ROUNDOFF[self.compute_dtype]))}; that is at most one "
            f"{self.compute_dtype} ulp per element, what rounding fp32 values that agree to fp32 "
            "precision can explain. Integers (ids, positions, lengths) must match exactly."
        )


def compute_dtype_of(logical_dtypes: list[str]) -> str:
    """The coarsest float dtype recorded: it bounds the precision of everything derived from it."""
    order = ["bfloat16", "float16", "float32", "float64"]
    found = [d for d in logical_dtypes if d in order]
    return min(found, key=order.index) if found else "float32"


def as_float(a) -> torch.Tensor:
    t = a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))
    return t.to(torch.float64)


def is_float(a) -> bool:
    if isinstance(a, torch.Tensor):
        return a.is_floating_point()
    return np.issubdtype(np.asarray(a).dtype, np.floating)


def row_rel_error(a, b) -> torch.Tensor:
    """Per row ||a-b|| / max(||a||, ||b||), in fp64 (rows on dim 0; NaN where both are NaN)."""
    x, y = as_float(a), as_float(b)
    x = x.reshape(x.shape[0], -1) if x.dim() else x.reshape(1, 1)
    y = y.reshape(y.shape[0], -1) if y.dim() else y.reshape(1, 1)
    both_nan = torch.isnan(x) & torch.isnan(y)
    x, y = torch.where(both_nan, 0.0, x), torch.where(both_nan, 0.0, y)
    num = (x - y).norm(dim=1)
    den = torch.maximum(x.norm(dim=1), y.norm(dim=1)).clamp_min(1e-30)
    err = num / den
    return torch.where(num == 0, torch.zeros_like(err), err)
