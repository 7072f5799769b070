"""Renderings of a replay result: terminal (rich), Markdown, JSON. Each leads with the verdict:
the first divergence in dataflow order, its evidence and the fix."""

from hstrace.report.render import render_json, render_markdown, render_terminal

__all__ = ["render_json", "render_markdown", "render_terminal"]
