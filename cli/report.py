"""`hstrace report TRACE [--against DIR] --html OUT.html`: a self-contained page with plots."""

from __future__ import annotations

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
def report(
    trace: str, html_out: str, against: str | None, drafter: str | None, target: str | None
) -> int:
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
        from hstrace.pipelines import replay

        result = replay(
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
            exit_code = 1 if replay_json["verdict"].get("severity") == "fault" else 0
    p = write_report_html(tr, out, replay_json)
    verdict = replay_json["verdict"]["code"] if replay_json else "not replayed"
    click.echo(f"wrote {p} ({p.stat().st_size} bytes); verdict: {verdict}")
    return exit_code
