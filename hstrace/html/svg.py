"""Hand-built inline SVG charts: no plotting dependency, no script, no network.

Each function returns one `<svg>` element as a string, sized in CSS pixels, with axis labels
and a <title> per mark so a hover shows the exact value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

W, H = 560, 300
PAD_L, PAD_R, PAD_T, PAD_B = 56, 16, 28, 44
BAR = "#3b6ea8"
LINES = ("#3b6ea8", "#c0504d", "#4f9a55", "#8064a2")


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000 or abs(v) < 0.01:
        return f"{v:.2g}"
    return f"{v:.3g}"


def _nice_max(v: float) -> float:
    if v <= 0 or not math.isfinite(v):
        return 1.0
    mag = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * mag:
            return m * mag
    return 10 * mag


def _frame(title: str, body: list[str], x_label: str, y_label: str, w: int = W, h: int = H) -> str:
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" aria-label="{escape(title)}">',
            f'<rect x="0" y="0" width="{w}" height="{h}" fill="#ffffff"/>',
            f'<text x="{w / 2}" y="18" text-anchor="middle" font-size="14" font-weight="bold">{escape(title)}</text>',
            *body,
            f'<text x="{(PAD_L + w - PAD_R) / 2}" y="{h - 8}" text-anchor="middle" font-size="12">{escape(x_label)}</text>',
            f'<text x="14" y="{(PAD_T + h - PAD_B) / 2}" text-anchor="middle" font-size="12" transform="rotate(-90 14 {(PAD_T + h - PAD_B) / 2})">{escape(y_label)}</text>',
            "</svg>",
        ]
    )


def _y_axis(y_max: float, w: int = W, h: int = H, ticks: int = 5) -> list[str]:
    out = []
    for i in range(ticks + 1):
        v = y_max * i / ticks
        y = h - PAD_B - (h - PAD_T - PAD_B) * i / ticks
        out.append(
            f'<line x1="{PAD_L}" y1="{y:.1f}" x2="{w - PAD_R}" y2="{y:.1f}" stroke="#e3e3e3"/>'
        )
        out.append(
            f'<text x="{PAD_L - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11">{_fmt(v)}</text>'
        )
    out.append(
        f'<line x1="{PAD_L}" y1="{h - PAD_B}" x2="{w - PAD_R}" y2="{h - PAD_B}" stroke="#333"/>'
    )
    out.append(f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{h - PAD_B}" stroke="#333"/>')
    return out


def bar_chart(
    title: str,
    labels: Sequence[str],
    values: Sequence[float],
    x_label: str,
    y_label: str,
    y_max: float | None = None,
    notes: Sequence[str] | None = None,
) -> str:
    """Vertical bars; `notes[i]` goes into bar i's hover title."""
    n = max(1, len(values))
    top = y_max if y_max is not None else _nice_max(max(values, default=0.0))
    body = _y_axis(top)
    plot_w = W - PAD_L - PAD_R
    slot = plot_w / n
    bar_w = max(2.0, slot * 0.7)
    label_every = max(1, math.ceil(n / 20))
    for i, (lab, v) in enumerate(zip(labels, values, strict=True)):
        bh = (H - PAD_T - PAD_B) * (min(v, top) / top if top else 0.0)
        x = PAD_L + slot * i + (slot - bar_w) / 2
        tip = f"{lab}: {_fmt(v)}" + (f" ({notes[i]})" if notes else "")
        body.append(
            f'<rect class="bar" x="{x:.1f}" y="{H - PAD_B - bh:.1f}" width="{bar_w:.1f}" height="{bh:.1f}" fill="{BAR}"><title>{escape(tip)}</title></rect>'
        )
        if i % label_every == 0:
            body.append(
                f'<text x="{x + bar_w / 2:.1f}" y="{H - PAD_B + 14}" text-anchor="middle" font-size="11">{escape(str(lab))}</text>'
            )
    return _frame(title, body, x_label, y_label)


