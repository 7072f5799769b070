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
from hstrace.replay.compare import SAME_COS, UNRELATED_COS
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
.impact h3{font-size:14px;margin:4px 0;max-width:560px}
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
    if v.get("impact_line"):  # what fixing the verdict's fault is worth (replay's impact stage)
        fix += f"<p><b>Impact:</b> {escape(v['impact_line'])}</p>"
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
    not_judged = replay.get("not_judged") or []
    if not_judged:
        out += (
            "<h2>Not judged</h2><table><tr><th>stage</th><th>what</th><th>requests</th>"
            "<th>why</th></tr>"
            + "".join(
                f"<tr><td>{escape(str(n.get('stage', '')))}</td>"
                f"<td>{escape(str(n.get('what', '')))}</td>"
                f"<td>{escape(str(n.get('n_requests') or 'all'))}</td>"
                f"<td>{escape(str(n.get('why', '')))}</td></tr>"
                for n in not_judged
            )
            + "</table>"
        )
    return out


def _interval(part: dict[str, Any]) -> svg.Interval:
    lo, hi = part["ci"]
    return svg.Interval(float(part["accept_length"]), float(lo), float(hi))


def _per_position(part: dict[str, Any]) -> str:
    return ", ".join(f"{x:.2f}" for x in part.get("per_position") or [])


def impact_headline(name: str, imp: dict[str, Any]) -> str:
    """One sentence: what fixing `name` is worth in expected accept length."""
    s, f = imp["served"]["accept_length"], imp["fixed"]["accept_length"]
    gain = imp.get("gain", f - s)
    spread = ""
    if imp.get("gain_ci"):  # paired spread of the gain, when replay gives it
        lo, hi = imp["gain_ci"]
        spread = f" [{lo:+.2f}, {hi:+.2f}]"
    if not imp.get("measurable"):
        return (
            f"{name}: costs nothing measurable on these tokens ({s:.2f} → {f:.2f}, gain "
            f"{gain:+.2f}{spread} within the spread): still a fault, low priority"
        )
    verb = "raises" if gain > 0 else "lowers"
    return (
        f"{name}: fixing it {verb} the expected accept length {s:.2f} → {f:.2f} "
        f"({gain:+.2f}{spread})"
    )


def _impact_figure(name: str, imp: dict[str, Any]) -> str:
    k = int(imp["num_speculative_tokens"])
    realized = imp.get("realized")
    chart = svg.impact_bars(
        f"Expected accept length: {name}",
        _interval(imp["served"]),
        _interval(imp["fixed"]),
        _interval(realized) if realized else None,
        float(k + 1),
        "expected accept length (accepted draft tokens + 1 per verify step)",
    )
    agrees = imp.get("estimate_agrees")
    if realized is None:
        check = "The trace has no realized acceptance on these tokens to check the estimate with."
    else:
        r = realized["accept_length"]
        check = f"Diamond: realized in the trace, {r:.2f}; " + (
            "the as-served estimate agrees with it (within its spread)."
            if agrees
            else "the as-served estimate does NOT agree with it: read the estimate with care."
            if agrees is False
            else "not compared."
        )
    caption = (
        f"The greedy drafter chain (num_speculative_tokens={k}, "
        f"topk={imp.get('topk')}) on {imp.get('tokens')} aligned tokens ({imp.get('steps')} "
        "verify steps), run with every part as served, and with the part the fix changes (the "
        "aux states, the drafter, the vocab map) as trained (fixed); bars from 0, whiskers: "
        f"{imp.get('ci_method') or 'the spread'}. {check} Per-position acceptance (fraction of "
        f"steps whose position i was accepted), as served: {_per_position(imp['served'])}; "
        f"fixed: {_per_position(imp['fixed'])}."
    )
    if imp.get("fix"):
        caption += f" Fix: {imp['fix']}"
    return (
        f'<figure class="impact" data-code="{escape(name)}"><h3>{escape(impact_headline(name, imp))}</h3>'
        f"{chart}<figcaption>{escape(caption)}</figcaption></figure>"
    )


def _impact(replay: dict[str, Any] | None) -> str:
    """Per fault finding, what its fix is worth (docs/replay-json.md, `impact`); nothing when
    the replay computed no impact at all."""
    if not replay:
        return ""
    findings = [f for f in replay.get("findings") or [] if "impact" in f]
    if not findings and not replay.get("impact_all"):
        return ""
    parts = []
    for f in findings:
        if f["impact"] is None:
            why = f.get("impact_unavailable") or "no reason given"
            parts.append(
                f'<figure class="impact-unavailable" data-code="{escape(f["code"])}"><div class="note">'
                f"<b>{escape(f['code'])}</b>: impact not computed: {escape(str(why))}</div></figure>"
            )
        else:
            parts.append(_impact_figure(f["code"], f["impact"]))
    if replay.get("impact_all"):
        parts.append(_impact_figure("every fault fixed", replay["impact_all"]))
    return "<h2>What each fault costs</h2><div class='grid'>" + "".join(parts) + "</div>"


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


