"""Markdown cells and rows, escaped the same way for every Markdown renderer.

GitHub splits a table cell at every bare `|`, even inside backticks (the "max |logprob diff|"
row of REPORT.md lost its value that way), and a newline ends the row: every cell goes through
`cell`, every row through `row`.
"""

from __future__ import annotations

from typing import Any


def cell(text: Any) -> str:
    """One line of Markdown: `|` escaped, whitespace runs (newlines included) folded."""
    return " ".join(str(text).replace("|", "\\|").split())


def row(*cells: Any) -> str:
    """One Markdown table row, every cell escaped."""
    return "| " + " | ".join(cell(c) for c in cells) + " |"
