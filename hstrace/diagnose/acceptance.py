"""Stage `acceptance`: the training side's own numbers, and the clean verdict.

- `teacher-norm`: the stored final state is in the other norm form than the library assumes
  (its teacher then applies the final norm twice, or not at all). Decided by which reference
  state the stored one equals in scale: the pre-norm final stream or the post-norm lm_head input.
- `metric-overstates`: the library's step-0 accuracy (teacher restricted to the draft vocab)
  is clearly above what greedy serving accepts (the full-vocab target argmax).
- `no-wiring-fault`: nothing diverges; acceptance is what this drafter can do.
"""

from __future__ import annotations

from typing import Any

import torch

from hstrace.findings import Finding
from hstrace.replay.compare import agreement

# Relative-norm tolerance for "the same state" (bf16 storage, a slightly different kernel).
NORM_TOLERANCE = 0.05
# The library metric may exceed the served one by this much before it misleads.
OVERSTATE_MARGIN = 0.1


def teacher_norm(ctx) -> list[Finding]:
    if ctx.target is None:
        ctx.skip("teacher test", "no target model (give --target DIR)")
        return []
    pairs = [(a, a.sample.last) for a in ctx.aligned if a.sample.last is not None]
    if not pairs:
        return []
    claimed = pairs[0][0].sample.last_norm
    stored, pre, post = [], [], []
    for a, last in pairs:
        fwd = ctx.target.forward(torch.as_tensor(a.sample.input_ids[: a.n]).long())
        stored.append(last[: a.n].float())
        pre.append(fwd.layers[:, -1])
        post.append(fwd.post_norm)
    stored_t, pre_t, post_t = torch.cat(stored), torch.cat(pre), torch.cat(post)
    norm = stored_t.norm(dim=-1).mean()
    rel_pre = float(norm / pre_t.norm(dim=-1).mean())
    rel_post = float(norm / post_t.norm(dim=-1).mean())
    actual = "pre" if abs(rel_pre - 1) < abs(rel_post - 1) else "post"
    ctx.metrics["teacher_state"] = {
        "claimed": claimed,
        "measured": actual,
        "rel_norm_to_pre_norm_final": round(rel_pre, 4),
        "rel_norm_to_post_norm_final": round(rel_post, 4),
    }
    if claimed is None or actual == claimed:
        return []
    if min(abs(rel_pre - 1), abs(rel_post - 1)) > NORM_TOLERANCE:
        return []  # neither form: not a norm question (target-capture checks cover it)
    return [
        Finding(
            "teacher-norm",
            f"the training data's final state is {actual}-norm but the library reads it as "
            f"{claimed}-norm, so its teacher applies the final norm "
            f"{'twice' if actual == 'post' else 'never'}",
            evidence=dict(ctx.metrics["teacher_state"]),
            fix=(
                "store the final state as the library expects: speculators wants the pre-norm "
                "final stream (vLLM capture id N, before model.norm), SpecForge the post-norm "
                "lm_head input; regenerate the dump or fix the generator's capture point"
            ),
        )
    ]