# Cosines that matter sit near 1: 0.98 is a neighbouring layer, 0.9999 the same state in bf16.
# The heatmaps shade the distance 1 - cos on a log scale, from COS_FLOOR_DISTANCE (darkest) to 1.
COS_FLOOR_DISTANCE = 1e-4


def cosine_scale() -> svg.Scale:
    """Shade of a cosine c: 1 at 1 - c <= 1e-4, 0 at c <= 0, linear in log10(1 - c) between."""
    span = -math.log10(COS_FLOOR_DISTANCE)

    def shade(c: float) -> float:
        d = min(1.0, max(COS_FLOOR_DISTANCE, 1.0 - c))
        return -math.log10(d) / span

    ticks = [
        (1 - COS_FLOOR_DISTANCE, f"≥ {1 - COS_FLOOR_DISTANCE:g}"),
        (SAME_COS, f"{SAME_COS:g} same state"),
        (0.99, "0.99"),
        (0.9, "0.9"),
        (0.0, "≤ 0"),
    ]
    return svg.Scale(shade, ticks, "mean cosine")


def slot_marks(cos: list[list[float]]) -> dict[tuple[int, int], svg.Mark]:
    """The cells the capture check decides on (`hstrace.diagnose.capture`): each serving
    slot's diagonal cell, failed when below SAME_COS, and the training slot whose state it
    holds (its row's best cell at or above SAME_COS)."""
    marks: dict[tuple[int, int], svg.Mark] = {}
    for i, row in enumerate(cos):
        if i < len(row) and row[i] < SAME_COS:
            marks[(i, i)] = svg.Mark(
                "miss",
                f"serving slot {i} does not hold training slot {i}'s state "
                f"(cos {row[i]:.4f} < {SAME_COS:g})",
            )
        j = max(range(len(row)), key=lambda k: row[k]) if row else 0
        if row and row[j] >= SAME_COS:
            marks[(i, j)] = svg.Mark(
                "match",
                f"serving slot {i} holds training slot {j}'s state (cos {row[j]:.4f})",
            )
    return marks


def _layer_names(fp: dict[str, Any], side: str) -> list[int] | None:
    layers = fp.get(f"{side}_layers") or {}
    return list(layers["layer"]) if layers.get("layer") else None


def _fingerprint_plots(replay: dict[str, Any] | None, slot_labels: list[str] | None) -> list[str]:
    fps = (replay or {}).get("fingerprints") or {}
    fp = fps.get("serving_x_training")
    if not fp or not fp.get("cos"):
        why = (
            "no replay was run"
            if replay is None
            else "the replay produced no slot matrix (see the skipped checks)"
        )
        return [_note("Serving slot x training slot fingerprints", f"Not available: {why}.")]
    cos = fp["cos"]
    ks, kt = len(cos), len(cos[0])
    s_layers, t_layers = _layer_names(fps, "serving"), _layer_names(fps, "training")
    if (s_layers and len(s_layers) != ks) or (t_layers and len(t_layers) != kt):
        s_layers = t_layers = None  # not the same slots: name none rather than the wrong ones
    if s_layers:
        rows = [f"serving {i} · HF {s_layers[i]}" for i in range(ks)]
    elif slot_labels and len(slot_labels) == ks:  # the engine's own ids, not checked
        rows = [f"serving {i} · id {slot_labels[i]}" for i in range(ks)]
    else:
        rows = [f"serving {i}" for i in range(ks)]
    cols = [f"training {j}" + (f"\nHF {t_layers[j]}" if t_layers else "") for j in range(kt)]
    marks = slot_marks(cos)
    scale = cosine_scale()
    chart = svg.heatmap(
        "Which training slot each serving slot holds",
        cos,
        rows,
        cols,
        "training slot" + (" · HF layer it holds" if t_layers else ""),
        "serving slot" + (" · HF layer it holds" if s_layers else ""),
        scale=scale,
        marks=marks,
        mark_key={
            "match": f"holds that slot's state (≥ {SAME_COS:g})",
            "miss": f"diagonal below {SAME_COS:g}",
        },
        cls="heatmap slots",
    )
    out = [_figure(chart, _slot_caption(replay or {}, cos, marks, s_layers, t_layers))]
    if s_layers and t_layers:
        out.append(_layer_plot(fps))
    return out


