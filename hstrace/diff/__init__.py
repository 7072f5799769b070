"""`hstrace diff`: compare two traces stream by stream, first difference in dataflow order."""

from hstrace.diff.compare import STAGES, Difference, DiffResult, diff_traces
from hstrace.diff.tolerance import Tolerance

__all__ = ["STAGES", "DiffResult", "Difference", "Tolerance", "diff_traces"]
# Its text rendering lives with the other renderers: hstrace.report.diff.render_text.
