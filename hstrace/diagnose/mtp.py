"""The checks of an MTP replay (`hstrace.replay.mtp.MTPEvidence`): which state, which token,
which order the head was fed, and whether the engine's head computes what the reference does.

Each check returns [] for any other evidence (they are in `hstrace.diagnose.CHECKS`, which an
EAGLE-3 replay runs too). `diagnose_mtp` runs them with the config checks that read only the
static audit (simulated acceptance, adjusted settings, the load audit's facts), then closes
with `no_wiring_fault` when nothing diverges.
"""

from __future__ import annotations

from typing import Any

from hstrace.findings import Finding, finding
from hstrace.replay.mtp import TRAINED_SHIFT, MTPEvidence
from hstrace.replay.result import Judgement

# eh_proj halves exchanged must score this much better (absolute step-0 accuracy) on the
# training inputs than as loaded: the head learned the other order
ORDER_MARGIN = 0.2
PAIRING_SHARE = 0.9  # a pairing is the served one when this share of rows matches it
AGREES = 0.9  # engine vs reference top-1 below this on identical inputs: not the same head


def _mtp(ev: Any) -> MTPEvidence | None:
    return ev if isinstance(ev, MTPEvidence) else None


def input_order(ev: Any) -> list[Finding]:
    mtp = _mtp(ev)
    acc = mtp.training_accuracy if mtp else None
    if not acc or acc.get("as_loaded") is None or acc.get("halves_exchanged") is None:
        return []
    loaded, exchanged = acc["as_loaded"], acc["halves_exchanged"]
    if exchanged < loaded + ORDER_MARGIN:
        return []
    layers = (mtp.head_report.get("layer_prefixes") or ["model.mtp_layers.0."]) if mtp else []
    key = f"{layers[0]}input_proj.weight" if layers else "eh_proj.weight"
    return [
        finding(
            "mtp-input-order",
            f"the MTP head's eh_proj halves are in the other order than it was trained with: on "
            f"the training inputs it scores {loaded:.0%} step-0 accuracy as loaded and "
            f"{exchanged:.0%} with the two input halves exchanged",
            evidence={
                "acc0_training_as_loaded": loaded,
                "acc0_training_halves_exchanged": exchanged,
                "rows": acc.get("rows"),
                "eh_proj_key": key,
                "acc0_serving": mtp.serving_accuracy if mtp else None,
                "mean_accept_len": mtp.metrics()["mean_accept_len"] if mtp else None,
            },
            key=key,
        )
    ]


def hidden_source(ev: Any) -> list[Finding]:
    mtp = _mtp(ev)
    fed = mtp.fed if mtp else None
    if fed is None or fed.serving is None or fed.training is None:
        return []
    if fed.serving == fed.training:
        return []
    return [
        finding(
            "mtp-hidden-source",
            f"the engine fed the MTP head the target's {fed.serving} state; it was trained on "
            f"the {fed.training} state (decided from the numbers: relative error of each side's "
            "rows against the target's states on the same tokens)",
            evidence={
                **fed.to_json(),
                "acc0_serving": mtp.serving_accuracy if mtp else None,
                "acc0_training": (mtp.training_accuracy or {}).get("as_loaded") if mtp else None,
                "mean_accept_len": mtp.metrics()["mean_accept_len"] if mtp else None,
            },
            served=fed.serving,
            trained=fed.training,
        )
    ]


def token_pairing(ev: Any) -> list[Finding]:
    mtp = _mtp(ev)
    pairing = mtp.pairing if mtp else None
    if not pairing:
        return []
    shares = {int(s): v for s, v in pairing["serving_share_by_shift"].items() if v is not None}
    trained = TRAINED_SHIFT
    acc = (mtp.training_accuracy or {}) if mtp else {}
    by_shift = {
        s: acc.get(f"pairing_shift_{s}")
        for s in shares
        if acc.get(f"pairing_shift_{s}") is not None
    }
    if by_shift:  # the pairing the head scores clearly best with on its training inputs
        ranked = sorted(by_shift, key=by_shift.__getitem__, reverse=True)
        best, rest = ranked[0], [by_shift[s] for s in ranked[1:]]
        if by_shift[best] >= ORDER_MARGIN and all(by_shift[best] >= 2 * v for v in rest):
            trained = best
    served = [s for s, v in shares.items() if v >= PAIRING_SHARE]
    if not served or served[0] == trained:
        return []
    return [
        finding(
            "mtp-token-pairing",
            f"the engine paired the hidden state of token t with the embedding of token "
            f"t+{served[0]}; the head was trained with token t+{trained}",
            evidence={
                "serving_share_by_shift": shares,
                "acc0_training_by_shift": by_shift,
                "trained_shift": trained,
            },
            served=served[0],
            trained=trained,
        )
    ]


