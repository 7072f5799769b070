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

from hstrace.findings import Finding, finding
from hstrace.replay.evidence import Evidence

# Relative-norm tolerance for "the same state" (bf16 storage, a slightly different kernel).
NORM_TOLERANCE = 0.05
# The library metric may exceed the served one by this much before it misleads.
OVERSTATE_MARGIN = 0.1


def teacher_norm(ev: Evidence) -> list[Finding]:
    state = ev.accuracy.teacher_state  # None: no target (skipped says so) or no final state
    if state is None:
        return []
    claimed, actual = state["claimed"], state["measured"]
    rel_pre, rel_post = ev.accuracy.teacher_rel_norms
    if claimed is None or actual == claimed:
        return []
    if min(abs(rel_pre - 1), abs(rel_post - 1)) > NORM_TOLERANCE:
        return []  # neither form: not a norm question (target-capture checks cover it)
    return [
        finding(
            "teacher-norm",
            f"the training data's final state is {actual}-norm but the library reads it as "
            f"{claimed}-norm, so its teacher applies the final norm "
            f"{'twice' if actual == 'post' else 'never'}",
            evidence=dict(state),
        )
    ]


def metric_overstates(ev: Evidence) -> list[Finding]:
    fv = ev.accuracy.full_vocab  # on the loss-masked training rows (`replay.accuracy`)
    if fv is None:
        return []
    library, served = fv["acc0_training_teacher"], fv["acc0_training_full_vocab"]
    coverage = fv["draft_vocab_coverage_of_target_argmax"]
    if library - served <= OVERSTATE_MARGIN:
        return []
    return [
        finding(
            "metric-overstates",
            f"the library's step-0 accuracy (teacher restricted to the draft vocab) is "
            f"{library:.0%}, but greedy serving accepts only {served:.0%}: the target's choice "
            f"is outside the draft vocab on {1 - coverage:.0%} of rows",
            evidence={
                "acc0_draft_vocab_teacher": round(library, 4),
                "acc0_full_vocab_target": round(served, 4),
                "draft_vocab_coverage": round(coverage, 4),
                "draft_vocab_size": int(ev.cfg.draft_vocab_size),
            },
        )
    ]


# Healthy position-0 acceptance of EAGLE-3 chains in the field is 0.55-0.75 (field-classes.md
# §5: speculators, vLLM and SGLang benchmarks); below it the drafter itself is weak.
HEALTHY_ACC0 = 0.55


def no_wiring_fault(ev: Evidence) -> list[Finding]:
    """Nothing diverges. Whether the drafter is weak is judged only from the number that
    matters for greedy serving: step-0 accuracy in target space against the target's own
    argmax (`acc0_training_full_vocab`, `Step0Accuracy.full_vocab`); accuracies against the
    dataset's or the committed tokens (sampled text, prompt tokens) are context, not a
    judgement."""
    evidence: dict[str, Any] = {}
    context = []
    acc = ev.accuracy
    judged_on = ev.judged()
    capture = judged_on.get("target-capture") or {}
    twins_only = bool(capture.get("against_target_forward")) and not capture["against_training"]
    # what agrees: with no training data the serving side agrees with the target's forward;
    # with no capture next to a training side, no agreement is claimed
    if twins_only:
        agree = "serving and the target's forward agree"
    elif not capture and judged_on:
        agree = "no divergence in the stages judged"
    else:
        agree = "serving and training agree"
    for name, value, label in (
        (
            "acc0_training",
            acc.training,
            "the target's forward (reference twins)" if twins_only else "training tensors",
        ),
        ("acc0_serving_aligned", acc.serving_aligned, "serving tensors (aligned tokens)"),
        ("acc0_serving", acc.serving, "serving tensors"),
    ):
        if value is not None:
            evidence[name] = round(float(value), 4)
            context.append(f"{value:.0%} on {label}")
    evr = ev.agreement.engine_vs_reference
    if evr is not None:
        evidence["engine_vs_reference_top1"] = round(evr.top1, 4)
        context.append(f"engine = reference on {evr.top1:.0%} of draft rows")
    judged = None
    if acc.full_vocab is not None:  # the number as the metrics report it
        judged = round(float(acc.full_vocab["acc0_training_full_vocab"]), 6)
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
            f"{agree}; {verdict}: step-0 accuracy against the target's own "
            f"argmax (target space, what greedy serving accepts) is {judged:.0%}"
        )
    elif context:
        summary = (
            f"{agree}; the drafter's greedy-serving accuracy (against the "
            "target's own argmax) was not measured (give --target DIR), so no judgement of "
            "the drafter"
        )
    else:
        # Nothing ran the drafter (see skipped): no grounds to call it weak.
        summary = "no divergence found in what could be checked (see what was not checked)"
    if context:
        summary += f" (context, against the dataset/committed tokens: {'; '.join(context)})"
    if capture.get("against_target_forward"):
        # the "training" side of these requests is the target's forward on the served tokens
        twins, trained = capture["against_target_forward"], capture["against_training"]
        basis = f"{twins} request(s) judged against the target's forward on the served tokens"
        if trained:
            basis += f" and {trained} against their training samples"
        summary += f"; {basis}"
        evidence["judged"] = judged_on
    if ev.not_judged:
        summary += "; not judged: " + "; ".join(
            f"{n['what'].split(' (')[0]} ({n['why']})" for n in ev.not_judged
        )
        evidence["not_judged"] = [n["stage"] for n in ev.not_judged]
    return [finding("no-wiring-fault", summary, evidence)]
