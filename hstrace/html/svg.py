"""Hand-built inline SVG charts: no plotting dependency, no script, no network.

Each function returns one `<svg>` element as a string, sized in CSS pixels, with axis labels
and a <title> per mark so a hover shows the exact value. Marks carry `class` and `data-*`
attributes with the values they draw, so a test (or a reader of the DOM) can check the picture
against the numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

W, H = 560, 300
PAD_L, PAD_R, PAD_T, PAD_B = 56, 16, 28, 44
BAR = "#3b6ea8"
LINES = ("#3b6ea8", "#c0504d", "#4f9a55", "#8064a2")
# Overlapping lines stay apart without colour: a dash pattern and a marker shape per series.
DASHES = ("", "7 4", "2 3", "10 3 2 3")
MARKERS = ("circle", "square", "triangle", "diamond")
# The heatmap's darkest shade (value at the top of its scale) and its two cell marks.
HEAT_RGB = (20, 60, 140)
MARK_MATCH = "#f08c00"  # solid outline
MARK_MISS = "#c92a2a"  # dashed outline
# The impact bars: as served, as fixed, and the realized marker from the trace.
SERVED = "#c0504d"
FIXED = "#2f9e44"
REALIZED = "#111111"


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


def _open(title: str, w: int, h: int, cls: str = "") -> list[str]:
    c = f' class="{cls}"' if cls else ""
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg"{c} width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" aria-label="{escape(title)}">',
        f'<rect x="0" y="0" width="{w}" height="{h}" fill="#ffffff"/>',
        f'<text x="{w / 2}" y="18" text-anchor="middle" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]


def _frame(title: str, body: list[str], x_label: str, y_label: str, w: int = W, h: int = H) -> str:
    return "\n".join(
        [
            *_open(title, w, h),
            *body,
            f'<text class="x-label" x="{(PAD_L + w - PAD_R) / 2}" y="{h - 8}" text-anchor="middle" font-size="12">{escape(x_label)}</text>',
            f'<text class="y-label" x="14" y="{(PAD_T + h - PAD_B) / 2}" text-anchor="middle" font-size="12" transform="rotate(-90 14 {(PAD_T + h - PAD_B) / 2})">{escape(y_label)}</text>',
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


def _marker(shape: str, x: float, y: float, color: str, series: int) -> str:
    """A hollow marker (no fill, coloured edge): two series on the same point both show."""
    a = f'class="marker" data-series="{series}" fill="none" stroke="{color}" stroke-width="1.6"'
    if shape == "circle":
        return f'<circle {a} cx="{x:.1f}" cy="{y:.1f}" r="3"/>'
    if shape == "square":
        return f'<rect {a} x="{x - 5.5:.1f}" y="{y - 5.5:.1f}" width="11" height="11"/>'
    if shape == "triangle":
        pts = f"{x:.1f},{y - 5.5:.1f} {x + 5:.1f},{y + 3.5:.1f} {x - 5:.1f},{y + 3.5:.1f}"
        return f'<polygon {a} points="{pts}"/>'
    pts = f"{x:.1f},{y - 5.5:.1f} {x + 5.5:.1f},{y:.1f} {x:.1f},{y + 5.5:.1f} {x - 5.5:.1f},{y:.1f}"
    return f'<polygon {a} points="{pts}"/>'


def _spread(ys: list[float], gap: float, lo: float, hi: float) -> list[float]:
    """Label positions as close to `ys` as possible, at least `gap` apart, within [lo, hi]."""
    order = sorted(range(len(ys)), key=lambda i: ys[i])
    out = [0.0] * len(ys)
    prev = -math.inf
    for i in order:
        out[i] = max(ys[i], prev + gap)
        prev = out[i]
    over = (prev - hi) if order and prev > hi else 0.0
    return [max(lo, y - over) for y in out]


def line_chart(
    title: str,
    xs: Sequence[float],
    series: dict[str, Sequence[float]],
    x_label: str,
    y_label: str,
    y_range: tuple[float, float] | None = None,
) -> str:
    """One polyline per series (NaN breaks a line). Series are told apart without colour: each
    has its own dash pattern and marker shape, and its name is written at the end of its line
    (labels nudged apart when the lines end on the same value)."""
    finite = [v for s in series.values() for v in s if math.isfinite(v)]
    lo, hi = y_range if y_range else (min(finite, default=0.0), _nice_max(max(finite, default=1.0)))
    if hi <= lo:
        hi = lo + 1.0
    x0, x1 = (min(xs), max(xs)) if len(xs) else (0.0, 1.0)
    if x1 <= x0:
        x1 = x0 + 1
    label_w = 118  # room right of the plot for the direct labels
    right = W - PAD_R - label_w
    top = PAD_T + 10  # room above the top gridline for markers drawn on it
    plot_w, plot_h = right - PAD_L, H - top - PAD_B
    body = []
    for i in range(6):
        v = lo + (hi - lo) * i / 5
        y = H - PAD_B - plot_h * i / 5
        body.append(f'<line x1="{PAD_L}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#e3e3e3"/>')
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
        f'<line x1="{PAD_L}" y1="{H - PAD_B}" x2="{right}" y2="{H - PAD_B}" stroke="#333"/>'
    )
    body.append(f'<line x1="{PAD_L}" y1="{top}" x2="{PAD_L}" y2="{H - PAD_B}" stroke="#333"/>')
    every = max(1, math.ceil(len(xs) / 24))  # markers on at most ~24 points a series
    ends: list[tuple[int, str, float, float]] = []  # series, name, last x, last y (pixels)
    for k, (name, ys) in enumerate(series.items()):
        color, dash, shape = LINES[k % len(LINES)], DASHES[k % len(DASHES)], MARKERS[k % 4]
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        runs: list[list[tuple[float, float]]] = [[]]
        marks = []
        for n, (x, y) in enumerate(zip(xs, ys, strict=True)):
            if not math.isfinite(y):
                runs.append([])
                continue
            px = PAD_L + plot_w * (x - x0) / (x1 - x0)
            py = H - PAD_B - plot_h * (min(max(y, lo), hi) - lo) / (hi - lo)
            runs[-1].append((px, py))
            if n % every == 0:
                marks.append(_marker(shape, px, py, color, k))
        for pts in runs:
            if len(pts) > 1:
                body.append(
                    f'<polyline class="series" data-series="{k}" data-name="{escape(name)}" '
                    f'fill="none" stroke="{color}" stroke-width="2"{dash_attr} points="'
                    + " ".join(f"{px:.1f},{py:.1f}" for px, py in pts)
                    + '"/>'
                )
        body.extend(marks)
        last = [p for run in runs for p in run]
        if last:
            ends.append((k, name, last[-1][0], last[-1][1]))
    ys = _spread([e[3] for e in ends], 13.0, top, H - PAD_B)
    for (k, name, px, py), ly in zip(ends, ys, strict=True):
        color = LINES[k % len(LINES)]
        body.append(
            f'<line x1="{px + 6:.1f}" y1="{py:.1f}" x2="{right + 8:.1f}" y2="{ly:.1f}" stroke="{color}" stroke-width="0.8"/>'
        )
        body.append(
            f'<text class="direct-label" data-series="{k}" x="{right + 11:.1f}" y="{ly + 4:.1f}" font-size="11" fill="{color}">{escape(name)}</text>'
        )
    return _frame(title, body, x_label, y_label)


@dataclass(frozen=True)
class Scale:
    """How a heatmap turns a value into a shade (0 = white, 1 = the darkest colour), and the
    values its legend prints: `ticks` = (value, label)."""

    shade: Callable[[float], float]
    ticks: Sequence[tuple[float, str]]
    name: str


def heat_rgb(frac: float) -> tuple[int, int, int]:
    """The heatmap colour of shade `frac` in [0, 1]: white to HEAT_RGB."""
    return tuple(round(255 - frac * (255 - c)) for c in HEAT_RGB)  # type: ignore[return-value]


def _rgb(frac: float) -> str:
    r, g, b = heat_rgb(frac)
    return f"rgb({r},{g},{b})"


def linear_scale(lo: float = 0.0, hi: float = 1.0) -> Scale:
    def shade(v: float) -> float:
        return min(1.0, max(0.0, (v - lo) / ((hi - lo) or 1.0)))

    ticks = [(lo + (hi - lo) * i / 4, _fmt(lo + (hi - lo) * i / 4)) for i in range(5)]
    return Scale(shade, ticks, "value")


@dataclass(frozen=True)
class Mark:
    """An outlined cell: `kind` is "match" (solid) or "miss" (dashed); `why` goes into its
    hover title."""

    kind: str
    why: str


def heatmap(
    title: str,
    matrix: Sequence[Sequence[float]],
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    x_label: str,
    y_label: str,
    scale: Scale | None = None,
    marks: dict[tuple[int, int], Mark] | None = None,
    mark_key: dict[str, str] | None = None,
    row_groups: Sequence[tuple[int, str]] = (),
    cls: str = "heatmap",
) -> str:
    """Cells shaded by `scale` (white = low), the value printed when cells are big enough, a
    colour legend with the scale's values on the right, row labels left, column labels below,
    and `marks` outlined on their cells (`mark_key`: kind -> what it means, drawn under the
    legend). `row_groups`: (first row, name) of groups of rows separated by a gap."""
    scale = scale or linear_scale()
    marks = marks or {}
    rows, cols = len(matrix), max((len(r) for r in matrix), default=0)
    cell = max(10.0, min(64.0, 460 / max(1, cols), 300 / max(1, rows)))
    label_w = 8 + 6.4 * max((len(str(s)) for s in row_labels), default=4)
    gap = 10.0
    starts = {first for first, _ in row_groups if first > 0}

    def row_y(i: int) -> float:
        return PAD_T + 8 + i * cell + gap * sum(1 for s in starts if s <= i)

    x0 = 24 + label_w  # first cell's left edge
    grid_r = x0 + cols * cell
    grid_b = row_y(rows - 1) + cell if rows else PAD_T + 8
    legend_x = grid_r + 26
    legend_h = max(120.0, min(220.0, grid_b - PAD_T - 22))
    w = int(max(W, legend_x + 200))
    h = int(max(H - 60, grid_b + 54, PAD_T + 22 + legend_h + 40 + 18 * len(mark_key or {})))
    body = []
    for first, name in row_groups:
        body.append(
            f'<text class="row-group" x="{x0:.1f}" y="{row_y(first) - 2:.1f}" font-size="10" fill="#555">{escape(name)}</text>'
        )
    for i, row in enumerate(matrix):
        y = row_y(i)
        body.append(
            f'<text class="row-label" data-row="{i}" x="{x0 - 6:.1f}" y="{y + cell / 2 + 4:.1f}" text-anchor="end" font-size="11">{escape(str(row_labels[i]))}</text>'
        )
        for j, v in enumerate(row):
            x = x0 + j * cell
            ok = math.isfinite(v)
            frac = scale.shade(v) if ok else 0.0
            fill = _rgb(frac) if ok else "#dddddd"
            body.append(
                f'<rect class="cell" data-row="{i}" data-col="{j}" data-value="{v:.6g}" x="{x:.1f}" y="{y:.1f}" width="{cell:.1f}" height="{cell:.1f}" fill="{fill}" stroke="#fff"><title>{escape(f"{row_labels[i]} x {col_labels[j]}: {v:.6g}")}</title></rect>'
            )
            if cell >= 40 and ok:
                tc = "#fff" if frac > 0.55 else "#000"
                body.append(
                    f'<text x="{x + cell / 2:.1f}" y="{y + cell / 2 + 4:.1f}" text-anchor="middle" font-size="10" fill="{tc}">{v:.4f}</text>'
                )
    for (i, j), m in sorted(marks.items()):
        if i >= rows or j >= cols:
            continue
        color, dash = (
            (MARK_MATCH, "") if m.kind == "match" else (MARK_MISS, ' stroke-dasharray="5 3"')
        )
        x, y = x0 + j * cell, row_y(i)
        body.append(
            f'<rect class="mark mark-{m.kind}" data-row="{i}" data-col="{j}" x="{x + 2:.1f}" y="{y + 2:.1f}" width="{cell - 4:.1f}" height="{cell - 4:.1f}" fill="none" stroke="{color}" stroke-width="3"{dash}><title>{escape(m.why)}</title></rect>'
        )
    # a label may take two lines ("\n"); narrow columns are labelled every few, and always
    # where a mark is
    every = max(1, math.ceil(26 / cell))
    marked_cols = {j for _, j in marks}
    for j, lab in enumerate(col_labels):
        near_mark = any(0 < abs(j - m) < every for m in marked_cols)
        if j not in marked_cols and (j % every or near_mark):
            continue
        x = x0 + j * cell + cell / 2
        lines = "".join(
            f'<tspan x="{x:.1f}" dy="{0 if n == 0 else 12}">{escape(part)}</tspan>'
            for n, part in enumerate(str(lab).split("\n"))
        )
        body.append(
            f'<text class="col-label" data-col="{j}" x="{x:.1f}" y="{grid_b + 14:.1f}" text-anchor="middle" font-size="11">{lines}</text>'
        )
    body.extend(_legend(scale, legend_x, PAD_T + 22, legend_h))
    ky = PAD_T + 22 + legend_h + 28
    for kind, text in (mark_key or {}).items():
        color, dash = (
            (MARK_MATCH, "") if kind == "match" else (MARK_MISS, ' stroke-dasharray="5 3"')
        )
        body.append(
            f'<rect class="mark-key" data-kind="{kind}" x="{legend_x:.1f}" y="{ky - 10:.1f}" width="14" height="14" fill="none" stroke="{color}" stroke-width="3"{dash}/>'
            f'<text x="{legend_x + 20:.1f}" y="{ky + 1:.1f}" font-size="10">{escape(text)}</text>'
        )
        ky += 18
    return "\n".join(
        [
            *_open(title, w, h, cls),
            *body,
            f'<text class="x-label" x="{(x0 + grid_r) / 2:.1f}" y="{grid_b + 44:.1f}" text-anchor="middle" font-size="12">{escape(x_label)}</text>',
            f'<text class="y-label" x="14" y="{(PAD_T + grid_b) / 2:.1f}" text-anchor="middle" font-size="12" transform="rotate(-90 14 {(PAD_T + grid_b) / 2:.1f})">{escape(y_label)}</text>',
            "</svg>",
        ]
    )


def _legend(scale: Scale, x: float, top: float, height: float, steps: int = 48) -> list[str]:
    """A vertical colour bar (top = shade 1), one flat band per step (no gradient: nothing in
    the page is a url() reference), ticks at the scale's values."""
    out = [
        f'<text class="legend-title" x="{x:.1f}" y="{top - 6:.1f}" font-size="10">{escape(scale.name)}</text>'
    ]
    band = height / steps
    for s in range(steps):
        frac = 1.0 - (s + 0.5) / steps
        out.append(
            f'<rect class="legend-band" x="{x:.1f}" y="{top + s * band:.2f}" width="16" height="{band + 0.3:.2f}" fill="{_rgb(frac)}"/>'
        )
    out.append(
        f'<rect x="{x:.1f}" y="{top:.1f}" width="16" height="{height:.1f}" fill="none" stroke="#888"/>'
    )
    for v, label in scale.ticks:
        y = top + (1.0 - scale.shade(v)) * height
        out.append(
            f'<line x1="{x + 16:.1f}" y1="{y:.1f}" x2="{x + 21:.1f}" y2="{y:.1f}" stroke="#333"/>'
            f'<text class="legend-tick" data-value="{v:.6g}" data-y="{y:.1f}" x="{x + 24:.1f}" y="{y + 4:.1f}" font-size="10">{escape(label)}</text>'
        )
    return out


