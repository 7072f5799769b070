"""What a piece of evidence could not compute, and why, decided while it is built.

Each builder fills one `Unavailable` and freezes it into its evidence; nothing is added later,
so what a replay reports as not checked never depends on which check looked first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Unavailable:
    def __init__(self) -> None:
        self.reasons: dict[str, str] = {}

    def note(self, what: str, why: str) -> None:
        self.reasons.setdefault(what, why)

    def guarded(self, what: str, compute: Callable[[], T]) -> T | None:
        """`compute()`, or None with the reason noted if it fails internally (a bug in one piece
        of evidence must not cost the report). Bad input (`HstraceError`) still raises."""
        from hstrace.errors import HstraceError

        try:
            return compute()
        except HstraceError:
            raise
        except Exception as exc:
            self.note(what, f"failed internally: {type(exc).__name__}: {exc}")
            return None

    def frozen(self) -> dict[str, str]:
        return dict(self.reasons)


def merged(*parts: dict[str, str] | Any) -> dict[str, str]:
    """The reasons of several pieces, the first reason for a name kept, in the order given."""
    out: dict[str, str] = {}
    for p in parts:
        for k, v in (p if isinstance(p, dict) else p.unavailable).items():
            out.setdefault(k, v)
    return out
