"""Which SpecForge `norm_output` reading (before/after SpecForge PR #879) a drafter's weights
were trained with, decided from the training tensors by a paired test
(`hstrace.drafter.norm_output` has what each reading means)."""

from __future__ import annotations

from typing import Any

import torch

from hstrace.drafter.model import Eagle3Drafter
from hstrace.drafter.norm_output import NORM_OUTPUT_READINGS, norm_output_flags
from hstrace.evaluation.accuracy import data_reference
from hstrace.metrics import TargetHead, reference_ids


def _reading_hits(
    model: Eagle3Drafter, td: Any, head: TargetHead | None, n: int, steps: list[int], K: int
) -> torch.Tensor:
    """Per scored row, whether the drafter's teacher-forced step-k draft (target space) is right,
    for k in `steps`, concatenated over samples: vs the target's argmax (rebuilt from the stored
    final state) with `head`, else vs the stored token."""
    dtype = next(model.parameters()).dtype
    out = []
    with torch.no_grad():
        for i in range(n):
            s = td[i]
            ids, mask = s.input_ids.long(), s.loss_mask.bool()
            if ids.shape[0] < K + 2:
                continue
            next_ids = torch.cat([ids[1:], ids.new_zeros(1)])
            outs = model.ttt(next_ids, s.aux_concat.to(dtype), steps=K)
            if head is not None and s.last is not None and s.last_norm is not None:
                teacher = head.teacher_logits(s.last, s.last_norm)
                refs = [reference_ids(teacher, k) for k in range(K)]
            else:
                data_ref = data_reference(ids)
                refs = [torch.cat([data_ref[k:], data_ref.new_full((k,), -1)]) for k in range(K)]
            for k in steps:
                T = ids.shape[0]
                valid = torch.zeros(T, dtype=torch.bool)
                valid[: T - 1 - k] = mask[1 + k :]  # row t scores where loss_mask[t+1+k]
                valid &= refs[k] >= 0
                drafted = model.draft_to_target(outs[k].logits.argmax(-1))
                out.append((drafted == refs[k])[valid])
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool)


def resolve_norm_output(
    model: Eagle3Drafter,
    td: Any,
    value: bool,
    head: TargetHead | None = None,
    max_samples: int = 16,
    steps: int = 3,
    min_discordant: int = 10,
    z: float = 3.0,
) -> dict[str, Any]:
    """Which SpecForge `norm_output` reading (before/after PR #879) the weights were trained
    with, from the training tensors: the drafter is scored teacher-forced under both readings on
    the same rows; they differ at step 0 for `false` (norm before lm_head or not) and at steps
    >= 1 for `true` (the fed-back state). Paired test (McNemar): of the rows where exactly one
    reading is right, one reading must win by `z` standard deviations (|b - c| >= z*sqrt(b + c),
    b + c >= `min_discordant`); otherwise `reading` is None and hstrace says it cannot tell.
    The model's flags are left as they were."""
    n = min(len(td), max_samples)
    if n == 0:
        return {"reading": None, "why": "no training samples"}
    first = td[0]
    if tuple(first.aux.shape[1:]) != (model.cfg.num_aux, model.cfg.aux_width):
        return {"reading": None, "why": "the stored slots do not fit the drafter's fc"}
    scored = list(range(1, steps)) if value else [0]
    saved = (model.cfg.logits_use_norm, model.cfg.feed_normed)
    hits: dict[str, torch.Tensor] = {}
    try:
        for reading in NORM_OUTPUT_READINGS:
            flags = norm_output_flags(value, reading)
            model.cfg.logits_use_norm = flags["logits_use_norm"]
            model.cfg.feed_normed = flags["feed_normed"]
            hits[reading] = _reading_hits(model, td, head, n, scored, steps)
    finally:
        model.cfg.logits_use_norm, model.cfg.feed_normed = saved
    a, b = (hits[r] for r in NORM_OUTPUT_READINGS)
    only_a, only_b = int((a & ~b).sum()), int((~a & b).sum())
    disc = only_a + only_b
    decided = disc >= min_discordant and abs(only_a - only_b) >= z * disc**0.5
    best = NORM_OUTPUT_READINGS[0] if only_a > only_b else NORM_OUTPUT_READINGS[1]
    return {
        "reading": best if decided else None,
        "accuracy": {r: float(h.float().mean()) if h.numel() else None for r, h in hits.items()},
        "rows": int(a.numel()),
        "only_right_before_pr_879": only_a,
        "only_right_after_pr_879": only_b,
        "compared": (
            "teacher-forced accuracy at steps >= 1 (the fed-back state)"
            if value
            else "step-0 accuracy (norm before lm_head or not)"
        )
        + (" vs the target's argmax" if head is not None else " vs the stored tokens"),
        "test": f"McNemar: |b - c| >= {z} sqrt(b + c), b + c >= {min_discordant}",
        "why": None
        if decided
        else f"the readings disagree on {disc} of {int(a.numel())} rows ({only_a} vs {only_b}): "
        "not enough to tell",
    }
