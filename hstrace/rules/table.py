"""A rule as data: a finding code, the engine versions it applies to, a predicate over the facts
of a checkpoint, and how to word the finding (summary, evidence, fix). `hstrace check` and
replay's config stage run the same table (`hstrace.rules.checkpoint.RULES`).

A rule's predicate returns what it matched (anything truthy: the keys, the flag, the state) or
something falsy for "no finding"; summary, evidence and fix are strings or functions of
(facts, match). `many=True`: the match is a list and each item is one finding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from hstrace.errors import HstraceError, debugging, error_line
from hstrace.findings import Finding, finding
from hstrace.rules.versions import AppliesTo, covers, format_applies_to

F = TypeVar("F")

Text = str | Callable[[Any, Any], str]


def _text(t: Text, facts: Any, match: Any) -> str:
    return t if isinstance(t, str) else t(facts, match)


@dataclass(frozen=True)
class Rule(Generic[F]):
    name: str  # unique in its table; says which rule made a finding
    code: str  # a code of `hstrace.findings.REGISTRY` (that names "rules.checkpoint" a check)
    when: Callable[[F], Any]
    summary: Text
    evidence: Callable[[F, Any], dict[str, Any]]
    fix: Text
    severity: str = "fault"
    applies_to: AppliesTo = None  # None: every engine and version
    # A finding that says what to verify before serving, not a verdict on a served trace
    # (`hstrace check` shows it; replay judges the same question from the recorded data).
    advisory: bool = False
    many: bool = False

    def covers(self, engine: str, version: str) -> bool:
        return covers(self.applies_to, engine, version)

    def findings(self, facts: F) -> list[Finding]:
        match = self.when(facts)
        if not match:
            return []
        matches = list(match) if self.many else [match]
        return [
            finding(
                self.code,
                _text(self.summary, facts, m),
                self.evidence(facts, m),
                fix=_text(self.fix, facts, m),
                severity=self.severity,
                applies_to=format_applies_to(self.applies_to),
            )
            for m in matches
        ]


@dataclass
class RuleRun:
    """What a table gave on one set of facts: `found` (rule, finding) in table order, and the
    findings of rules outside the engine version judged for (`other_versions`), and the rules
    that raised (`failed`: `rule NAME` -> `Type: message`): the run is then incomplete, a bug
    in hstrace, never a clean result."""

    found: list[tuple[Rule, Finding]]
    other_versions: list[tuple[Rule, Finding]]
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def findings(self) -> list[Finding]:
        return [f for _, f in self.found]

    @property
    def rules(self) -> list[str]:
        return [r.name for r, _ in self.found]


def run_rules(
    rules: Iterable[Rule[F]],
    facts: F,
    *,
    advisory: bool = False,
    engine: str | None = None,
    version: str | None = None,
) -> RuleRun:
    """Every rule on `facts`, in table order. `advisory=False` leaves the advisory rules out;
    with `engine` (and `version`), a rule whose `applies_to` does not cover them goes to
    `other_versions` instead of `found`. A rule that raises (not bad input: `HstraceError`
    still ends the run) goes to `failed`; the others still run."""
    found: list[tuple[Rule, Finding]] = []
    other: list[tuple[Rule, Finding]] = []
    failed: dict[str, str] = {}
    for rule in rules:
        if rule.advisory and not advisory:
            continue
        try:
            made = [(rule, f) for f in rule.findings(facts)]
        except HstraceError:
            raise
        except Exception as exc:  # a bug in one rule must not read as "no finding"
            if debugging():
                raise
            failed[f"rule {rule.name}"] = error_line(exc)
            continue
        if engine is None or rule.covers(engine, version or ""):
            found += made
        else:
            other += made
    return RuleRun(found, other, failed)