def metric_overstates(ctx) -> list[Finding]:
    ts = ctx.training_step0
    if ts is None or ctx.target is None:
        return []
    teacher = []
    for a, n in ts["rows"]:
        logits = ctx.target.forward(torch.as_tensor(a.sample.input_ids[: a.n]).long()).logits
        teacher.append(logits[1 : n + 1])
    teacher_full = torch.cat(teacher)
    d2t = ctx.drafter.d2t.long()
    in_vocab = torch.arange(len(d2t)) + d2t
    # Same rows as `acc0_training`: the loss-masked ones the library trains and reports on.
    m = ts["mask"] if ts["mask"].any() else torch.ones_like(ts["mask"])
    teacher_full = teacher_full[m]
    draft_pred = ts["logits"].argmax(-1)[m]
    library = agreement(draft_pred, teacher_full[:, in_vocab].argmax(-1))  # speculators acc_0
    target_argmax = teacher_full.argmax(-1)
    served = agreement(draft_pred + d2t[draft_pred], target_argmax)  # what greedy accepts
    coverage = float(torch.isin(target_argmax, in_vocab).float().mean())
    ctx.metrics.update(
        {
            "acc0_training_teacher": round(library, 6),
            "acc0_training_full_vocab": round(served, 6),
            "draft_vocab_coverage_of_target_argmax": round(coverage, 6),
        }
    )
    if library - served <= OVERSTATE_MARGIN:
        return []
    return [
        Finding(
            "metric-overstates",
            f"the library's step-0 accuracy (teacher restricted to the draft vocab) is "
            f"{library:.0%}, but greedy serving accepts only {served:.0%}: the target's choice "
            f"is outside the draft vocab on {1 - coverage:.0%} of rows",
            evidence={
                "acc0_draft_vocab_teacher": round(library, 4),
                "acc0_full_vocab_target": round(served, 4),
                "draft_vocab_coverage": round(coverage, 4),
                "draft_vocab_size": int(ctx.cfg.draft_vocab_size),
            },
            fix="judge the drafter by accuracy against the full-vocab target argmax; rebuild "
            "d2t/t2d from the serving traffic's token frequencies or raise draft_vocab_size",
            severity="warning",
        )
    ]


# Healthy position-0 acceptance of EAGLE-3 chains in the field is 0.55-0.75 (field-classes.md
# §5: speculators, vLLM and SGLang benchmarks); below it the drafter itself is weak.
HEALTHY_ACC0 = 0.55


def no_wiring_fault(ctx) -> Finding:
    """Nothing diverges. Whether the drafter is weak is judged only from the number that
    matters for greedy serving: step-0 accuracy in target space against the target's own
    argmax (`acc0_training_full_vocab`, from `metric_overstates`); accuracies against the
    dataset's or the committed tokens (sampled text, prompt tokens) are context, not a
    judgement."""
    evidence: dict[str, Any] = {}
    context = []
    for name, label in (
        ("acc0_training", "training tensors"),
        ("acc0_serving_aligned", "serving tensors (aligned tokens)"),
        ("acc0_serving", "serving tensors"),
    ):
        value = getattr(ctx, name)
        if value is not None:
            evidence[name] = round(float(value), 4)
            context.append(f"{value:.0%} on {label}")
    if ctx.agreement is not None:
        evidence["engine_vs_reference_top1"] = round(ctx.agreement.top1, 4)
        context.append(f"engine = reference on {ctx.agreement.top1:.0%} of draft rows")
    judged = ctx.metrics.get("acc0_training_full_vocab")
    if judged is not None:
        judged = float(judged)
        evidence["judged_by"] = {
            "metric": "acc0_training_full_vocab",
            "value": round(judged, 4),
            "meaning": "step-0 draft argmax (mapped through d2t) == the target's own argmax, "
            "full target vocab, loss-masked aligned training rows",
            "healthy_position0_acceptance": [0.55, 0.75],
        }
        verdict = (
            "the drafter itself is weak"
            if judged < HEALTHY_ACC0
            else "the drafter is not weak by the healthy position-0 range 0.55-0.75"
        )
        summary = (
            f"serving and training agree; {verdict}: step-0 accuracy against the target's own "
            f"argmax (target space, what greedy serving accepts) is {judged:.0%}"
        )
    elif context:
        summary = (
            "serving and training agree; the drafter's greedy-serving accuracy (against the "
            "target's own argmax) was not measured (give --target DIR), so no judgement of "
            "the drafter"
        )
    else:
        # Nothing ran the drafter (see skipped): no grounds to call it weak.
        summary = "no divergence found in what could be checked (see what was not checked)"
    if context:
        summary += f" (context, against the dataset/committed tokens: {'; '.join(context)})"
    return Finding(
        "no-wiring-fault",
        summary,
        evidence=evidence,
        fix="nothing to rewire: to raise acceptance, train the drafter longer or on data "
        "closer to the serving traffic",
        severity="info",
    )
