"""One small check per mismatch class, run in dataflow order over a replay context.

config → weights → vocab map → target capture → draft input → draft logits → acceptance.
Each check takes a `hstrace.replay.context.ReplayContext` and returns findings (code, evidence,
fix). `diagnose` runs them all, merges findings that two checks reached for the same code
(e.g. the static audit and the what-if search), and ends with `no-wiring-fault` when nothing
diverges.
"""

from __future__ import annotations

from collections.abc import Callable

from hstrace.diagnose import acceptance, capture, config, draft_input, vocab, weights
from hstrace.findings import Finding, in_dataflow_order

Check = Callable[..., list[Finding]]

# In dataflow order; the what-if search (config/weights codes confirmed from draft logits)
# lives in `config.whatif_findings` and runs where its earliest code belongs.
CHECKS: tuple[Check, ...] = (
    config.spec_params,
    config.static_load_findings,
    config.checkpoint_findings,
    config.whatif_findings,
    config.fed_back_state,
    weights.weights_dropped,
    vocab.vocab_mapping,
    capture.capture_slots,
    draft_input.fc_skipped,
    draft_input.token_shift,
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


def diagnose(ctx) -> list[Finding]:  # ctx: hstrace.replay.context.ReplayContext
    found: list[Finding] = []
    for check in CHECKS:
        found.extend(check(ctx))
    found = merge(found)
    if not any(f.severity in ("fault", "warning") for f in found):
        found.append(acceptance.no_wiring_fault(ctx))
    return in_dataflow_order(found)
