"""Stage `weights`: checkpoint tensors the engine never loaded.

Evidence from two sides: the static audit's load record (keys dropped, parameters never
loaded), and the draft logits: on identical recorded inputs the engine disagrees with the
reference and no single what-if explains it (random or uninitialised weights look like that).
"""

from __future__ import annotations

from hstrace.findings import Finding, finding
from hstrace.replay.evidence import Evidence

# The engine's vocab-map buffer (vLLM `draft_id_to_target_id`, SGLang `hot_token_id`): a
# checkpoint without `d2t` leaves it unfilled, and that is `vocab-map-missing` (the fix is to
# ship d2t, not to rename keys), not a dropped weight.
VOCAB_MAP_PARAMETERS = frozenset({"draft_id_to_target_id", "hot_token_id"})


# Checkpoint key prefixes an engine skips on purpose while a norm flag is off: vLLM 0.32's
# `Eagle3LlamaForCausalLM.load_weights` maps `input_norm.` to None without norm_before_fc
# (SGLang builds no input_norm then). Such a key has the right name: it is the norm-flag
# finding's evidence (`diagnose.config.whatif_findings`), never a key to rename.
FLAG_WEIGHTS: dict[str, tuple[str, ...]] = {"norm_before_fc": ("input_norm.",)}


def flag_skipped_keys(ev: Evidence) -> dict[str, list[str]]:
    """{flag: the dropped checkpoint keys it explains}, for each norm flag the engine served
    off (the static audit's `norm_flags`) while the drafter, as the reference loads it, has
    it on."""
    from hstrace.drafter.checkpoint import canonical_name

    dropped = list((ev.static.get("weights") or {}).get("dropped_keys") or [])
    served = ev.static.get("norm_flags") or {}
    # norm flags are an EAGLE-3 drafter's; MTP evidence has no `drafter` (nothing to explain)
    if not dropped or not isinstance(served, dict) or getattr(ev, "drafter", None) is None:
        return {}
    out: dict[str, list[str]] = {}
    for flag, prefixes in FLAG_WEIGHTS.items():
        as_served = served.get(flag)
        if not isinstance(as_served, dict) or as_served.get("value") is not False:
            continue
        if not getattr(ev.cfg, flag, False):
            continue
        keys = [k for k in dropped if canonical_name(k).startswith(prefixes)]
        if keys:
            out[flag] = keys
    return out


def unexplained_dropped(ev: Evidence, dropped: list[str]) -> list[str]:
    """The dropped keys less those a norm flag served off explains (`flag_skipped_keys`)."""
    explained = {k for keys in flag_skipped_keys(ev).values() for k in keys}
    return [k for k in dropped if k not in explained]


def unloaded_weights(ev: Evidence, unloaded: list[str]) -> list[str]:
    """The unloaded parameters that are weights-dropped: all of them, less the vocab-map
    buffer when the checkpoint has no d2t to fill it with."""
    report = ev.load_report
    if report is None or "d2t" not in report.missing:
        return unloaded
    return [p for p in unloaded if p.rsplit(".", 1)[-1] not in VOCAB_MAP_PARAMETERS]


def weights_dropped(ev: Evidence) -> list[Finding]:
    audit = ev.static.get("weights") or {}
    dropped = unexplained_dropped(ev, list(audit.get("dropped_keys") or []))
    unloaded = unloaded_weights(ev, list(audit.get("unloaded_parameters") or []))
    agreement = ev.agreement.engine_vs_reference
    runtime = {}
    if agreement is not None:
        runtime = {
            "engine_vs_reference_top1": round(agreement.top1, 4),
            "engine_vs_reference_max_logprob_diff": agreement.to_json()["max_logprob_diff"],
        }
    if dropped or unloaded:
        return [
            finding(
                "weights-dropped",
                f"the engine did not load {len(unloaded)} drafter parameters "
                f"({len(dropped)} checkpoint keys dropped)",
                evidence={
                    "dropped_keys": dropped[:20],
                    "unloaded_parameters": unloaded[:20],
                    **runtime,
                },
            )
        ]
    search = ev.whatif  # the what-if search, as evidence (`replay.whatif`)
    if (
        agreement is not None
        and not (agreement.agrees and agreement.within_noise)
        and search is not None
        and search.ran
        and search.best is None
    ):
        return [
            finding(
                "weights-dropped",
                "on identical recorded inputs the engine's draft logits disagree with the "
                f"reference ({agreement.top1:.0%} top-1 agreement) and no single misreading "
                "reproduces them; weights the engine did not load are the usual cause",
                evidence={
                    **runtime,
                    "whatif_best": search.results[0].to_json() if search.results else None,
                },
                severity="warning",
            )
        ]
    return []
