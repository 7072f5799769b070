"""Rules as data: the static checks on a drafter checkpoint as one table (`checkpoint.RULES`),
each rule a finding code, the engine versions it applies to (`packaging` specifiers, one set
per engine), a predicate, evidence and a fix. `hstrace check` and replay's config stage both
run it. Imports the drafter, findings and the engines' pure audit logic; nothing above them."""

from hstrace.rules.checkpoint import RULES, CheckpointFacts, run_static, static_findings
from hstrace.rules.table import Rule, RuleRun, run_rules
from hstrace.rules.versions import applies, covers, engines, format_applies_to, parse_applies_to

__all__ = [
    "RULES",
    "CheckpointFacts",
    "Rule",
    "RuleRun",
    "applies",
    "covers",
    "engines",
    "format_applies_to",
    "parse_applies_to",
    "run_rules",
    "run_static",
    "static_findings",
]