def head_not_in_checkpoint(ev: Any) -> list[Finding]:
    """The served checkpoint, read as engines read it (its index when there is one), fills
    none of some MTP head parameters: whatever serves it, those hold initial values."""
    mtp = _mtp(ev)
    missing = list(mtp.head_report.get("missing") or []) if mtp else []
    if not missing:
        return []
    return [
        finding(
            "weights-dropped",
            f"the target checkpoint, read as engines read it, fills none of {len(missing)} MTP "
            "head parameters: they serve their initial values",
            evidence={
                "unloaded_parameters": missing[:20],
                "checkpoint": mtp.head_report.get("path") if mtp else None,
                "mtp_layers_found": mtp.head_report.get("layer_prefixes") if mtp else None,
            },
        )
    ]


def engine_vs_reference(ev: Any) -> list[Finding]:
    """On identical recorded inputs the engine's head and the reference head (the same
    checkpoint) disagree: the engine computes with other weights than the checkpoint holds."""
    mtp = _mtp(ev)
    agreement = mtp.engine_vs_reference if mtp else None
    if agreement is None or agreement.top1 >= AGREES:
        return []
    return [
        finding(
            "weights-dropped",
            "on identical recorded inputs the engine's MTP head agrees with the reference head "
            f"of the same checkpoint on {agreement.top1:.0%} of draft rows: it computes with "
            "other weights than the checkpoint holds",
            evidence={**agreement.to_json()},
            severity="warning",
        )
    ]


def no_wiring_fault(ev: Any) -> list[Finding]:
    """Nothing diverges: the numbers the verdict rests on."""
    mtp = _mtp(ev)
    if mtp is None:
        return []
    evidence: dict[str, Any] = {}
    parts = []
    acc = (mtp.training_accuracy or {}).get("as_loaded")
    if acc is not None:
        evidence["acc0_training"] = acc
        parts.append(f"step-0 accuracy {acc:.0%} on the training inputs")
    if mtp.serving_accuracy is not None:
        evidence["acc0_serving"] = mtp.serving_accuracy
        parts.append(f"{mtp.serving_accuracy:.0%} on the serving inputs")
    if mtp.engine_vs_reference is not None:
        evidence["engine_vs_reference_top1"] = round(mtp.engine_vs_reference.top1, 4)
        parts.append(f"engine = reference on {mtp.engine_vs_reference.top1:.0%} of draft rows")
    if mtp.fed is not None:
        evidence["fed_state"] = {"serving": mtp.fed.serving, "training": mtp.fed.training}
    return [
        finding(
            "no-wiring-fault",
            "serving and training agree for the MTP head"
            + (": " + "; ".join(parts) if parts else ""),
            evidence=evidence,
        )
    ]


def diagnose_mtp(ev: MTPEvidence) -> Judgement:
    """The checks that apply to an MTP replay, then `no_wiring_fault` when nothing diverges."""
    from hstrace.diagnose import merge, run_check
    from hstrace.diagnose.config import spec_params, static_load_findings
    from hstrace.diagnose.measurement import acceptance_simulated
    from hstrace.replay.unavailable import split_failures

    checks = (
        acceptance_simulated,
        spec_params,
        static_load_findings,
        head_not_in_checkpoint,
        engine_vs_reference,
        hidden_source,
        token_pairing,
        input_order,
    )
    failed: dict[str, str] = {}
    found = [(c, f) for c in checks for f in run_check(ev, c, failed)]  # type: ignore[arg-type]
    out = merge(found)
    incomplete = failed or split_failures(ev.unavailable)[1]
    if not incomplete and not any(f.severity in ("fault", "warning") for f in out):
        out.extend(run_check(ev, no_wiring_fault, failed))  # type: ignore[arg-type]
    return Judgement(out, dict(sorted(failed.items())))
