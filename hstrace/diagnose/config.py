"""Stage `config` (and the what-if search's answer, mostly config codes).

- `spec-params-adjusted`: the static audit shows the engine changed speculative settings.
- findings the recorder already made at load time (the static audit carries them).
- the what-if search (`replay.whatif`, run once as evidence): when the engine's draft
  logits disagree with the reference on identical recorded inputs, the single misreading that
  reproduces them (norm flags, RoPE, window, embedding source, fc skipped, tokens or layers
  shifted by one). The search names a hypothesis and its kind; the registry
  (`hstrace.findings.HYPOTHESES`) says which code it confirms, and its fix is that code's
  "what-if" template filled with the hypothesis' parameters.
"""

from __future__ import annotations

from typing import Any

from hstrace.engines.registry import ENGINES, engine_spec
from hstrace.findings import HYPOTHESES, REGISTRY, Finding, finding, from_fact
from hstrace.replay.compare import with_topk
from hstrace.replay.evidence import Evidence


def spec_params(ev: Evidence) -> list[Finding]:
    """The static audit's `spec` (`spec_settings` shape): settings the engine changed."""
    spec = ev.static.get("spec")
    if not isinstance(spec, dict) or not spec.get("adjusted"):
        return []
    name = str((ev.serving.meta.get("engine") or {}).get("name", ""))
    # the engine that recorded the trace words it ("spec-adjusted" audit facts); a trace of an
    # engine this build does not know is read as the first registered one's (SGLang's shape)
    spec_of = engine_spec(name if name in ENGINES else next(iter(ENGINES)))
    return [from_fact(fact) for fact in spec_of.spec_facts(spec)]


def static_load_findings(ev: Evidence) -> list[Finding]:
    """Findings the recorder computed at load time (SGLang hooks: `findings_load`,
    `findings_spec`), kept as they are; the static audit is part of the evidence."""
    out = []
    for key in ("findings_load", "findings_spec"):
        for f in ev.static.get(key) or []:
            if isinstance(f, dict) and f.get("code") in REGISTRY:
                if f["code"] == "weights-dropped" and _only_vocab_map(ev, f):
                    continue  # a checkpoint without d2t: vocab-map-missing says it
                if f["code"] == "weights-dropped" and _only_flag_weights(ev, f):
                    continue  # a norm flag served off skipped them: norm-flag-mismatch says it
                out.append(
                    finding(
                        f["code"],
                        f.get("summary", ""),
                        {**(f.get("evidence") or {}), "source": f"static audit ({key})"},
                        fix=f.get("fix", ""),
                        severity="fault"
                        if f["code"] == "spec-params-adjusted"
                        else f.get("severity", "fault"),
                        applies_to=f.get("applies_to"),
                    )
                )
    return out


def _only_vocab_map(ev: Evidence, fact: dict) -> bool:
    """A recorded weights-dropped fact whose only unloaded parameter is the vocab-map buffer
    of a checkpoint without d2t (`diagnose.weights.unloaded_weights`)."""
    from hstrace.diagnose.weights import unloaded_weights

    evidence = fact.get("evidence") or {}
    unloaded = list(evidence.get("unloaded_parameters") or [])
    return (
        not evidence.get("dropped_keys") and bool(unloaded) and not unloaded_weights(ev, unloaded)
    )


def _only_flag_weights(ev: Evidence, fact: dict) -> bool:
    """A recorded weights-dropped fact whose every dropped key a norm flag the engine served
    off explains (`diagnose.weights.flag_skipped_keys`), with no parameter left unloaded."""
    from hstrace.diagnose.weights import unexplained_dropped

    evidence = fact.get("evidence") or {}
    dropped = list(evidence.get("dropped_keys") or [])
    return (
        bool(dropped)
        and not evidence.get("unloaded_parameters")
        and not unexplained_dropped(ev, dropped)
    )


def checkpoint_findings(ev: Evidence) -> list[Finding]:
    """`hstrace check`'s static checks on the drafter checkpoint (reused, not rewritten), kept
    when they apply to the engine and version that recorded the trace."""
    if ev.drafter is None or ev.load_report is None:
        return []
    from hstrace.rules import static_findings

    engine = ev.serving.meta.get("engine") or {}
    name, version = str(engine.get("name", "")), str(engine.get("version", ""))
    kept, _ = static_findings(ev.load_report, ev.drafter, engine=name, version=version)
    for f in kept:
        f.evidence.setdefault("source", "hstrace check (static, on the checkpoint)")
    return kept


