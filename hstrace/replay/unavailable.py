"""What a piece of evidence could not compute, and why, decided while it is built.

Each builder fills one `Unavailable` and freezes it into its evidence; nothing is added later,
so what a replay reports as not checked never depends on which check looked first.

Two kinds of reason share the map: evidence that is legitimately unavailable (no target model,
no draft rows: "not judged, and why"), and a computation that raised (`internal_failure`: the
reason begins with `FAILED`). The second is never part of a clean verdict: the result splits it
out (`split_failures`) and the judgement is incomplete (exit 3, "could not judge").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from hstrace.errors import error_line, unless_internal_failure

T = TypeVar("T")

# The prefix of a reason that is an internal failure, not missing evidence.
FAILED = "failed internally: "


def internal_failure(exc: BaseException) -> str:
    """The reason recorded for a computation that raised: `failed internally: Type: message`."""
    return FAILED + error_line(exc)


def is_internal_failure(why: str) -> bool:
    return isinstance(why, str) and why.startswith(FAILED)


def split_failures(reasons: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(legitimately unavailable: name -> why, failed internally: name -> `Type: message`)."""
    skipped = {k: v for k, v in reasons.items() if not is_internal_failure(v)}
    failed = {k: v[len(FAILED) :] for k, v in reasons.items() if is_internal_failure(v)}
    return skipped, failed


class Unavailable:
    def __init__(self) -> None:
        self.reasons: dict[str, str] = {}

    def note(self, what: str, why: str) -> None:
        self.reasons.setdefault(what, why)

    def guarded(self, what: str, compute: Callable[[], T]) -> T | None:
        """`compute()`, or None with the reason noted if it fails internally (a bug in one piece
        of evidence must not cost the rest of the report, but makes the judgement incomplete:
        `internal_failure`). Bad input (`HstraceError`) still raises."""
        return unless_internal_failure(compute, lambda e: self.note(what, internal_failure(e)))

    def frozen(self) -> dict[str, str]:
        return dict(self.reasons)


def merged(*parts: dict[str, str] | Any) -> dict[str, str]:
    """The reasons of several pieces, the first reason for a name kept, in the order given."""
    out: dict[str, str] = {}
    for p in parts:
        for k, v in (p if isinstance(p, dict) else p.unavailable).items():
            out.setdefault(k, v)
    return out
