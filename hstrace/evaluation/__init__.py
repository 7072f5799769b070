"""The drafter on the training tensors (`hstrace check --against`, and replay's reading of a
SpecForge `norm_output`): accuracy with its conventions, slot findings, the norm_output
resolution. Below replay and the CLI; imports the drafter, training, metrics and findings."""

from hstrace.evaluation.accuracy import CONVENTIONS, SHORT_CONVENTIONS, training_findings
from hstrace.evaluation.norm_output import resolve_norm_output

__all__ = ["CONVENTIONS", "SHORT_CONVENTIONS", "resolve_norm_output", "training_findings"]
