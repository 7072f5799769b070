"""One small check per finding code, over the evidence of a replay.

config → weights → vocab map → target capture → draft input → draft logits → acceptance.
Each check takes the built `hstrace.replay.evidence.Evidence` (read-only) and returns findings
built from the registry (`hstrace.findings.finding`: the code's stage, severity and fix
template; `REGISTRY[code].checks` names the checks that may emit it). A check computes nothing
another check needs and writes nothing, so the order of `CHECKS` changes no result.
`diagnose` runs them all, merges findings that two checks reached for the same code (e.g. the
static audit and the what-if search), and ends with `no-wiring-fault` when nothing diverges;
the result (`ReplayResult`) puts the findings in dataflow order (`in_dataflow_order`, the one
place findings are sorted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hstrace.diagnose import (
    batch,
    cache,
    capture,
    config,
    draft_input,
    measurement,
    training_side,
    vocab,
    weights,
)
from hstrace.errors import HstraceError, debugging
from hstrace.findings import Finding
from hstrace.replay.evidence import Evidence
from hstrace.replay.result import Judgement
from hstrace.replay.unavailable import internal_failure, split_failures

Check = Callable[..., list[Finding]]

# In dataflow order (for reading; the result does not depend on it). The what-if search is
# evidence (`Evidence.whatif`); `config.whatif_findings` reports what it found.
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
    capture.hidden_corrupt,
    capture.slot_layout,
    capture.aux_order,
    capture.target_drift,
    capture.aux_layer_shift,
    capture.aux_layers_default,
    draft_input.fc_skipped,
    draft_input.token_shift,
    draft_input.chunk_boundary_token,
    cache.draft_kv_stale,
    training_side.teacher_norm,
    training_side.metric_overstates,
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


def run_check(ev: Evidence, check: Check, failed: dict[str, str]) -> list[Finding]:
    """One check; if it fails internally, `failed` says so and the replay goes on, but the
    judgement is incomplete (exit 3 unless another check found a fault). Bad input
    (`HstraceError`) still ends the replay with its one-line message."""
    try:
        return list(check(ev))
    except HstraceError:
        raise
    except Exception as exc:  # a bug in one check must not hide what the others found
        if debugging():
            raise
        failed.setdefault(f"check {check.__name__}", internal_failure(exc))
        return []


_RANK = {check: i for i, check in enumerate(CHECKS)}


def _rank(check: Check) -> tuple[int, str]:
    return _RANK.get(check, len(_RANK)), getattr(check, "__qualname__", repr(check))


def diagnose(ev: Evidence, checks: Sequence[Check] | None = None) -> Judgement:
    """`checks` (default `CHECKS`, read when called) on the evidence, in the order given."""
    by_check: list[tuple[tuple[int, str], list[Finding]]] = []
    failed: dict[str, str] = {}
    for check in CHECKS if checks is None else checks:
        by_check.append((_rank(check), run_check(ev, check, failed)))
    # Merged in the fixed order of the checks: which finding of a code keeps its summary and
    # fix is a rule (the earliest check in dataflow order), not the order they ran in.
    found = merge([f for _, fs in sorted(by_check, key=lambda x: x[0]) for f in fs])
    # "No wiring fault" is a claim about every check: never made when one of them, or a piece
    # of the evidence they read, failed internally (the result is "could not judge" instead).
    incomplete = failed or split_failures(ev.unavailable)[1]
    if not incomplete and not any(f.severity in ("fault", "warning") for f in found):
        found.extend(run_check(ev, training_side.no_wiring_fault, failed))
    return Judgement(found, dict(sorted(failed.items())))
