"""`hstrace show TRACE [--json]`: what a trace holds, at a glance."""

from __future__ import annotations

import json

import click


@click.command(name="show")
@click.argument("trace_path", metavar="TRACE", type=click.Path())
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the summary as JSON (keys: docs/trace-format.md).",
)
def show(trace_path: str, as_json: bool) -> None:
    """Summarise a trace: engine, ranks, steps, requests, acceptance. Exit 0, or 2 for
    something that is not a readable trace (one line)."""
    from hstrace.trace import open_trace, summarize

    with open_trace(trace_path) as trace:
        summary = summarize(trace)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    from hstrace.report import render_summary_terminal

    render_summary_terminal(summary)
