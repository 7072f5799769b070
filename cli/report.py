"""`hstrace report TRACE [--against DIR] --html OUT.html`: a self-contained page with plots."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command(name="report", help="Write a self-contained HTML report with plots.")
@click.argument("trace", type=click.Path())
@click.option("--html", "html_out", required=True, type=click.Path(), help="The page to write.")
@click.option(
    "--against",
    type=click.Path(),
    default=None,
    help="Training dir: replay it and show the verdict.",
)
@click.option(
    "--drafter", type=click.Path(), default=None, help="Drafter checkpoint (default: the trace's)."
)
@click.option(
    "--target",
    type=click.Path(),
    default=None,
    help="HF target dir for layer fingerprints (default: the trace's).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print what was written as JSON: html, bytes, verdict, complete, failed, exit_code.",
)
def report(
    trace: str,
    html_out: str,
    against: str | None,
    drafter: str | None,
    target: str | None,
    as_json: bool,
) -> int:
    """Write a self-contained HTML page for TRACE; with --against, the replay's verdict on it.
    Exit 0 = no fault (or not replayed), 1 = fault, 2 = bad input, 3 = could not judge."""
    from hstrace.bundle.pack import open_checked
    from hstrace.errors import HstraceError
    from hstrace.html import write_report_html

    out = Path(html_out)
    if not out.parent.exists():
        raise HstraceError(f"{out.parent}: output directory does not exist")
    replay_json = None
    exit_code = 0
    tr = open_checked(trace)
    # The page plots a few columns only; summarising first runs the reader's checks (token ids,
    # counts against offsets) so a corrupt trace is refused rather than drawn.
    from hstrace.trace import summarize

    summarize(tr)
    if against:
        from hstrace.pipelines import replay_trace

        result = replay_trace(
            Path(trace),
            Path(against),
            Path(drafter) if drafter else None,
            Path(target) if target else None,
        )
        replay_json = result.to_json()
        exit_code = result.exit_code
    elif Path(trace).is_file():
        # A bundle carries the verdict computed when it was made: show it, and say where from.
        from hstrace.bundle import bundle_info

        info = bundle_info(trace)
        if info and info["manifest"].get("replay"):
            replay_json = dict(info["manifest"]["replay"])
            replay_json["source"] = (
                f"the bundle's manifest (replayed when the bundle was made: {info['reproduce']})"
            )
            exit_code = replay_json.get("exit_code")
            if exit_code not in (0, 1, 3):  # a bundle made before exit 3 existed
                exit_code = 1 if replay_json["verdict"].get("severity") == "fault" else 0
    p = write_report_html(tr, out, replay_json)
    verdict = replay_json["verdict"]["code"] if replay_json else None
    failed = dict((replay_json or {}).get("failed") or {})
    if as_json:
        doc = {
            "html": str(p),
            "bytes": p.stat().st_size,
            "verdict": verdict,
            "complete": not failed,
            "failed": failed,
            "verdict_source": (replay_json or {}).get("source"),
            "exit_code": exit_code,
        }
        click.echo(json.dumps(doc, indent=2))
        return exit_code
    click.echo(f"wrote {p} ({p.stat().st_size} bytes); verdict: {verdict or 'not replayed'}")
    for name, why in failed.items():
        click.echo(f"judgement incomplete: {name} failed internally: {why} (exit {exit_code})")
    return exit_code
