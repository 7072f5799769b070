"""The outcome of a replay: a verdict, every finding, the metrics and the coverage.

`to_json()` is the machine-readable output documented in docs/replay-json.md; the renderers in
`hstrace.report` read only this object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hstrace.errors import EXIT_CLEAN, EXIT_COULD_NOT_JUDGE, EXIT_FAULT
from hstrace.findings import CODES, Finding, in_dataflow_order
from hstrace.replay.impact import Impacts, verdict_phrase

JSON_SCHEMA_VERSION = 1


# The verdict's code when no fault was found but the judgement is incomplete. Not a finding
# code (nothing diverged): it says that hstrace could not judge, and why.
COULD_NOT_JUDGE = "could-not-judge"


@dataclass(frozen=True)
class Judgement:
    """What the checks made of the evidence: the findings, and the checks that failed
    internally (name -> `failed internally: Type: message`), which make the result
    incomplete."""

    findings: list[Finding]
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Incomplete:
    """The verdict of a judgement that found no fault but could not run everything: shaped
    like a `Finding` for the renderers (code, stage, severity, summary, fix, evidence)."""

    failed: dict[str, str]

    code: str = COULD_NOT_JUDGE
    stage: str = ""
    severity: str = "incomplete"
    applies_to: str | None = None

    @property
    def summary(self) -> str:
        return (
            "could not judge: "
            + "; ".join(failure_lines(self.failed))
            + ". No fault was found by the checks that ran, which is not a clean verdict"
        )

    @property
    def fix(self) -> str:
        return (
            "this is a bug in hstrace, not in your wiring: report it with the line above "
            "(HSTRACE_DEBUG=1 raises the failure with its traceback)"
        )

    @property
    def evidence(self) -> dict[str, Any]:
        return {"failed": dict(self.failed)}


@dataclass(frozen=True)
class NothingJudged:
    """The verdict when no fault was found and none of the traffic's stages could be judged
    (no capture next to a twin, no draft inputs, no draft logits): shaped like a `Finding`.
    Missing inputs, not a bug: the summary says what was missing and the fix what to give."""

    not_judged: list[dict[str, Any]]

    code: str = COULD_NOT_JUDGE
    stage: str = ""
    severity: str = "incomplete"
    applies_to: str | None = None

    @property
    def summary(self) -> str:
        whys = "; ".join(f"{n['what']}: {n['why']}" for n in self.not_judged)
        return (
            "could not judge: no stage of the served traffic could be judged (" + whys + "). "
            "Only the static audit ran, which is not a clean verdict"
        )

    @property
    def fix(self) -> str:
        return (
            "give what is missing: --target DIR (the served target model, so every request is "
            "judged against its forward) or --against TRAINING_DIR (the training data), and a "
            "trace with draft rows"
        )

    @property
    def evidence(self) -> dict[str, Any]:
        return {"not_judged": list(self.not_judged)}


def failure_lines(failed: dict[str, str]) -> list[str]:
    """One line per internal failure: `NAME failed internally: Type: message`."""
    return [f"{name} failed internally: {why}" for name, why in failed.items()]


@dataclass
class ReplayResult:
    findings: list[Finding]
    metrics: dict[str, Any] = field(default_factory=dict)
    coverage: dict[str, Any] = field(default_factory=dict)
    # The slot fingerprint matrices (serving x training, and slots x target layers).
    fingerprints: dict[str, Any] = field(default_factory=dict)
    # What was replayed against what (paths, engine, drafter).
    inputs: dict[str, Any] = field(default_factory=dict)
    # Checks that could not run, with the reason (missing stream, no target model, ...).
    skipped: dict[str, str] = field(default_factory=dict)
    # Checks or pieces of evidence that failed internally (name -> `Type: message`): the
    # judgement is incomplete, never `no-wiring-fault`.
    failed: dict[str, str] = field(default_factory=dict)
    # What each fault costs and its fix is worth (`replay.impact.impacts`, on `faults`).
    impact: Impacts | None = None
    # Per stage of the served traffic, what it was judged on (`Evidence.judged`); None: not
    # reported (a result built by hand, an MTP replay), and then never "nothing judged".
    judged: dict[str, Any] | None = None
    # The traffic's stages not judged, on which requests, and why (`Evidence.not_judged`).
    not_judged: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.failed or self.nothing_judged:  # "no wiring fault" is a claim about every check
            self.findings = [f for f in self.findings if f.code != "no-wiring-fault"]
        self.findings = in_dataflow_order(self.findings)

    @property
    def nothing_judged(self) -> bool:
        """No stage of the served traffic was judged (only the static audit ran)."""
        return self.judged is not None and not self.judged

    @property
    def complete(self) -> bool:
        return not self.failed

    @property
    def faults(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "fault"]

    @property
    def verdict(self) -> Finding | Incomplete | NothingJudged:
        """The first divergence in dataflow order (faults before warnings); `could-not-judge`
        (`Incomplete`) when no fault was found and a check failed internally, or
        (`NothingJudged`) when no stage of the traffic could be judged; `no-wiring-fault`
        when nothing diverges."""
        if self.faults:
            return self.faults[0]
        if self.failed:
            return Incomplete(dict(self.failed))
        if self.nothing_judged:
            return NothingJudged(list(self.not_judged))
        warnings = [f for f in self.findings if f.severity == "warning"]
        if warnings:
            return warnings[0]
        clean = [f for f in self.findings if f.code == "no-wiring-fault"]
        if clean:
            return clean[0]
        return Finding("no-wiring-fault", CODES["no-wiring-fault"][1], severity="info")

    def impact_of(self, f: Finding) -> tuple[dict[str, Any] | None, str | None]:
        """(the impact of fixing fault `f` alone, why there is none)."""
        faults = self.faults
        if self.impact is None or f not in faults:
            return None, None
        i = next(j for j, g in enumerate(faults) if g is f)
        if i >= len(self.impact.by_finding):
            return None, None
        return self.impact.by_finding[i], self.impact.unavailable[i]

    def impact_line(self, f: Any) -> str | None:
        """The verdict's sentence on what fixing `f` is worth (None: no impact computed)."""
        got, _ = self.impact_of(f) if isinstance(f, Finding) else (None, None)
        return verdict_phrase(got)

    @property
    def exit_code(self) -> int:
        """1 a fault (even when incomplete), 3 could not judge (a failure inside, or nothing of
        the traffic judged), 0 no fault."""
        if self.faults:
            return EXIT_FAULT
        return EXIT_COULD_NOT_JUDGE if self.failed or self.nothing_judged else EXIT_CLEAN

    @property
    def incomplete_lines(self) -> list[str]:
        """`judgement incomplete: NAME failed internally: Type: message`, one per failure."""
        return [f"judgement incomplete: {line}" for line in failure_lines(self.failed)]

    def to_json(self) -> dict[str, Any]:
        v = self.verdict
        return {
            "schema_version": JSON_SCHEMA_VERSION,
            "verdict": {
                "code": v.code,
                "stage": v.stage,
                "severity": v.severity,
                "summary": v.summary,
                "fix": v.fix,
                "impact_line": self.impact_line(v),
            },
            "findings": [_jsonable(self._finding_json(f)) for f in self.findings],
            **(
                {"impact_all": _jsonable(self.impact.all)}
                if self.impact is not None and self.impact.all is not None
                else {}
            ),
            "metrics": _jsonable(self.metrics),
            "coverage": _jsonable(self.coverage),
            "fingerprints": _jsonable(self.fingerprints),
            "inputs": _jsonable(self.inputs),
            "skipped": dict(self.skipped),
            **({"judged": _jsonable(self.judged)} if self.judged is not None else {}),
            "not_judged": _jsonable(self.not_judged),
            "complete": self.complete,
            "failed": dict(self.failed),
            "exit_code": self.exit_code,
        }

    def _finding_json(self, f: Finding) -> dict[str, Any]:
        out = f.to_json()
        if f.severity != "fault" or self.impact is None:
            return out
        got, why = self.impact_of(f)
        out["impact"] = {**got, "fix": f.fix} if got is not None else None
        if got is None:
            out["impact_unavailable"] = why or "not computed"
        return out


def _jsonable(x: Any) -> Any:
    """Plain JSON types only (numpy scalars and tuples come out of the checks)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item) and getattr(x, "ndim", 1) == 0:
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, float) and x != x:  # NaN is not JSON
        return None
    return x
