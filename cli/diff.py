"""`hstrace diff A B [--json]`: the first differing stream in dataflow order (hstrace.diff)."""

from __future__ import annotations

import json

import click


@click.command(
    name="diff",
    help="Compare two traces stream by stream and report the first difference. Exit 0 = "
    "identical within tolerance, 1 = they differ, 2 = bad input.",
)
@click.argument("trace_a", type=click.Path())
@click.argument("trace_b", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--rank", default=0, show_default=True, help="Which rank of each trace to compare.")
@click.option(
    "--ulps",
    default=2.0,
    show_default=True,
    help="Float tolerance, in units of the compute dtype's unit roundoff (2 = one ulp per element).",
)
def diff(trace_a: str, trace_b: str, as_json: bool, rank: int, ulps: float) -> int:
    from hstrace.bundle.pack import open_checked
    from hstrace.diff import diff_traces
    from hstrace.errors import HstraceError
    from hstrace.report.diff import render_text

    if ulps <= 0:
        raise HstraceError(f"--ulps {ulps}: must be positive")
    ta, tb = open_checked(trace_a), open_checked(trace_b)
    res = diff_traces(ta, tb, rank=rank, ulps=ulps)
    if as_json:
        click.echo(json.dumps(res.to_json(), indent=2))
    else:
        click.echo(render_text(res))
    return res.exit_code
