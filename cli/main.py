"""The `hstrace` command: a click group whose subcommands load lazily.

Each subcommand lives in its own module (`hstrace.cli.<name>`) and exposes a click command
named like the module. Loading lazily keeps `hstrace --help` fast and lets the core work when an
optional dependency of one command (SGLang, transformers) is missing.

Exit codes, for every command: 0 = ran, no fault found; 1 = a divergence / fault was found (or,
for `record`, the recording failed); 2 = bad input or usage (one line on stderr, never a
traceback); 3 = could not judge (a check failed internally: a bug in hstrace, named in one line;
`replay`, `check`, `report --against`, `bundle --against`). Set HSTRACE_DEBUG=1 to see the
traceback behind an error.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from hstrace import __version__
from hstrace.errors import HstraceError

# name -> one-line help; the module hstrace.cli.<name> defines the command object `<name>`.
COMMANDS: dict[str, str] = {
    "record": "Run a server (or the reference engine) with hstrace's hooks and record a trace.",
    "arm": "Arm the hooks of a running server started dormant, and record a session.",
    "disarm": "End the recording session of a running server.",
    "show": "Summarise a trace: engine, ranks, steps, requests, acceptance.",
    "check": "Load a drafter checkpoint and report static wiring problems.",
    "replay": "Replay a trace against training tensors and name the first divergence.",
    "diff": "Compare two traces stream by stream and report the first difference.",
    "bundle": "Pack a trace (or part of it) into one zip for a bug report.",
    "report": "Write a self-contained HTML report with plots.",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        try:
            module = importlib.import_module(f"hstrace.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"hstrace.cli.{name}":
                return _not_built(name)
            raise
        return getattr(module, name.replace("-", "_"))


def _not_built(name: str) -> click.Command:
    @click.command(name=name, help=COMMANDS[name] + " (not available in this build)")
    def missing() -> None:
        raise HstraceError(f"'hstrace {name}' is not available in this build")

    return missing


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Exit codes, every command: 0 = no fault found, 1 = a fault found, 2 = bad input or "
    "usage (one line on stderr), 3 = could not judge (a check failed internally; named).",
)
@click.version_option(__version__, prog_name="hstrace")
def cli() -> None:
    """Record what an EAGLE-3 drafter received in serving, replay it against training, and
    name the first place where the two diverge."""


def usage_line(exc: click.ClickException) -> str:
    """A click usage error as one line: `hstrace: error: COMMAND: message (COMMAND --help)`."""
    message = " ".join(exc.format_message().split()).rstrip(".")
    ctx = getattr(exc, "ctx", None)
    if ctx is None:
        return f"hstrace: error: {message}"
    path = ctx.command_path or "hstrace"
    return f"hstrace: error: {path}: {message} (see '{path} --help')"


def main(argv: list[str] | None = None) -> None:
    """Console entry point: maps errors to exit codes instead of tracebacks."""
    try:
        rc = cli.main(args=argv, prog_name="hstrace", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("hstrace: aborted", err=True)
        sys.exit(2)
    except click.ClickException as exc:  # usage errors: one line, exit 2
        click.echo(usage_line(exc), err=True)
        sys.exit(2)
    except HstraceError as exc:
        if os.environ.get("HSTRACE_DEBUG"):
            raise
        click.echo(f"hstrace: error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("hstrace: interrupted", err=True)
        sys.exit(130)
    except MemoryError:
        if os.environ.get("HSTRACE_DEBUG"):
            raise
        click.echo(
            "hstrace: error: out of memory: an input declares more data than this machine "
            "can hold (corrupt, or too large for it)",
            err=True,
        )
        sys.exit(2)
    except Exception as exc:  # the last line of defence: a user never sees a traceback
        if os.environ.get("HSTRACE_DEBUG"):
            raise
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        click.echo(
            f"hstrace: error: unexpected {type(exc).__name__}: {first} (if the input is valid "
            "this is a bug in hstrace; HSTRACE_DEBUG=1 shows the traceback)",
            err=True,
        )
        sys.exit(2)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