def line_chart(
    title: str,
    xs: Sequence[float],
    series: dict[str, Sequence[float]],
    x_label: str,
    y_label: str,
    y_range: tuple[float, float] | None = None,
) -> str:
    """One polyline per series (NaN breaks a line), legend top right."""
    finite = [v for s in series.values() for v in s if math.isfinite(v)]
    lo, hi = y_range if y_range else (min(finite, default=0.0), _nice_max(max(finite, default=1.0)))
    if hi <= lo:
        hi = lo + 1.0
    x0, x1 = (min(xs), max(xs)) if len(xs) else (0.0, 1.0)
    if x1 <= x0:
        x1 = x0 + 1
    plot_w, plot_h = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    body = []
    for i in range(6):
        v = lo + (hi - lo) * i / 5
        y = H - PAD_B - plot_h * i / 5
        body.append(
            f'<line x1="{PAD_L}" y1="{y:.1f}" x2="{W - PAD_R}" y2="{y:.1f}" stroke="#e3e3e3"/>'
        )
        body.append(
            f'<text x="{PAD_L - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11">{_fmt(v)}</text>'
        )
    integral = all(float(x).is_integer() for x in xs)
    n_ticks = max(1, min(5, int(x1 - x0))) if integral else 5
    for i in range(n_ticks + 1):
        v = x0 + (x1 - x0) * i / n_ticks
        v = round(v) if integral else round(v, 1)
        x = PAD_L + plot_w * (v - x0) / (x1 - x0)
        body.append(
            f'<text x="{x:.1f}" y="{H - PAD_B + 14}" text-anchor="middle" font-size="11">{_fmt(v)}</text>'
        )
    body.append(
        f'<line x1="{PAD_L}" y1="{H - PAD_B}" x2="{W - PAD_R}" y2="{H - PAD_B}" stroke="#333"/>'
    )
    body.append(f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{H - PAD_B}" stroke="#333"/>')
    for k, (name, ys) in enumerate(series.items()):
        color = LINES[k % len(LINES)]
        runs: list[list[str]] = [[]]
        for x, y in zip(xs, ys, strict=True):
            if not math.isfinite(y):
                runs.append([])
                continue
            px = PAD_L + plot_w * (x - x0) / (x1 - x0)
            py = H - PAD_B - plot_h * (min(max(y, lo), hi) - lo) / (hi - lo)
            runs[-1].append(f"{px:.1f},{py:.1f}")
        for pts in runs:
            if len(pts) == 1:
                cx, cy = pts[0].split(",")
                body.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{color}"/>')
            elif pts:
                body.append(
                    f'<polyline class="series" fill="none" stroke="{color}" stroke-width="2" points="{" ".join(pts)}"/>'
                )
        ly = PAD_T + 6 + 16 * k
        body.append(f'<rect x="{W - PAD_R - 150}" y="{ly}" width="12" height="3" fill="{color}"/>')
        body.append(
            f'<text x="{W - PAD_R - 134}" y="{ly + 5}" font-size="11">{escape(name)}</text>'
        )
    return _frame(title, body, x_label, y_label)


def heatmap(
    title: str,
    matrix: Sequence[Sequence[float]],
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    x_label: str,
    y_label: str,
    lo: float = 0.0,
    hi: float = 1.0,
) -> str:
    """Cells coloured white (lo) to dark blue (hi), value printed when cells are big enough."""
    rows, cols = len(matrix), max((len(r) for r in matrix), default=0)
    cell = max(8.0, min(72.0, 420 / max(1, cols), 240 / max(1, rows)))
    w = max(W, int(PAD_L + 40 + cols * cell + PAD_R + 40))
    h = max(H, int(PAD_T + rows * cell + PAD_B + 30))
    body = []
    for i, row in enumerate(matrix):
        y = PAD_T + i * cell
        body.append(
            f'<text x="{PAD_L + 34}" y="{y + cell / 2 + 4:.1f}" text-anchor="end" font-size="11">{escape(str(row_labels[i]))}</text>'
        )
        for j, v in enumerate(row):
            x = PAD_L + 40 + j * cell
            frac = (
                0.0 if not math.isfinite(v) else min(1.0, max(0.0, (v - lo) / ((hi - lo) or 1.0)))
            )
            r, g, b = (int(255 - frac * (255 - c)) for c in (20, 60, 140))
            fill = "#dddddd" if not math.isfinite(v) else f"rgb({r},{g},{b})"
            body.append(
                f'<rect class="cell" x="{x:.1f}" y="{y:.1f}" width="{cell:.1f}" height="{cell:.1f}" fill="{fill}" stroke="#fff"><title>{escape(f"{row_labels[i]} x {col_labels[j]}: {_fmt(v)}")}</title></rect>'
            )
            if cell >= 30 and math.isfinite(v):
                tc = "#fff" if frac > 0.55 else "#000"
                body.append(
                    f'<text x="{x + cell / 2:.1f}" y="{y + cell / 2 + 4:.1f}" text-anchor="middle" font-size="10" fill="{tc}">{v:.2f}</text>'
                )
    for j, lab in enumerate(col_labels):
        x = PAD_L + 40 + j * cell + cell / 2
        body.append(
            f'<text x="{x:.1f}" y="{PAD_T + rows * cell + 14:.1f}" text-anchor="middle" font-size="11">{escape(str(lab))}</text>'
        )
    return _frame(title, body, x_label, y_label, w=w, h=h)
