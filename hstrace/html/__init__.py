"""`hstrace report --html`: one self-contained page (inline SVG plots) with the verdict."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hstrace.html.page import render_page
from hstrace.html.verify_stats import Acceptance, acceptance_of

__all__ = ["Acceptance", "acceptance_of", "render_page", "write_report_html"]


def write_report_html(
    trace: Any, out: str | os.PathLike[str], replay: dict[str, Any] | None = None
) -> Path:
    """Render `trace` (an open trace) and an optional replay JSON to `out`; returns the path."""
    meta = trace.meta
    r0 = trace.rank(trace.ranks[0]) if trace.ranks else None
    steps = {name: r0.table(name).num_steps for name in r0.tables} if r0 else {}
    labels = None
    t = r0.table("target") if r0 else None
    if t is not None and "aux_hidden" in t.columns.get("tok", []):
        ids = t.column_attrs("tok", "aux_hidden").get("layer_ids")
        labels = [str(i) for i in ids] if ids else None
    html = render_page(
        trace_path=str(trace.path),
        meta=meta,
        ranks=list(trace.ranks),
        table_steps=steps,
        acceptance=acceptance_of(trace),
        replay=replay,
        slot_labels=labels,
    )
    p = Path(out)
    p.write_text(html, encoding="utf-8")
    return p
