"""`hstrace arm`: record a session from a running (dormant) server."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from hstrace.cli.options import out_option, parse_streams, stop_options, stream_options

from hstrace.engines.protocol import DEFAULT_HOLD_MB, DRAIN_WAIT_MAX_S, DRAIN_WAIT_S, QUIET_S


@click.command(name="arm")
@click.argument("server")
@out_option
@stop_options(
    requests_help="End the session once the first N requests recorded have finished.",
    duration_help="End the session after S seconds (enforced inside the server).",
)
@stream_options("Comma-separated streams (as hstrace record). Default: all but logits.")
@click.option(
    "--hold-mb",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="M",
    help="Hold each process's steps in memory, up to M MiB (default "
    f"{DEFAULT_HOLD_MB:g}), and build and write their rows only when the server is quiet (no "
    f"step for {QUIET_S * 1e3:g} ms: between bursts while armed, and at the disarm): while it "
    "serves, a step costs it only its copies. Past M MiB held, the steps are written as they "
    "come until the server is quiet again. The rows' CPU is not saved, it is spent while no "
    "request waits. Steps held are lost if the server dies first. vLLM (V1, CPU steps) holds; "
    "by default other hooks stream, and an M given where they cannot hold is refused.",
)
@click.option(
    "--stream",
    is_flag=True,
    help="Build each step's rows as it runs, on a thread beside serving (what a server that "
    "never idles pays least for): no step held in memory.",
)
@click.option(
    "--drain-wait",
    type=click.FloatRange(min=0, max=DRAIN_WAIT_MAX_S),
    default=None,
    metavar="S",
    help=f"A held session (the default): at the disarm, the held steps' rows wait for the server to idle (no "
    f"step for {QUIET_S * 1e3:g} ms), at most S seconds (default {DRAIN_WAIT_S:g}, at most "
    f"{DRAIN_WAIT_MAX_S:g}), before they are built beside the steps it serves; 0: built at "
    "once. The disarm returns once the trace is closed.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the session as JSON: out, engine, engine_version, processes, ended, wall_s, "
    "held (the processes that held their steps), ok, exit_code.",
)
def arm(
    server: str,
    out: Path,
    requests: int | None,
    duration: float | None,
    streams: str | None,
    on_full: str,
    hold_mb: float | None,
    stream: bool,
    drain_wait: float | None,
    as_json: bool,
) -> None:
    """Arm the hooks of a running server started dormant, and record until the limit, until
    `hstrace disarm SERVER`, or until this command stops (Ctrl-C): its connection is the
    session's lease, so a dead `hstrace arm` leaves no hooks armed.

    SERVER: the server's control run dir, or the pid of one of its processes. Only the user
    the server runs as (or root) may arm it.

    Exit 0 = the session was recorded and closed, 1 = it ended otherwise (a process gone),
    2 = bad input or usage."""
    from hstrace.engines import control

    if stream and hold_mb is not None:
        raise click.UsageError("--stream and --hold-mb: a session streams or holds, not both")
    if stream and drain_wait is not None:
        raise click.UsageError("--drain-wait applies to a held session, not with --stream")

    def started(session: control.Session) -> None:
        pids = ", ".join(
            f"{r.get('pid')} ({_short(r['title'])})" if r.get("title") else str(r.get("pid"))
            for r in session.armed
        )
        click.echo(f"hstrace: armed {session.engine} {session.version} processes {pids}", err=True)

    session = control.arm(
        server,
        out,
        sorted(parse_streams(streams)),
        on_full=on_full,
        requests=requests,
        duration_s=duration,
        armed=started,
        hold_mb=None if stream else (DEFAULT_HOLD_MB if hold_mb is None else hold_mb),
        drain_wait_s=drain_wait,
        hold_auto=not stream and hold_mb is None,
    )
    reasons = ", ".join(sorted(set(session.ended.values())))
    if as_json:
        import json

        doc = {
            "out": str(out),
            "engine": session.engine,
            "engine_version": session.version,
            "processes": [r.get("pid") for r in session.armed],
            "ended": {str(pid): why for pid, why in session.ended.items()},
            "wall_s": round(session.wall_s, 3),
            "held": session.held,
            "ok": session.ok,
            "exit_code": 0 if session.ok else 1,
        }
        click.echo(json.dumps(doc, indent=2))
    else:
        kind = "held" if session.held else "streamed"
        click.echo(
            f"recorded {session.wall_s:.1f} s from {session.engine} into {out} ({reasons}), {kind}"
        )
    if not session.ok:
        sys.exit(1)


def _short(title: str, width: int = 48) -> str:
    """A process title for one line (vLLM's API server's is its whole command line)."""
    return title if len(title) <= width else title[: width - 1] + "…"
