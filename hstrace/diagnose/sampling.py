"""`verify-rule` and `sampling-transform`: each verify judged by the engine's own rule.

The evidence (`hstrace.replay.verify`) holds, per rule, the accepted drafts the rule predicts
from the probabilities the engine used (E[A] = Σ a_j over the positions reached, with its
binomial σ) and the ones it accepted; and each drafted token's processed target logit next to
the request's transforms recomputed from its raw logit. A gap beyond Z_SPREAD·σ + SLACK is
`verify-rule`; a processed logit the transforms do not reproduce is `sampling-transform`,
named by the misreading that does.
"""

from __future__ import annotations

from hstrace.findings import Finding, finding
from hstrace.replay.evidence import Evidence
from hstrace.replay.verify import SLACK, Z_SPREAD

_FORMULA = {
    "greedy": "1[draft = argmax p]",
    "one-hot": "p(draft) (draft probabilities one-hot)",
    "draft-probs": "min(1, p(draft) / q(draft))",
}


def verify_rule(ev: Evidence) -> list[Finding]:
    out = []
    for rule, s in ev.sampled.by_rule.items():
        if not s.beyond_spread:
            continue
        more = "more" if s.realized > s.predicted else "fewer"
        out.append(
            finding(
                "verify-rule",
                f"the engine accepted {s.realized} drafts over {s.reached} positions reached "
                f"in {s.rounds} {rule} verify rounds; its rule predicts {s.predicted:.1f} ± "
                f"{s.sigma:.1f} from the probabilities it used: {more} than the rule allows "
                f"(z = {s.z:.1f}, threshold {Z_SPREAD:g}σ + {SLACK:g})",
                evidence={"rule": rule, "formula": _FORMULA[rule], **s.to_json()},
                rule=rule,
                formula=_FORMULA[rule],
            )
        )
    return out


def sampling_transform(ev: Evidence) -> list[Finding]:
    sa = ev.sampled
    if not sa.n_mismatched:
        return []
    # the misreading that reproduces the most mismatches (each counts every one it reproduces)
    top = max(sa.transform_explained.items(), key=lambda kv: kv[1])[0]
    first = sa.transform_mismatches[0]
    implied = first.get("implied_temperature")
    implied_text = f" (temperature implied {implied:.4g})" if implied is not None else ""
    return [
        finding(
            "sampling-transform",
            f"{sa.n_mismatched} of {sa.transform_checked} drafted tokens' verify logits are not "
            f"the request's sampling transforms of the raw logits (penalties checked on "
            f"{sa.checked_by_stage.get('penalties', 0)}, the temperature on "
            f"{sa.checked_by_stage.get('temperature', 0)}: {sa.masked} masked by top-k/top-p); "
            f"the first, at the "
            f"{first['stage']} stage (verify step {first['verify_step']}, draft position "
            f"{first['position']}, token {first['token']}): engine {first['engine']:.4g}, "
            f"reference {first['reference']:.4g}{implied_text}; reproduced by: {top}",
            evidence={
                "checked": sa.transform_checked,
                "checked_by_stage": dict(sa.checked_by_stage),
                "masked": sa.masked,
                "mismatched": sa.n_mismatched,
                "by_stage": sa.by_stage,
                "explained_by": sa.transform_explained,
                "first": sa.transform_mismatches,
            },
            explained=top,
        )
    ]
