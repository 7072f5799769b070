"""Errors that mean "the input is bad", as opposed to a bug in hstrace.

The CLI turns any `HstraceError` into one line on stderr and exit code 2; nothing else may
reach the user as a traceback for bad input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class HstraceError(Exception):
    """Bad input or usage: a corrupt trace, a wrong checkpoint, mismatched shapes, an unsupported
    engine version. The message is shown to the user as is, so make it one self-contained line
    that names the offending path or value."""


class TraceError(HstraceError):
    """A trace store that cannot be read: missing, corrupt, truncated, or of an unknown schema."""


class CheckpointError(HstraceError):
    """A drafter checkpoint that cannot be loaded or understood."""


class TrainingDataError(HstraceError):
    """A training-data directory whose layout is unknown or whose files are corrupt."""


class EngineError(HstraceError):
    """A serving engine that hstrace cannot hook: missing, or a version without a patch table."""


# Exit codes of every command (README, "Every command"): 0 no fault found, 1 a fault found,
# 2 bad input or usage, 3 could not judge (a check failed internally: a bug in hstrace).
EXIT_CLEAN, EXIT_FAULT, EXIT_BAD_INPUT, EXIT_COULD_NOT_JUDGE = 0, 1, 2, 3


def error_line(exc: BaseException) -> str:
    """An internal failure as `Type: message`, on one line (the message's first line, at most
    300 characters): how every output names a check that raised."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def debugging() -> bool:
    """`HSTRACE_DEBUG=1`: an internal failure raises with its traceback instead of being noted."""
    import os

    return bool(os.environ.get("HSTRACE_DEBUG"))


def unless_internal_failure(
    compute: Callable[[], T], failed: Callable[[BaseException], None]
) -> T | None:
    """`compute()`; if it fails internally (a bug in hstrace, not bad input), `failed(exc)` and
    None: the caller notes it and the judgement becomes incomplete (exit 3), never clean. Bad
    input (`HstraceError`) still raises, to end the command with its one line (exit 2);
    `HSTRACE_DEBUG=1` re-raises the failure with its traceback."""
    try:
        return compute()
    except HstraceError:
        raise
    except Exception as exc:
        if debugging():
            raise
        failed(exc)
        return None
