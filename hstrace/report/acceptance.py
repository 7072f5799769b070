"""Acceptance by draft position, rendered the same way for every output.

One table shape for terminal (rich), Markdown and HTML: per position the counts (offered,
reached, accepted) and both rates, each column named after its convention
(`hstrace.trace.acceptance_by_position`), so `hstrace show`, `hstrace report` and a bundle's
REPORT.md print the same numbers under the same names.
"""

from __future__ import annotations

from html import escape
from typing import Any

from hstrace.trace.acceptance_by_position import CONVENTIONS, OF_OFFERED, OF_REACHED, PositionCounts

HEADERS = ("position", "offered", "reached", "accepted", OF_OFFERED, OF_REACHED)
CAPTION = (
    f"{OF_OFFERED} = {CONVENTIONS[OF_OFFERED]}; {OF_REACHED} = {CONVENTIONS[OF_REACHED]}. "
    "accept_len excludes the bonus token."
)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def rows(positions: list[PositionCounts] | list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """One tuple of cells per position, from counts or their JSON (`hstrace show --json`)."""
    out = []
    for p in positions:
        d = p.to_json() if isinstance(p, PositionCounts) else p
        out.append(
            (
                str(d["position"]),
                str(d["offered"]),
                str(d["reached"]),
                str(d["accepted"]),
                _pct(d[OF_OFFERED]),
                _pct(d[OF_REACHED]),
            )
        )
    return out


def terminal_table(positions: list[Any], title: str = "acceptance by draft position") -> Any:
    from rich.table import Table

    t = Table(title=title, title_justify="left", caption=CAPTION, caption_justify="left")
    for h in HEADERS:
        t.add_column(h, justify="right")
    for r in rows(positions):
        t.add_row(*r)
    return t


def markdown_table(positions: list[Any]) -> list[str]:
    from hstrace.report.markdown import row

    lines = [row(*HEADERS), "|" + " --- |" * len(HEADERS)]
    lines += [row(*r) for r in rows(positions)]
    return [*lines, "", CAPTION]


def html_table(positions: list[Any]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in HEADERS)
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in rows(positions)
    )
    return (
        f"<h2>Acceptance by draft position</h2><table><tr>{head}</tr>{body}</table>"
        f"<p class='meta'>{escape(CAPTION)}</p>"
    )
