"""`hstrace disarm`: end the session `hstrace arm` opened in a running server."""

from __future__ import annotations

import click


@click.command(name="disarm")
@click.argument("server")
@click.option(
    "--json", "as_json", is_flag=True, help="Print {pid: whether a session was armed}, exit_code."
)
def disarm(server: str, as_json: bool) -> None:
    """End the recording session of a running server (every process closes its trace; the
    `hstrace arm` holding the session then finishes the trace and exits). A session armed with
    --hold-mb builds its held rows first, once the server has run no step for 50 ms (at most
    its --drain-wait, 30 s by default): this returns when they are written. SERVER: the
    control run dir or a pid of the server."""
    from hstrace.engines import control

    done = control.disarm(server)
    armed = sorted(pid for pid, was in done.items() if was)
    if as_json:
        import json

        click.echo(json.dumps({"disarmed": {str(k): v for k, v in done.items()}, "exit_code": 0}))
    elif armed:
        click.echo(f"disarmed processes {', '.join(map(str, armed))}")
    else:
        click.echo("no session was armed")
