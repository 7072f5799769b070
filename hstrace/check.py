"""Moved (issue 13 items 1 and 4): `hstrace/check.py` is split into rooms below the judge.

Transitional re-exports while the replay/diagnose rooms move their imports; nothing new
imports this module, and it goes once nothing does:
  static rules (a table)       hstrace.rules (RULES, run_static, static_findings, applies)
  layer-id convention          hstrace.drafter.dialects.DIALECT_CONVENTION
  SpecForge norm_output        hstrace.drafter.norm_output; resolution: hstrace.evaluation
  accuracy on training data    hstrace.evaluation (training_findings, CONVENTIONS, ...)
  target embedding             hstrace.target_io.load_target_embedding
"""

from hstrace.drafter.dialects import DIALECT_CONVENTION
from hstrace.drafter.norm_output import (
    NORM_OUTPUT_READINGS,
    POST_879,
    PRE_879,
    norm_output_flags,
)
from hstrace.evaluation.accuracy import CONVENTIONS, SHORT_CONVENTIONS, training_findings
from hstrace.evaluation.norm_output import resolve_norm_output
from hstrace.rules import applies, static_findings
from hstrace.target_io import load_target_embedding

__all__ = [
    "CONVENTIONS",
    "DIALECT_CONVENTION",
    "NORM_OUTPUT_READINGS",
    "POST_879",
    "PRE_879",
    "SHORT_CONVENTIONS",
    "applies",
    "load_target_embedding",
    "norm_output_flags",
    "resolve_norm_output",
    "static_findings",
    "training_findings",
]