# -- the what-if search (evidence: `Evidence.whatif`, `replay.whatif`) -----------------------
def whatif_findings(ev: Evidence) -> list[Finding]:
    search = ev.whatif
    if search is None or not search.ran or search.best is None:
        return []
    code = HYPOTHESES.get(search.best.kind)
    if code is None:
        raise ValueError(f"what-if kind {search.best.kind!r} confirms no registered code")
    base = ev.agreement.engine_vs_reference
    best, results, baseline, tolerance = (
        search.best,
        search.results,
        search.baseline,
        search.tolerance,
    )
    evidence: dict[str, Any] = {
        "what_if": best.name,
        "max_logprob_diff_with_it": best.to_json()["max_logprob_diff"],
        "max_logprob_diff_without_it": base.to_json()["max_logprob_diff"] if base else None,
        "tolerance": round(tolerance, 6) if tolerance is not None else None,
        "agreement_with_engine": round(best.agreement, 4),
        "reference_agreement_without_it": round(baseline, 4),
        "runner_up": results[1].to_json() if len(results) > 1 else None,
    }
    if code == "attention-window" and base is not None:
        evidence.update(_agreement_by_distance(ev))
    variant, summary = "what-if", ""
    skipped = _skipped_by_flag(ev, best.params)
    if skipped:
        evidence["engine_skipped_keys"] = skipped
        summary = f"; the engine skipped {', '.join(skipped)} (loaded without the flag)"
    check = search.training_check
    if check is not None:
        evidence["fix_checked_on_training"] = check
        summary += (
            f"; on the training tensors step-0 accuracy {check['as_trained']:.2f} as trained vs "
            f"{check['as_served']:.2f} as served, loss {check['nll_as_trained']:.3f} vs "
            f"{check['nll_as_served']:.3f}"
        )
        # a fix that does not reproduce training better than serving is not printed as the fix
        if code == "norm-flag-mismatch" and not check["nll_as_trained"] < check["nll_as_served"]:
            variant = "what-if-unconfirmed"
    return [
        finding(
            code,
            f"the engine's draft logits are reproduced by the reference with {best.name} "
            f"({best.agreement:.0%} top-1 agreement vs {baseline:.0%} without){summary}",
            evidence,
            variant=variant,
            severity="fault",
            **best.params,
            **(check or {}),
        )
    ]


def _skipped_by_flag(ev: Evidence, params: Any) -> list[str]:
    """The checkpoint keys the engine skipped because it served the what-if's flag off (the
    static audit's load record), e.g. `input_norm.weight` without norm_before_fc."""
    from hstrace.diagnose.weights import flag_skipped_keys

    flag = params.get("flag") if isinstance(params, dict) else None
    if flag is None or params.get("served") is not False:
        return []
    return flag_skipped_keys(ev).get(str(flag), [])


def _agreement_by_distance(ev: Evidence) -> dict[str, Any]:
    """Reference-vs-engine agreement for early and late positions (a window bites late)."""
    keep = with_topk(ev.agreement.rows.topk_draft_ids)  # rows without a top-k: nothing to compare
    ref = ev.agreement.reference.argmax[keep]
    eng = ev.agreement.engine_top1[keep]
    idx = ev.agreement.rows.index[keep]
    half = int(idx.max()) // 2 if len(idx) else 0
    early, late = idx < half, idx >= half
    return {
        "top1_positions_before_" + str(half): round(
            float((ref[early] == eng[early]).float().mean()), 4
        )
        if early.any()
        else None,
        "top1_positions_from_" + str(half): round(float((ref[late] == eng[late]).float().mean()), 4)
        if late.any()
        else None,
    }


def fed_back_state(ev: Evidence) -> list[Finding]:
    """Steps k >= 1: does the engine feed back what the drafter was trained to get? Decided by
    the recorded chains rerun with the trained `feed_normed` and with its opposite."""
    from hstrace.replay.agreement import pooled

    a = ev.agreement
    if ev.drafter is None or a.engine_vs_reference is None:
        return []
    # The step-0 tolerance (bf16-vs-fp32 spread measured on the same rows) judges log-probs.
    tol = a.engine_vs_reference.tolerance
    base_steps = a.chains
    if not base_steps or a.chains_match(base_steps):
        return []
    trained = bool(ev.cfg.feed_normed)
    flipped_steps = a.chains_feed_flipped
    if not flipped_steps or not a.chains_match(flipped_steps):
        return []
    base, flipped = pooled(base_steps), pooled(flipped_steps)
    state = "norm(h)" if not trained else "h (pre-norm)"
    return [
        finding(
            "norm-flag-mismatch",
            f"at draft steps k >= 1 the engine feeds back {state}: it behaves as if "
            f"feed_normed={not trained} (top-1 {base:.3f}, max log-prob diff "
            f"{max(p['max_logit_diff'] for p in base_steps):.3f} as trained; {flipped:.3f} and "
            f"within the tolerance {tol:.3f} flipped); step 0 cannot show this",
            {
                "flag": "feed_normed",
                "trained": trained,
                "engine_behaves_as": not trained,
                "by_draft_step_as_trained": base_steps,
                "by_draft_step_flipped": flipped_steps,
                "tolerance": round(tol, 6),
            },
            variant="fed-back",
            trained_json=str(trained).lower(),
        )
    ]
