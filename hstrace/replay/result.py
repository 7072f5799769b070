"""The outcome of a replay: a verdict, every finding, the metrics and the coverage.

`to_json()` is the machine-readable output documented in docs/replay-json.md; the renderers in
`hstrace.report` read only this object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hstrace.errors import EXIT_CLEAN, EXIT_COULD_NOT_JUDGE, EXIT_FAULT
from hstrace.findings import CODES, Finding, in_dataflow_order

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

    def __post_init__(self) -> None:
        if self.failed:  # "no wiring fault" is a claim about every check
            self.findings = [f for f in self.findings if f.code != "no-wiring-fault"]
        self.findings = in_dataflow_order(self.findings)

    @property
    def complete(self) -> bool:
        return not self.failed

    @property
    def faults(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "fault"]

    @property
    def verdict(self) -> Finding | Incomplete:
        """The first divergence in dataflow order (faults before warnings); `could-not-judge`
        (`Incomplete`) when no fault was found and a check failed internally; `no-wiring-fault`
        when nothing diverges."""
        if self.faults:
            return self.faults[0]
        if self.failed:
            return Incomplete(dict(self.failed))
        warnings = [f for f in self.findings if f.severity == "warning"]
        if warnings:
            return warnings[0]
        clean = [f for f in self.findings if f.code == "no-wiring-fault"]
        if clean:
            return clean[0]
        return Finding("no-wiring-fault", CODES["no-wiring-fault"][1], severity="info")

    @property
    def exit_code(self) -> int:
        """1 a fault (even when incomplete), 3 could not judge, 0 no fault."""
        if self.faults:
            return EXIT_FAULT
        return EXIT_COULD_NOT_JUDGE if self.failed else EXIT_CLEAN

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
            },
            "findings": [_jsonable(f.to_json()) for f in self.findings],
            "metrics": _jsonable(self.metrics),
            "coverage": _jsonable(self.coverage),
            "fingerprints": _jsonable(self.fingerprints),
            "inputs": _jsonable(self.inputs),
            "skipped": dict(self.skipped),
            "complete": self.complete,
            "failed": dict(self.failed),
            "exit_code": self.exit_code,
        }


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