def _slot_caption(
    replay: dict[str, Any],
    cos: list[list[float]],
    marks: dict[tuple[int, int], svg.Mark],
    s_layers: list[int] | None,
    t_layers: list[int] | None,
) -> str:
    n = (replay.get("coverage") or {}).get("aligned_tokens")
    on = f"the {n} aligned tokens" if n else "the aligned tokens"
    diag = [cos[i][i] for i in range(min(len(cos), len(cos[0])))]
    text = (
        f"Cell (i, j): mean per-token cosine of serving slot i with training slot j on {on}. "
        "The diagonal asks the one question that matters: does serving slot i hold the state "
        "training stored in slot i? When serving is wired as training was, every diagonal cell "
        f"is at least {SAME_COS:g} (the same state, up to bf16 rounding) and is the darkest of "
        "its row; a dark cell off the diagonal means serving put a state in another slot "
        "(order), a lighter diagonal that serving captured other layers. "
        f"Here the diagonal reads {', '.join(f'{c:.4f}' for c in diag)}"
    )
    failed = [i for i, c in enumerate(diag) if c < SAME_COS]
    text += (
        f": slot(s) {failed} below {SAME_COS:g} (dashed red)."
        if failed
        else f": every slot at or above {SAME_COS:g}."
    )
    moved = [(i, j) for (i, j), m in sorted(marks.items()) if m.kind == "match" and i != j]
    if moved:
        text += (
            " Solid orange: "
            + "; ".join(
                f"serving slot {i} holds training slot {j}'s state ({cos[i][j]:.4f})"
                for i, j in moved
            )
            + "."
        )
    if s_layers and t_layers:
        text += f" Serving slots hold HF layers {s_layers}, training slots {t_layers}."
    v = replay.get("verdict") or {}
    capture = [
        f["code"] for f in replay.get("findings") or [] if f.get("stage") == "target-capture"
    ]
    if capture:
        text += f" The marked cells decided {', '.join(capture)} (stage target-capture)."
    elif not failed:
        text += f" The capture is not the fault; the verdict {v.get('code')} comes from elsewhere."
    return text


def _layer_plot(fps: dict[str, Any]) -> str:
    srv, trn = fps["serving_layers"], fps["training_layers"]
    matrix = [*srv["cos_all"], *trn["cos_all"]]
    ks = len(srv["cos_all"])
    n = len(matrix[0])
    rows = [f"serving {i}" for i in range(ks)] + [
        f"training {j}" for j in range(len(trn["cos_all"]))
    ]
    marks: dict[tuple[int, int], svg.Mark] = {}
    for off, side, fp in ((0, "serving", srv), (ks, "training", trn)):
        for i, (layer, c) in enumerate(zip(fp["layer"], fp["cos"], strict=True)):
            kind = "match" if c >= UNRELATED_COS else "miss"
            marks[(off + i, layer)] = svg.Mark(
                kind, f"{side} slot {i} matches HF layer {layer} best (cos {c:.4f})"
            )
    cols = ["0\nemb" if j == 0 else str(j) for j in range(n)]
    chart = svg.heatmap(
        "Which target layer each slot holds",
        matrix,
        rows,
        cols,
        "target layer (HF hidden_states index: 0 = embeddings, L = after L layers)",
        "slot",
        scale=cosine_scale(),
        marks=marks,
        mark_key={
            "match": "the layer the slot holds best",
            "miss": f"best, but below {UNRELATED_COS:g}",
        },
        row_groups=((0, "serving slots"), (ks, "training slots")),
        cls="heatmap layers",
    )
    pairs = ", ".join(
        f"slot {i}: serving HF {a}, training HF {b}"
        for i, (a, b) in enumerate(zip(srv["layer"], trn["layer"], strict=False))
    )
    return _figure(
        chart,
        "Cell (slot, L): mean cosine of the slot with the reference target forward's "
        "hidden_states[L] on the same tokens. Outlined: the layer each slot holds. When serving "
        "captures what training stored, serving slot i and training slot i are outlined in the "
        f"same column. Here {pairs}.",
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
            "Draft-space top-1 agreement and top-k overlap of the engine's draft top-k with the "
            "fp32 reference drafter on the same recorded inputs, per step. The lines are told "
            "apart by dash pattern, hollow marker shape and the name at each line's end; where "
            "they coincide, both markers show.",
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
        _impact(replay),
        "<h2>Plots</h2><div class='grid'>",
        *_acceptance_plots(acceptance),
        *_fingerprint_plots(replay, slot_labels),
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
