"""Engine vs reference draft outputs on identical recorded inputs (pure).

The engine recorded, per draft row, its top-k draft ids, their log-probs and the mapped target
ids. The reference drafter is run on the same inputs in fp32 (the judge) and in bf16 (to learn
how far an honest low-precision kernel may stray). A max log-prob difference counts as noise
only when it is within a small multiple of that bf16-vs-fp32 spread: the tolerance is measured
on the same rows, never a fixed epsilon.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Argmax agreement at or above this counts as "the same function" (bf16 kernels of different
# engines agree on > 99% of rows; ties in tiny models cost a few percent).
AGREE_TOP1 = 0.9
# A what-if "reproduces" the engine when it reaches AGREE_TOP1 and beats the plain reference by
# this much.
WHATIF_MARGIN = 0.2
# How many bf16-vs-fp32 spreads a difference may reach and still count as numerical noise.
NOISE_MULTIPLE = 4.0


@dataclass(frozen=True)
class LogitAgreement:
    rows: int
    k: int
    top1: float  # same draft-space argmax as the fp32 reference
    topk: float  # mean overlap of the top-k sets
    max_logprob_diff: float  # over the engine's top-k entries, vs the fp32 reference
    noise_floor: float  # the same statistic for the reference itself in bf16
    tolerance: float

    @property
    def within_noise(self) -> bool:
        return self.max_logprob_diff <= self.tolerance

    @property
    def agrees(self) -> bool:
        return self.top1 >= AGREE_TOP1

    def to_json(self) -> dict[str, float | int | bool]:
        return {
            "rows": self.rows,
            "k": self.k,
            "top1_agreement": round(self.top1, 6),
            "topk_agreement": round(self.topk, 6),
            "max_logprob_diff": round(self.max_logprob_diff, 6),
            "noise_floor_bf16_vs_fp32": round(self.noise_floor, 6),
            "tolerance": round(self.tolerance, 6),
            "within_noise": self.within_noise,
        }


def gathered_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits) at `ids` without materialising the full-vocab softmax."""
    logits = logits.float()
    return logits.gather(-1, ids.long()) - torch.logsumexp(logits, dim=-1, keepdim=True)


def compare_topk(
    engine_ids: torch.Tensor,
    engine_logprobs: torch.Tensor | None,
    ref_logits: torch.Tensor,
    ref_logits_lowp: torch.Tensor | None = None,
) -> LogitAgreement:
    """engine_ids/logprobs [N, k] (draft space); ref_logits [N, Vd] fp32 on the same inputs;
    ref_logits_lowp [N, Vd] the same reference in bf16 (sets the noise floor)."""
    n, k = engine_ids.shape
    if n == 0:
        return LogitAgreement(0, k, 0.0, 0.0, 0.0, 0.0, 0.0)
    engine_ids = engine_ids.long()
    ref_top = ref_logits.float().topk(k, dim=-1).indices
    top1 = float((ref_top[:, 0] == engine_ids[:, 0]).float().mean())
    overlap = (engine_ids[:, :, None] == ref_top[:, None, :]).any(-1).float().mean(-1)
    ref_lp = gathered_logprobs(ref_logits, engine_ids)
    diff = (
        float((engine_logprobs.float() - ref_lp).abs().max())
        if engine_logprobs is not None
        else float("nan")
    )
    noise = 0.0
    if ref_logits_lowp is not None:
        noise = float((gathered_logprobs(ref_logits_lowp, engine_ids) - ref_lp).abs().max())
    # The floor of 1e-4 covers an fp32 engine, whose spread against the judge is ~1e-6.
    tolerance = NOISE_MULTIPLE * noise + 1e-4
    return LogitAgreement(
        rows=n,
        k=k,
        top1=top1,
        topk=float(overlap.mean()),
        max_logprob_diff=diff,
        noise_floor=noise,
        tolerance=tolerance,
    )


def agreement_by_step(
    steps: torch.Tensor,
    engine_ids: torch.Tensor,
    engine_logprobs: torch.Tensor | None,
    ref_logits: torch.Tensor,
) -> list[dict[str, float | int]]:
    """`compare_topk`'s top-1 / top-k / max difference per recorded step (rows grouped by
    `steps` [N], ascending), so a drift that starts mid-run shows where it starts."""
    out: list[dict[str, float | int]] = []
    for step in torch.unique(steps).tolist():
        rows = steps == step
        a = compare_topk(
            engine_ids[rows],
            engine_logprobs[rows] if engine_logprobs is not None else None,
            ref_logits[rows],
        )
        out.append(
            {
                "step": int(step),
                "rows": a.rows,
                "top1_agreement": round(a.top1, 6),
                "topk_agreement": round(a.topk, 6),
                "max_logit_diff": round(a.max_logprob_diff, 6),
            }
        )
    return out


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of equal entries (token ids, argmaxes)."""
    if a.numel() == 0:
        return 0.0
    return float((a.long() == b.long()).float().mean())