@dataclass(frozen=True)
class Interval:
    """One value with its spread (a confidence interval)."""

    value: float
    lo: float
    hi: float


def impact_bars(
    title: str,
    served: Interval,
    fixed: Interval,
    realized: Interval | None,
    x_max: float,
    x_label: str,
) -> str:
    """Two horizontal bars from 0, as served and as fixed, with whiskers for their spread;
    the realized value (from the trace) as a diamond on the served bar."""
    w, h = W, 150
    left, right = 92, W - 120
    bar_h = 24.0

    def px(v: float) -> float:
        return left + (right - left) * min(max(v, 0.0), x_max) / x_max

    body = []
    n_ticks = int(x_max) if float(x_max).is_integer() and x_max <= 10 else 5
    axis_y = PAD_T + 2 * (bar_h + 14) + 6
    for i in range(n_ticks + 1):
        v = x_max * i / n_ticks
        body.append(
            f'<line x1="{px(v):.1f}" y1="{PAD_T}" x2="{px(v):.1f}" y2="{axis_y:.1f}" stroke="#e3e3e3"/>'
            f'<text x="{px(v):.1f}" y="{axis_y + 14:.1f}" text-anchor="middle" font-size="11">{_fmt(v)}</text>'
        )
    diamond = px(realized.value) + 7 if realized is not None else 0.0  # its right corner
    for k, (name, iv, color) in enumerate((("as served", served, SERVED), ("fixed", fixed, FIXED))):
        y = PAD_T + 8 + k * (bar_h + 14)
        cy = y + bar_h / 2
        kind = "served" if k == 0 else "fixed"
        body.append(
            f'<text x="{left - 8}" y="{cy + 4:.1f}" text-anchor="end" font-size="12">{name}</text>'
            f'<rect class="impact-bar" data-kind="{kind}" data-value="{iv.value:.6g}" x="{left}" y="{y:.1f}" width="{px(iv.value) - left:.1f}" height="{bar_h}" fill="{color}"><title>{name}: {iv.value:.3f} [{iv.lo:.3f}, {iv.hi:.3f}]</title></rect>'
            f'<path class="whisker" data-kind="{kind}" data-lo="{iv.lo:.6g}" data-hi="{iv.hi:.6g}" d="M{px(iv.lo):.1f},{cy:.1f}H{px(iv.hi):.1f}M{px(iv.lo):.1f},{cy - 6:.1f}V{cy + 6:.1f}M{px(iv.hi):.1f},{cy - 6:.1f}V{cy + 6:.1f}" stroke="#222" stroke-width="1.5" fill="none"/>'
            f'<text class="impact-value" data-kind="{kind}" x="{max(px(iv.value), px(iv.hi), diamond if k == 0 else 0.0) + 8:.1f}" y="{cy + 4:.1f}" font-size="12">{iv.value:.2f} [{iv.lo:.2f}, {iv.hi:.2f}]</text>'
        )
    if realized is not None:
        cy = PAD_T + 8 + bar_h / 2
        x = px(realized.value)
        body.append(
            f'<polygon class="realized" data-value="{realized.value:.6g}" points="{x:.1f},{cy - 7:.1f} {x + 7:.1f},{cy:.1f} {x:.1f},{cy + 7:.1f} {x - 7:.1f},{cy:.1f}" fill="{REALIZED}" stroke="#fff" stroke-width="1"><title>realized in the trace: {realized.value:.3f} [{realized.lo:.3f}, {realized.hi:.3f}]</title></polygon>'
        )
    body.append(
        f'<line x1="{left}" y1="{axis_y:.1f}" x2="{right}" y2="{axis_y:.1f}" stroke="#333"/>'
        f'<line x1="{left}" y1="{PAD_T}" x2="{left}" y2="{axis_y:.1f}" stroke="#333"/>'
        f'<text class="x-label" x="{(left + right) / 2}" y="{h - 6}" text-anchor="middle" font-size="12">{escape(x_label)}</text>'
    )
    return "\n".join([*_open(title, w, h, "impact"), *body, "</svg>"])
