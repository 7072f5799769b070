"""`hstrace replay`: replay a trace against training tensors and name the first divergence."""

from __future__ import annotations

from pathlib import Path

import click


@click.command(name="replay")
@click.argument("trace", type=click.Path(path_type=Path))
@click.option(
    "--against",
    type=click.Path(path_type=Path),
    help="Training dump dir (speculators / SpecForge), or a second trace. Without it, requests "
    "are judged against the target's forward on the served tokens (--target, else the trace's).",
)
@click.option(
    "--drafter",
    type=click.Path(path_type=Path),
    help="Drafter checkpoint dir. Default: the one named in the trace's static audit.",
)
@click.option(
    "--target",
    type=click.Path(path_type=Path),
    help="HF target model dir: layer fingerprints, the teacher test, and a reference twin "
    "(its forward on the served tokens) for every request no training sample matches. "
    "Default: the trace's, when it exists here.",
)
@click.option(
    "--salt-file",
    type=click.Path(path_type=Path),
    help="For a bundle made with --redact ids: the salt it was made with (default: TRACE.salt "
    "beside it). Token ids are recovered with it; without it such a bundle cannot be replayed.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the result as JSON (docs/replay-json.md)."
)
@click.option(
    "--markdown",
    "markdown_file",
    type=click.Path(path_type=Path),
    help="Also write the report as Markdown to FILE.",
)
def replay(
    trace: Path,
    against: Path | None,
    drafter: Path | None,
    target: Path | None,
    salt_file: Path | None,
    as_json: bool,
    markdown_file: Path | None,
) -> int:
    """Replay TRACE against training tensors (or another trace) and name the first divergence.

    Requests no training sample matches (or every request, without --against) are judged
    against the target's forward on their served tokens when the target is at hand; what could
    not be judged is listed, and why.

    Exit 0 = no fault, 1 = fault, 2 = bad input, 3 = could not judge (a check failed
    internally: named in one line, never a clean verdict; or no stage of the traffic could be
    judged)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from hstrace.pipelines import replay_trace
    from hstrace.report import render_json, render_markdown, render_terminal

    err = Console(stderr=True)
    show = err.is_terminal and not as_json
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=err,
        disable=not show,
        transient=True,
    ) as bar:
        tasks: dict[str, int] = {}

        def progress(label: str, n: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(f"{label} (tokens)", total=None)
            bar.advance(tasks[label], n)

        result = replay_trace(
            trace,
            against,
            drafter_path=drafter,
            target_path=target,
            progress=progress,
            salt_file=salt_file,
        )
    if markdown_file is not None:
        try:
            markdown_file.write_text(render_markdown(result), encoding="utf-8")
        except OSError as exc:
            from hstrace.errors import HstraceError

            raise HstraceError(f"cannot write {markdown_file}: {exc.strerror}") from exc
    if as_json:
        click.echo(render_json(result))
    else:
        render_terminal(result, Console())
    click.get_current_context().exit(result.exit_code)
