"""The outcome of a replay: a verdict, every finding, the metrics and the coverage.

`to_json()` is the machine-readable output documented in docs/replay-json.md; the renderers in
`hstrace.report` read only this object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hstrace.findings import CODES, Finding, in_dataflow_order

JSON_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Judgement:
    """What the checks made of the evidence: the findings, and the checks that failed
    internally (name -> reason), which the result lists as not checked."""

    findings: list[Finding]
    failed: dict[str, str] = field(default_factory=dict)


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

    def __post_init__(self) -> None:
        self.findings = in_dataflow_order(self.findings)

    @property
    def faults(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "fault"]

    @property
    def verdict(self) -> Finding:
        """The first divergence in dataflow order (faults before warnings); `no-wiring-fault`
        when nothing diverges."""
        if self.faults:
            return self.faults[0]
        warnings = [f for f in self.findings if f.severity == "warning"]
        if warnings:
            return warnings[0]
        clean = [f for f in self.findings if f.code == "no-wiring-fault"]
        if clean:
            return clean[0]
        return Finding("no-wiring-fault", CODES["no-wiring-fault"][1], severity="info")

    @property
    def exit_code(self) -> int:
        return 1 if self.faults else 0

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
