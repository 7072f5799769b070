"""Plain-text rendering of a `DiffResult` for people (`--json` is for machines)."""

from __future__ import annotations

from hstrace.diff.compare import STAGES, DiffResult


def render_text(res: DiffResult) -> str:
    a, b = res.a, res.b
    lines = [
        f"A: {a['path']} ({a['engine']} {a['engine_version']}, ranks {a['ranks']})",
        f"B: {b['path']} ({b['engine']} {b['engine_version']}, ranks {b['ranks']})",
        f"requests matched by prompt ids: {res.matched}"
        + (
            f"; only in A: {len(res.only_a)}, only in B: {len(res.only_b)}"
            if res.only_a or res.only_b
            else ""
        ),
        f"tolerance: {res.tolerance.describe()}",
        "dataflow order: " + " -> ".join(STAGES),
        *[f"note: {n}" for n in res.notes],
        "",
    ]
    if res.first is None:
        lines.append("IDENTICAL within tolerance: no stream differs.")
    else:
        f = res.first
        lines += [
            f"FIRST DIFFERENCE: {f.stream} (stage: {f.stage})",
            f"  request {f.request}, round {f.round} ({f.event}): {f.detail}",
        ]
        if f.evidence:
            lines.append(
                "  evidence: "
                + ", ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in f.evidence.items()
                )
            )
        lines.append("  later differences may be consequences of this one.")
    lines += ["", f"{'stream':<36} {'stage':<18} {'rows':>8} {'differ':>8} {'max rel err':>12}"]
    for s in res.streams:
        lines.append(
            f"{s.stream:<36} {s.stage:<18} {s.compared_rows:>8} {s.differing_rows:>8} {s.max_rel_err:>12.3g}"
        )
    return "\n".join(lines)
