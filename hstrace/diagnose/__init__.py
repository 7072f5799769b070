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

import importlib
from collections.abc import Callable, Sequence

from hstrace.errors import unless_internal_failure
from hstrace.findings import REGISTRY, Finding
from hstrace.replay.evidence import Evidence
from hstrace.replay.result import Judgement
from hstrace.replay.unavailable import internal_failure, split_failures

Check = Callable[..., list[Finding]]

# The rule table (`hstrace.rules`, registry name "rules.checkpoint") runs in a replay as this
# check; the closing check runs only when nothing diverges.
RULE_RUNNER = "diagnose.config:checkpoint_findings"
CLOSING = "diagnose.training_side:no_wiring_fault"


def _name(check: Check) -> str:
    return f"{check.__module__.removeprefix('hstrace.')}:{check.__name__}"


def _resolve(name: str) -> Check:
    module, _, fn = name.partition(":")
    return getattr(importlib.import_module(f"hstrace.{module}"), fn)


def _registered() -> tuple[Check, ...]:
    """Every diagnose check the registry names, in the registry's (dataflow) order."""
    names: dict[str, None] = {}
    for code in REGISTRY.values():
        for name in code.checks:
            name = RULE_RUNNER if name == "rules.checkpoint" else name
            # the closing checks (EAGLE-3's, the MTP replay's) run only when nothing diverges
            if name.startswith("diagnose.") and not name.endswith(":no_wiring_fault"):
                names[name] = None
    return tuple(_resolve(n) for n in names)


# The checks a replay runs: the ones `hstrace.findings.REGISTRY` names (adding a code with its
# check needs no edit here). Their order changes no result (`merge`). The what-if search is
# evidence (`Evidence.whatif`); `config.whatif_findings` reports what it found.
CHECKS: tuple[Check, ...] = _registered()


def _precedence(code: str, check: Check) -> int:
    """Where `check` stands among the checks that may emit `code` (`Code.checks`)."""
    name = _name(check)
    names = [RULE_RUNNER if n == "rules.checkpoint" else n for n in REGISTRY[code].checks]
    return names.index(name) if name in names else len(names)


def merge(found: list[tuple[Check, Finding]]) -> list[Finding]:
    """One finding per code: of the checks that found it, the first in the code's precedence
    (`REGISTRY[code].checks`) keeps its summary and fix, later ones add evidence; a fault
    anywhere makes it a fault. The codes come out in the order of `CHECKS` (the first check
    that found each), whatever order the checks ran in."""
    rank = {c: i for i, c in enumerate(CHECKS)}
    by_code: dict[str, tuple[int, int, Finding]] = {}
    first: dict[str, tuple[int, int]] = {}
    for i, (check, f) in enumerate(found):
        at = (rank.get(check, len(rank)), i)
        first[f.code] = min(first.get(f.code, at), at)
        mine = (_precedence(f.code, check), i, f)
        if f.code not in by_code or mine[:2] < by_code[f.code][:2]:
            by_code[f.code] = mine
    out = []
    for code in sorted(by_code, key=lambda c: first[c]):
        kept = by_code[code][2]
        for _, f in sorted(
            ((c, f) for c, f in found if f.code == code and f is not kept),
            key=lambda x: _precedence(code, x[0]),
        ):
            for k, v in f.evidence.items():
                kept.evidence.setdefault(k, v)
            if f.severity == "fault" and kept.severity != "fault":
                kept.severity = "fault"
        out.append(kept)
    return out


def run_check(ev: Evidence, check: Check, failed: dict[str, str]) -> list[Finding]:
    """One check; if it fails internally, `failed` says so and the replay goes on, but the
    judgement is incomplete (exit 3 unless another check found a fault). Bad input
    (`HstraceError`) still ends the replay with its one-line message."""
    # a bug in one check must not hide what the others found
    found = unless_internal_failure(
        lambda: list(check(ev)),
        lambda e: failed.setdefault(f"check {check.__name__}", internal_failure(e)),
    )
    return found or []


def diagnose(ev: Evidence, checks: Sequence[Check] | None = None) -> Judgement:
    """`checks` (default `CHECKS`) on the evidence, in the order given; then `no-wiring-fault`
    when nothing diverges. The findings come out one per code, unordered: the result puts them
    in dataflow order (`hstrace.findings.in_dataflow_order`)."""
    from hstrace.diagnose import training_side

    failed: dict[str, str] = {}
    found = [
        (c, f) for c in (CHECKS if checks is None else checks) for f in run_check(ev, c, failed)
    ]
    merged = merge(found)
    # "No wiring fault" is a claim about every check: never made when one of them, or a piece
    # of the evidence they read, failed internally (the result is "could not judge" instead).
    incomplete = failed or split_failures(ev.unavailable)[1]
    if not incomplete and not any(f.severity in ("fault", "warning") for f in merged):
        merged.extend(run_check(ev, training_side.no_wiring_fault, failed))
    return Judgement(merged, dict(sorted(failed.items())))
