"""Every rendering of a result, in one place.

- `replay`: a `ReplayResult` as terminal (rich), Markdown, JSON; each leads with the verdict
  (the first divergence in dataflow order, its evidence and the fix).
- `summary`: a trace summary (`hstrace show`) on the terminal.
- `acceptance`: acceptance by draft position, both conventions named, for terminal, Markdown
  and HTML (`hstrace show`, `hstrace report`, a bundle's REPORT.md).
- `diff`: a `DiffResult` as plain text.

The HTML page (`hstrace.html`) draws its acceptance table with `acceptance.html_table`.
"""

from hstrace.report.replay import render_json, render_markdown, render_terminal
from hstrace.report.summary import render_summary_terminal

__all__ = ["render_json", "render_markdown", "render_summary_terminal", "render_terminal"]
