"""Options shared by the commands that record (`hstrace record`, `hstrace arm`): each declared and
validated once here, so the two commands cannot drift apart on a name, a type or a range. Each
decorator goes where the option stands in its command's `--help`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from hstrace.engines.base import DEFAULT_STREAMS, STREAMS

F = TypeVar("F", bound=Callable[..., Any])


def out_option(fn: F) -> F:
    """`--out PATH`: the trace to create (a command never overwrites one)."""
    return click.option(
        "--out",
        required=True,
        type=click.Path(path_type=Path),
        help="Trace to create (Zarr v3 dir).",
    )(fn)


def stream_options(streams_help: str) -> Callable[[F], F]:
    """`--record STREAMS` (read by `parse_streams`) and `--on-full block|drop`."""

    def apply(fn: F) -> F:
        fn = click.option(
            "--on-full",
            type=click.Choice(["block", "drop"]),
            default="block",
            show_default=True,
            help="When the writer falls behind: stall serving, or drop steps (counted).",
        )(fn)
        return click.option("--record", "streams", default=None, help=streams_help)(fn)

    return apply


def parse_streams(value: str | None) -> frozenset[str]:
    """`--record a,b,...`: known stream names, or `all`; None = every stream but logits."""
    if value is None:
        return DEFAULT_STREAMS
    chosen = frozenset(s.strip() for s in value.split(",") if s.strip())
    if "all" in chosen:
        return frozenset(STREAMS)
    unknown = chosen - set(STREAMS)
    if unknown:
        raise click.BadParameter(
            f"unknown stream(s) {', '.join(sorted(unknown))}; known: {', '.join(STREAMS)}, all"
        )
    return chosen


def stop_options(requests_help: str, duration_help: str) -> Callable[[F], F]:
    """`--requests N` (N >= 1) and `--duration S` (S > 0): when a recording ends by itself,
    passed to the command as `requests` and `duration` (None = no such limit).

    The same two limits, two mechanisms, because the two commands stand in different places:
    - `hstrace record --serve` owns the server: it started it and will stop it. It watches from
      outside, polling the engine's own Prometheus counter of finished requests (every request
      the server finished, those `--sample-every` leaves unrecorded included) and its own clock
      (`hstrace.engines.server.ServeUntil`), then shuts the server down and closes the trace.
    - `hstrace arm` joins a server that keeps serving after the session. The limits travel to
      every hooked process with the arm message and are enforced there (`hstrace.hooks.control`:
      a timer; the recorder's step taps count the first N requests the session recorded), so
      a session whose client never disarms still ends; only the hooks disarm.
    Building `record --serve` on `arm` (issue 29 item 1: start the server dormant, arm it at
    once) would change what `--requests` counts (the first N requests recorded, each waited for
    to its end, not every request the server finished) and what the passive live test asserts;
    it is not done here."""

    def apply(fn: F) -> F:
        fn = click.option(
            "--duration",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            help=duration_help,
        )(fn)
        return click.option(
            "--requests", type=click.IntRange(min=1), default=None, help=requests_help
        )(fn)

    return apply
