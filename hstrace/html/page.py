"""One self-contained HTML page: the verdict first, then the plots that back it.

Everything is inline (CSS and SVG); the page loads nothing, runs no script, and reads the same
offline as online. Input is the trace (for acceptance) and, when a training dir was given, the
replay result's JSON (`ReplayResult.to_json()`, docs/replay-json.md) for the verdict, the slot
fingerprint matrix and the engine-vs-reference agreement.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from html import escape
from typing import Any

from hstrace._version import __version__
from hstrace.findings import STAGES
from hstrace.html import svg
from hstrace.html.verify_stats import Acceptance
from hstrace.report.acceptance import html_table
from hstrace.trace.acceptance_by_position import CONVENTIONS, OF_REACHED

CSS = """
body{font-family:DejaVu Sans,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1180px;color:#1d1d1d;background:#fff}
h1{font-size:24px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.meta{color:#555;font-size:13px}
.verdict{border-left:6px solid #888;background:#f6f6f6;padding:12px 16px;margin:16px 0}
.verdict.fault{border-color:#c0392b;background:#fdf0ee} .verdict.ok{border-color:#2e8b57;background:#eef8f1}
.incomplete{color:#c0392b;margin:8px 0} .incomplete p{margin:2px 0}
.verdict .code{font-family:DejaVu Sans Mono,monospace;font-size:20px;font-weight:bold}
.flow span{display:inline-block;padding:2px 8px;margin:2px;border-radius:10px;background:#eee;font-size:12px}
.flow span.hit{background:#c0392b;color:#fff}
.grid{display:flex;flex-wrap:wrap;gap:18px} figure{margin:0} figcaption{font-size:12px;color:#555;max-width:560px}
table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
.note{font-size:13px;color:#8a5a00;background:#fff8e6;padding:8px 12px;max-width:540px}
code{font-family:DejaVu Sans Mono,monospace;font-size:12px}
"""


def _figure(chart: str, caption: str) -> str:
    return f"<figure>{chart}<figcaption>{escape(caption)}</figcaption></figure>"


def _note(title: str, text: str) -> str:
    return f'<figure><div class="note"><b>{escape(title)}</b><br>{escape(text)}</div></figure>'


def _verdict(replay: dict[str, Any] | None) -> str:
    if replay is None:
        return (
            '<div class="verdict" id="verdict"><div class="code">not replayed</div>'
            "<p>No training dir was given, so there is no verdict on the wiring. Run "
            "<code>hstrace report TRACE --against TRAINING_DIR --html OUT.html</code>.</p></div>"
        )
    v = replay["verdict"]
    failed = replay.get("failed") or {}
    cls = "fault" if v.get("severity") == "fault" or failed else "ok"
    flow = "".join(
        f'<span class="{"hit" if s == v.get("stage") else ""}">{escape(s)}</span>' for s in STAGES
    )
    fix = f"<p><b>Fix:</b> {escape(v['fix'])}</p>" if v.get("fix") else ""
    if replay.get("source"):
        fix += f"<p class='meta'>Verdict from {escape(str(replay['source']))}.</p>"
    incomplete = ""
    if failed:  # an internal failure is never a clean verdict: say so above everything else
        exit_code = replay.get("exit_code", 1 if v.get("severity") == "fault" else 3)
        incomplete = (
            f'<div class="incomplete" id="incomplete"><b>Judgement incomplete</b> (exit '
            f"{escape(str(exit_code))}): "
            + "".join(
                f"<p>judgement incomplete: {escape(str(k))} failed internally: "
                f"{escape(str(why))}</p>"
                for k, why in failed.items()
            )
            + "</div>"
        )
    stage = f"stage <b>{escape(str(v.get('stage')))}</b>, " if v.get("stage") else ""
    return (
        f'<div class="verdict {cls}" id="verdict"><div>Verdict (first divergence in dataflow order)</div>'
        f'<div class="code">{escape(v["code"])}</div>{incomplete}<p>{stage}'
        f"{escape(str(v.get('severity')))}: {escape(str(v.get('summary')))}</p>{fix}"
        f'<div class="flow">{flow}</div></div>'
    )


def _findings(replay: dict[str, Any] | None) -> str:
    if not replay:
        return ""
    rows = []
    for f in replay.get("findings", []):
        ev = ", ".join(f"{k}={v}" for k, v in list((f.get("evidence") or {}).items())[:6])
        rows.append(
            "<tr>"
            + "".join(
                f"<td>{escape(str(x))}</td>"
                for x in (
                    f.get("stage"),
                    f.get("code"),
                    f.get("severity"),
                    f.get("summary"),
                    ev[:300],
                    f.get("fix") or "",
                )
            )
            + "</tr>"
        )
    out = ""
    if rows:
        out += (
            "<h2>Findings (dataflow order)</h2><table><tr><th>stage</th><th>code</th><th>severity</th><th>summary</th><th>evidence</th><th>fix</th></tr>"
            + "".join(rows)
            + "</table>"
        )
    skipped = replay.get("skipped") or {}
    if skipped:
        out += (
            "<h2>Checks that could not run</h2><table><tr><th>check</th><th>why</th></tr>"
            + "".join(
                f"<tr><td>{escape(k)}</td><td>{escape(str(v))}</td></tr>"
                for k, v in skipped.items()
            )
            + "</table>"
        )
    return out


def _acceptance_plots(acc: Acceptance | None) -> list[str]:
    if acc is None:
        return [
            _note("Acceptance", "The trace has no verify table, so there is nothing to plot.")
        ] * 1
    labels = [str(p.position) for p in acc.by_position]
    cond = [0.0 if math.isnan(x) else x for x in acc.conditional()]
    notes = [
        f"offered {p.offered}, reached {p.reached}, accepted {p.accepted}" for p in acc.by_position
    ]
    by_pos = svg.bar_chart(
        "Acceptance by draft position",
        labels,
        cond,
        "draft position (0 = first draft token)",
        "rate_of_reached",
        y_max=1.0,
        notes=notes,
    )
    hist = svg.bar_chart(
        "Accept-length histogram",
        [str(k) for k, _ in acc.histogram],
        [float(v) for _, v in acc.histogram],
        "accepted draft tokens per verify (bonus excluded)",
        "verify rows",
    )
    return [
        _figure(
            by_pos,
            f"rate_of_reached = {CONVENTIONS[OF_REACHED]}; both rates per position are in the table below. {acc.rows} verify rows.",
        ),
        _figure(
            hist,
            f"accept_len excludes the bonus token (tokens per verify = accept_len + 1). Mean {acc.mean_accept_len:.3f}.",
        ),
    ]


def _fingerprint_plot(replay: dict[str, Any] | None, slot_labels: list[str] | None) -> str:
    fp = (replay or {}).get("fingerprints", {}).get("serving_x_training")
    if not fp or not fp.get("cos"):
        why = (
            "no replay was run"
            if replay is None
            else "the replay produced no slot matrix (see the skipped checks)"
        )
        return _note("Serving slot x training slot fingerprints", f"Not available: {why}.")
    cos = fp["cos"]
    rows = [
        f"serve {i}" + (f" (L{slot_labels[i]})" if slot_labels and i < len(slot_labels) else "")
        for i in range(len(cos))
    ]
    cols = [f"train {j}" for j in range(len(cos[0]))]
    chart = svg.heatmap(
        "Slot fingerprints: serving x training (mean cosine)",
        cos,
        rows,
        cols,
        "training slot",
        "serving slot",
        lo=0.0,
        hi=1.0,
    )
    return _figure(
        chart,
        "Mean per-token cosine of each serving aux slot with each training slot on aligned tokens; the diagonal should be ~1 (>0.999 for the same state in bf16).",
    )


def _agreement_plot(replay: dict[str, Any] | None) -> str:
    metrics = (replay or {}).get("metrics", {})
    evr = metrics.get("engine_vs_reference") or {}
    series = evr.get("by_step")
    if series:
        xs = [float(p["step"]) for p in series]
        data = {"top-1 agreement": [float(p.get("top1_agreement", float("nan"))) for p in series]}
        if any("topk_agreement" in p for p in series):
            data["top-k overlap"] = [float(p.get("topk_agreement", float("nan"))) for p in series]
        chart = svg.line_chart(
            "Engine vs reference drafter agreement over steps",
            xs,
            data,
            "step",
            "agreement",
            y_range=(0.0, 1.0),
        )
        return _figure(
            chart,
            "Draft-space top-1 agreement and top-k overlap of the engine's draft top-k with the fp32 reference drafter on the same recorded inputs, per step.",
        )
    if "engine_vs_reference_top1" in metrics:
        top1 = float(metrics["engine_vs_reference_top1"])
        topk = float(metrics.get("engine_vs_reference_topk", float("nan")))
        chart = svg.bar_chart(
            "Engine vs reference drafter agreement (all steps)",
            ["top-1", "top-k overlap"],
            [top1, 0.0 if math.isnan(topk) else topk],
            "statistic",
            "agreement",
            y_max=1.0,
        )
        return _figure(
            chart,
            f"Over {evr.get('rows', '?')} draft rows; this replay gave no per-step series, so the agreement is shown pooled over steps.",
        )
    why = (
        "no replay was run"
        if replay is None
        else "the replay could not compare engine and reference logits (see the skipped checks)"
    )
    return _note("Engine vs reference logit agreement", f"Not available: {why}.")


def _metrics_table(replay: dict[str, Any] | None, acc: Acceptance | None) -> str:
    rows = []
    if acc is not None:
        rows.append(("mean accept length (trace, bonus excluded)", f"{acc.mean_accept_len:.4f}"))
    for k, v in ((replay or {}).get("metrics") or {}).items():
        if isinstance(v, int | float | str) and not isinstance(v, bool):
            rows.append((k, f"{v:.4f}" if isinstance(v, float) else str(v)))
    if not rows:
        return ""
    return (
        "<h2>Metrics</h2><table>"
        + "".join(f"<tr><td>{escape(k)}</td><td>{escape(v)}</td></tr>" for k, v in rows)
        + "</table>"
    )


def render_page(
    *,
    trace_path: str,
    meta: dict[str, Any],
    ranks: list[int],
    table_steps: dict[str, int],
    acceptance: Acceptance | None,
    replay: dict[str, Any] | None,
    slot_labels: list[str] | None = None,
) -> str:
    eng = meta.get("engine") or {}
    title = f"hstrace report: {trace_path}"
    steps = ", ".join(f"{k} {v}" for k, v in sorted(table_steps.items()))
    body = [
        f"<h1>hstrace report</h1><div class='meta'>trace <code>{escape(trace_path)}</code> &middot; engine "
        f"<b>{escape(str(eng.get('name')))}</b> {escape(str(eng.get('version')))} &middot; ranks {escape(str(ranks))} "
        f"&middot; events: {escape(steps)} &middot; recorded {escape(str(meta.get('created', '?')))}</div>",
        _verdict(replay),
        "<h2>Plots</h2><div class='grid'>",
        *_acceptance_plots(acceptance),
        _fingerprint_plot(replay, slot_labels),
        _agreement_plot(replay),
        "</div>",
        _findings(replay),
        html_table(acceptance.by_position) if acceptance is not None else "",
        _metrics_table(replay, acceptance),
        f"<p class='meta'>Generated by hstrace {escape(__version__)} on {datetime.now(UTC).isoformat(timespec='seconds')}. "
        "Self-contained: no scripts, no network.</p>",
    ]
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )
