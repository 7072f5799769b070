"""One small check per mismatch class, run in dataflow order over a replay context.

config → weights → vocab map → target capture → draft input → draft logits → acceptance.
Each check takes a `hstrace.replay.context.ReplayContext` and returns findings (code, evidence,
fix). `diagnose` runs them all, merges findings that two checks reached for the same code
(e.g. the static audit and the what-if search), and ends with `no-wiring-fault` when nothing
diverges.
"""

from __future__ import annotations

from collections.abc import Callable

from hstrace.diagnose import (
    acceptance,
    batch,
    cache,
    capture,
    config,
    draft_input,
    measurement,
    vocab,
    weights,
)
from hstrace.errors import HstraceError
from hstrace.findings import Finding, in_dataflow_order

Check = Callable[..., list[Finding]]

# In dataflow order; the what-if search (config/weights codes confirmed from draft logits)
# lives in `config.whatif_findings` and runs where its earliest code belongs.
CHECKS: tuple[Check, ...] = (
    measurement.acceptance_simulated,
    config.spec_params,
    config.static_load_findings,
    config.checkpoint_findings,
    config.whatif_findings,
    config.fed_back_state,
    weights.weights_dropped,
    vocab.vocab_mapping,
    batch.batch_coupling,
    capture.capture_slots,
    draft_input.fc_skipped,
    draft_input.token_shift,
    draft_input.chunk_boundary_token,
    cache.draft_kv_stale,
    acceptance.teacher_norm,
    acceptance.metric_overstates,
)


def merge(findings: list[Finding]) -> list[Finding]:
    """One finding per code: the first keeps its summary and fix, later ones add evidence."""
    by_code: dict[str, Finding] = {}
    for f in findings:
        if f.code not in by_code:
            by_code[f.code] = f
            continue
        kept = by_code[f.code]
        for k, v in f.evidence.items():
            kept.evidence.setdefault(k, v)
        if f.severity == "fault" and kept.severity != "fault":
            kept.severity = "fault"
    return list(by_code.values())


def no_wiring_fault(ctx) -> list[Finding]:
    return [acceptance.no_wiring_fault(ctx)]


def run_check(ctx, check: Check) -> list[Finding]:
    """One check; if it fails internally, `skipped` says so and the replay goes on. Bad input
    (`HstraceError`) still ends the replay with its one-line message."""
    try:
        return list(check(ctx))
    except HstraceError:
        raise
    except Exception as exc:  # a bug in one check must not hide what the others found
        ctx.skip(f"check {check.__name__}", f"failed internally: {type(exc).__name__}: {exc}")
        return []


def diagnose(ctx) -> list[Finding]:  # ctx: hstrace.replay.context.ReplayContext
    found: list[Finding] = []
    for check in CHECKS:
        found.extend(run_check(ctx, check))
    found = merge(found)
    if not any(f.severity in ("fault", "warning") for f in found):
        found.extend(run_check(ctx, no_wiring_fault))
    return in_dataflow_order(found)
