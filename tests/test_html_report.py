"""`hstrace report --html`: one self-contained page; rendered for real in headless Chromium.

Two replay results are drawn. `replay_json` is built from the replay room's real types
(`ReplayResult`, `Finding`, `slot_matrix` on recorded hidden states) for a demo trace; the
pictures that explain the why (issue 28 item 4) are checked on the real replay of the bundled
`traces/examples/aux-layer-shift.zarr` against the tiny world's training dumps (serving captured
HF layers [3, 5, 6] where training used [2, 4, 5]), drawn by Chromium and checked pixel by pixel.

Named stand-in: the `impact` of a finding (issue 28 items 1-3, docs/replay-json.md) is not
computed by replay yet (another branch); until it lands, `STAND_IN_IMPACT` is a dict built to
the shared contract by hand, not a measurement. Only how the page draws it is tested with it.
"""

from __future__ import annotations

import copy
import re
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import numpy as np
import pytest
from helpers.cli import EXAMPLES, TRAINING, run_cli, run_main
from helpers.demo_trace import LAYER_IDS, H, K

from hstrace.bundle import BundleOptions, make_bundle
from hstrace.findings import Finding
from hstrace.html import svg, write_report_html
from hstrace.pipelines import replay_trace
from hstrace.replay.compare import SAME_COS, as_slots, slot_matrix
from hstrace.replay.result import ReplayResult
from hstrace.trace import open_trace

ARTIFACTS = Path(__file__).parent / "artifacts"
WINDOW = (1280, 1700)
BAR_RGB = (0x3B, 0x6E, 0xA8)  # hstrace.html.svg.BAR


@pytest.fixture(scope="module")
def trace(demo_trace) -> Path:
    return demo_trace(rounds=12)


def replay_json(trace: Path) -> dict:
    """A fault verdict with a real slot matrix: serving slots vs a layer-shifted training copy."""
    h = open_trace(trace).rank(0).table("target").column("tok", "aux_hidden")
    serving = as_slots(h, H)
    training = serving.roll(1, dims=1)  # training stored the slots one place over
    m = slot_matrix(serving, training)
    result = ReplayResult(
        findings=[
            Finding(
                "aux-layer-shift",
                "serving slot i matches training slot i+1: captured layers are shifted by one",
                {"best": m.best.tolist()},
                fix="set eagle_aux_hidden_state_layer_ids to the training convention",
            ),
            Finding(
                "metric-overstates",
                "the training metric overstates greedy acceptance",
                severity="warning",
            ),
        ],
        metrics={
            "engine_vs_reference_top1": 0.41,
            "engine_vs_reference_topk": 0.63,
            "engine_vs_reference": {
                "rows": 120,
                "by_step": [
                    {"step": s, "top1_agreement": 0.3 + 0.02 * s, "topk_agreement": 0.6}
                    for s in range(12)
                ],
            },
        },
        fingerprints={"serving_x_training": m.to_json()},
        skipped={"teacher-norm": "no target model given"},
    )
    return result.to_json()


def test_page_is_self_contained_and_leads_with_the_verdict(trace, tmp_path):
    out = write_report_html(open_trace(trace), tmp_path / "r.html", replay_json(trace))
    page = out.read_text()
    assert page.index("aux-layer-shift") < page.index("<svg")  # verdict first, plots after
    assert "<script" not in page.lower()
    # nothing is fetched: no src/href attributes and no url() in CSS
    assert not re.search(r"\s(src|href)\s*=", page) and "url(" not in page and "@import" not in page
    assert page.count("<svg") == 4  # by position, histogram, heatmap, agreement over steps
    assert page.count('class="cell"') == K * K
    assert "no target model given" in page  # checks that could not run are listed
    # no target forward in this replay: the rows carry the engine's recorded ids, named as such,
    # and nothing claims an HF layer
    heat = _svgs(page)["heatmap slots"]
    rows = [_text(t) for t in _all(heat, "text", "row-label")]
    assert rows == [f"serving {i} · id {layer}" for i, layer in enumerate(LAYER_IDS)]
    assert "HF" not in _text(heat) and "heatmap layers" not in page
    # without a replay the page says so instead of inventing a verdict
    plain = write_report_html(open_trace(trace), tmp_path / "p.html").read_text()
    assert "not replayed" in plain and plain.count("<svg") == 2


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if p := shutil.which(name):
            return p
    return None


def _png_pixels(path: Path) -> np.ndarray:
    """Decode an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes) to [H, W, C]."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, []
    while pos < len(data):
        n, typ = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + n]
        pos += 12 + n
        if typ == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
        elif typ == b"IDAT":
            idat.append(body)
    assert depth == 8 and ctype in (2, 6) and interlace == 0
    bpp = 3 if ctype == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8).reshape(h, w * bpp + 1)
    out = np.zeros((h, w * bpp), np.uint8)
    prev = np.zeros(w * bpp, np.int64)
    for y in range(h):
        f, line = raw[y, 0], raw[y, 1:].astype(np.int64)
        if f == 0:
            cur = line
        elif f == 1:  # Sub: running sum per channel
            cur = np.cumsum(line.reshape(w, bpp), axis=0).reshape(-1) % 256
        elif f == 2:  # Up
            cur = (line + prev) % 256
        else:  # Average / Paeth: sequential along the row
            cur_l, lst, up = [0] * (w * bpp), line.tolist(), prev.tolist()
            for i in range(w * bpp):
                a = cur_l[i - bpp] if i >= bpp else 0
                b = up[i]
                if f == 3:
                    pred = (a + b) // 2
                else:
                    c = up[i - bpp] if i >= bpp else 0
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                cur_l[i] = (lst[i] + pred) % 256
            cur = np.array(cur_l, np.int64)
        out[y] = cur
        prev = cur
    return out.reshape(h, w, bpp)[:, :, :3]


def test_chromium_renders_the_page(trace, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium: scripts/test.sh installs Debian's chromium when run as root")
    ARTIFACTS.mkdir(exist_ok=True)
    bundle = make_bundle(
        trace, tmp_path / "b.zip", BundleOptions()
    ).path  # the page reads bundles too
    page = write_report_html(open_trace(bundle), ARTIFACTS / "report.html", replay_json(trace))
    shot = ARTIFACTS / "report.png"
    shot.unlink(missing_ok=True)
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    proc = subprocess.run(
        [
            browser,
            *flags,
            f"--window-size={WINDOW[0]},{WINDOW[1]}",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.exists(), proc.stderr[-2000:]
    px = _png_pixels(shot)
    assert px.shape[:2] == (WINDOW[1], WINDOW[0])
    non_white = (px < 245).any(axis=2).mean()
    assert non_white > 0.03, f"page looks blank: {non_white:.3%} non-white pixels"
    bars = (np.abs(px.astype(int) - BAR_RGB).max(axis=2) <= 2).sum()
    assert bars > 2000, f"the SVG bars were not drawn ({bars} bar-coloured pixels)"
    assert len({tuple(p) for p in px[::7, ::7].reshape(-1, 3)}) > 20  # text, plots, heatmap shades
    dom = subprocess.run(
        [browser, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120
    ).stdout
    assert 'id="verdict"' in dom and "aux-layer-shift" in dom and dom.count("<svg") == 4


def test_report_cli(trace, tmp_path):
    out = run_main("report", str(trace), "--html", str(tmp_path / "x.html"))
    assert out.returncode == 0 and "not replayed" in out.stdout
    assert (tmp_path / "x.html").read_text().count("<svg") == 2
    # through a real interpreter (subprocess): exit 2, no traceback
    bad = run_cli("report", str(tmp_path / "missing.zarr"), "--html", str(tmp_path / "y.html"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    bad = run_main("report", str(trace), "--html", str(tmp_path / "no" / "dir.html"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


# -- the pictures that explain the why (issue 28 item 4), on a real replay ---------------------

SHIFT = EXAMPLES / "aux-layer-shift.zarr"
SVG_NS = "{http://www.w3.org/2000/svg}"
# Named stand-in (module docstring): an `impact` built by hand to the contract, not computed.
STAND_IN_IMPACT = {
    "metric": "expected_accept_length",
    "num_speculative_tokens": 3,
    "topk": 1,
    "tokens": 260,
    "steps": 120,
    "served": {"accept_length": 1.21, "ci": [1.10, 1.33], "per_position": [0.15, 0.05, 0.01]},
    "fixed": {"accept_length": 2.93, "ci": [2.80, 3.05], "per_position": [0.90, 0.70, 0.33]},
    "realized": {"accept_length": 1.19, "ci": [1.06, 1.30], "per_position": [0.14, 0.04, 0.01]},
    "estimate_agrees": True,
    "gain": 1.72,
    "gain_ci": [1.55, 1.90],  # in i-impact's docs/replay-json.md, beyond the brief's contract
    "measurable": True,
    "fix": "set eagle_aux_hidden_state_layer_ids",
}


@pytest.fixture(scope="module")
def shift_replay() -> dict:
    """The real replay (target forward included) of the bundled aux-layer-shift trace, with the
    stand-in impact on its one fault finding."""
    doc = replay_trace(SHIFT, TRAINING).to_json()
    assert doc["verdict"]["code"] == "aux-layer-shift"
    assert [f["severity"] for f in doc["findings"]] == ["fault"]
    doc["findings"][0]["impact"] = copy.deepcopy(STAND_IN_IMPACT)
    return doc


def _svgs(html: str) -> dict[str, ET.Element]:
    """Every <svg> of a page (our file or Chromium's DOM), by its class ("heatmap slots", ...)
    or, without one, its aria-label."""
    out = {}
    for m in re.finditer(r"<svg\b.*?</svg>", html, re.S):
        el = ET.fromstring(m.group(0))
        out[el.get("class") or el.get("aria-label")] = el
    return out


def _all(el: ET.Element, tag: str, cls: str | None = None) -> list[ET.Element]:
    found = el.iter() if tag == "*" else el.iter(SVG_NS + tag)
    return [e for e in found if cls is None or cls in (e.get("class") or "").split()]


def _text(el: ET.Element) -> str:
    return " ".join(t.strip() for t in el.itertext() if t.strip())


def _expected_marks(cos: list[list[float]]) -> set[tuple[int, int, str]]:
    """What the capture check decides on, worked out here from the matrix: a diagonal cell below
    SAME_COS is a miss; a row's best cell at or above it is where that slot's state is."""
    out = set()
    for i, row in enumerate(cos):
        if row[i] < SAME_COS:
            out.add((i, i, "miss"))
        j = int(np.argmax(row))
        if row[j] >= SAME_COS:
            out.add((i, j, "match"))
    return out


def _marks(el: ET.Element) -> set[tuple[int, int, str]]:
    return {
        (int(m.get("data-row")), int(m.get("data-col")), m.get("class").split()[1][5:])
        for m in _all(el, "rect", "mark")
    }


def check_slot_heatmap(el: ET.Element, caption: str, replay: dict) -> None:
    """Axes labelled with the HF layers both sides hold, the legend with its values, the
    decisive cells marked, the caption on the diagonal: against the real replay's numbers."""
    fps = replay["fingerprints"]
    cos = fps["serving_x_training"]["cos"]
    assert fps["serving_layers"]["layer"] == [3, 5, 6]  # what the replay measured
    assert fps["training_layers"]["layer"] == [2, 4, 5]
    rows = [_text(t) for t in _all(el, "text", "row-label")]
    cols = [_text(t) for t in _all(el, "text", "col-label")]
    assert rows == ["serving 0 · HF 3", "serving 1 · HF 5", "serving 2 · HF 6"]
    assert cols == ["training 0 HF 2", "training 1 HF 4", "training 2 HF 5"]
    assert "HF layer" in _text(_all(el, "text", "x-label")[0])
    assert "HF layer" in _text(_all(el, "text", "y-label")[0])
    cells = {(int(c.get("data-row")), int(c.get("data-col"))): c for c in _all(el, "rect", "cell")}
    assert len(cells) == 9
    for (i, j), c in cells.items():
        assert float(c.get("data-value")) == pytest.approx(cos[i][j], abs=1e-6)
    # the legend: its ticks print the scale's values, its bands run dark (top) to white
    ticks = {float(t.get("data-value")): _text(t) for t in _all(el, "text", "legend-tick")}
    assert ticks[SAME_COS] == f"{SAME_COS:g} same state" and ticks[0.9] == "0.9"
    assert "≥ 0.9999" in ticks.values() and "≤ 0" in ticks.values()
    bands = [
        sum(int(x) for x in re.findall(r"\d+", b.get("fill")))
        for b in _all(el, "rect", "legend-band")
    ]
    assert len(bands) == 48 and bands == sorted(bands) and bands[0] < bands[-1]
    # the decisive cells: serving slot 1 holds training slot 2's state (both HF layer 5), and
    # no diagonal cell reaches SAME_COS
    marks = _marks(el)
    assert marks == _expected_marks(cos)
    assert marks == {(1, 2, "match"), (0, 0, "miss"), (1, 1, "miss"), (2, 2, "miss")}
    assert rows[1].endswith("HF 5") and cols[2].endswith("HF 5")
    keys = {k.get("data-kind") for k in _all(el, "rect", "mark-key")}
    assert keys == {"match", "miss"}
    diag = ", ".join(f"{cos[i][i]:.4f}" for i in range(3))
    assert "The diagonal asks" in caption and f"the diagonal reads {diag}" in caption
    assert "serving slot 1 holds training slot 2's state" in caption
    assert "decided aux-layer-shift" in caption


def check_layer_heatmap(el: ET.Element) -> None:
    cols = [_text(t) for t in _all(el, "text", "col-label")]
    assert cols == ["0 emb", *(str(j) for j in range(1, 9))]  # 8 layers + the embeddings
    rows = [_text(t) for t in _all(el, "text", "row-label")]
    assert rows == [f"{side} {i}" for side in ("serving", "training") for i in range(3)]
    # the layer each slot holds, outlined: serving [3, 5, 6], training [2, 4, 5]
    expected = {(i, layer, "match") for i, layer in enumerate([3, 5, 6, 2, 4, 5])}
    assert _marks(el) == expected


def check_impact(el: ET.Element, imp: dict) -> None:
    """Bars from 0 with lengths proportional to the values, whiskers at the spread, the realized
    diamond, the numbers printed: against the impact dict."""
    bars = {b.get("data-kind"): b for b in _all(el, "rect", "impact-bar")}
    whiskers = {w.get("data-kind"): w for w in _all(el, "path", "whisker")}
    widths = {}
    for kind in ("served", "fixed"):
        part = imp[kind]
        assert float(bars[kind].get("data-value")) == part["accept_length"]
        assert [float(whiskers[kind].get(k)) for k in ("data-lo", "data-hi")] == part["ci"]
        widths[kind] = float(bars[kind].get("width")) / part["accept_length"]
    assert widths["served"] == pytest.approx(widths["fixed"], rel=0.005)  # px per unit, both
    (realized,) = _all(el, "polygon", "realized")
    assert float(realized.get("data-value")) == imp["realized"]["accept_length"]
    values = [_text(t) for t in _all(el, "text", "impact-value")]
    assert values == [
        f"{imp[k]['accept_length']:.2f} [{imp[k]['ci'][0]:.2f}, {imp[k]['ci'][1]:.2f}]"
        for k in ("served", "fixed")
    ]


def check_agreement(el: ET.Element, replay: dict) -> None:
    by_step = replay["metrics"]["engine_vs_reference"]["by_step"]
    # the real case the styles exist for: the two series coincide at every step
    assert all(p["top1_agreement"] == p["topk_agreement"] for p in by_step)
    lines = _all(el, "polyline", "series")
    assert len(lines) == 2 and lines[0].get("points") == lines[1].get("points")
    assert lines[0].get("stroke-dasharray") is None and lines[1].get("stroke-dasharray")
    shapes = {m.get("data-series"): m.tag for m in _all(el, "*", "marker") if m.get("data-series")}
    assert shapes == {"0": SVG_NS + "circle", "1": SVG_NS + "rect"}
    labels = {t.get("data-series"): t for t in _all(el, "text", "direct-label")}
    assert _text(labels["0"]) == "top-1 agreement" and _text(labels["1"]) == "top-k overlap"
    assert abs(float(labels["0"].get("y")) - float(labels["1"].get("y"))) >= 12


def _captions(html: str) -> dict[str, str]:
    """figure -> its caption, keyed by the class of the figure's svg."""
    out = {}
    for m in re.finditer(r"<figure[^>]*>(.*?)</figure>", html, re.S):
        svg_m = re.search(r'<svg[^>]*class="([^"]+)"', m.group(1))
        cap = re.search(r"<figcaption>(.*?)</figcaption>", m.group(1), re.S)
        if svg_m and cap:
            out[svg_m.group(1)] = cap.group(1).replace("&#x27;", "'")
    return out


def _expected_headline(code: str, imp: dict) -> str:
    s, f = imp["served"]["accept_length"], imp["fixed"]["accept_length"]
    if imp["measurable"]:
        return f"{code}: fixing it raises the expected accept length {s:.2f} → {f:.2f} ({imp['gain']:+.2f}"
    return f"{code}: costs nothing measurable on these tokens ({s:.2f} → {f:.2f}, gain"


def test_pictures_explain_the_verdict(shift_replay, tmp_path):
    """The file as written (Chromium's DOM is checked the same way in the render test)."""
    page = write_report_html(open_trace(SHIFT), tmp_path / "r.html", shift_replay).read_text()
    els, caps = _svgs(page), _captions(page)
    check_slot_heatmap(els["heatmap slots"], caps["heatmap slots"], shift_replay)
    check_layer_heatmap(els["heatmap layers"])
    imp = shift_replay["findings"][0]["impact"]
    check_impact(els["impact"], imp)
    check_agreement(els["Engine vs reference drafter agreement over steps"], shift_replay)
    assert _expected_headline("aux-layer-shift", imp) in page
    agrees = {True: "as-served estimate agrees with it", False: "does NOT agree with it"}
    assert agrees[imp["estimate_agrees"]] in page
    assert "<script" not in page.lower() and "url(" not in page


def test_impact_unavailable_unmeasurable_and_all(shift_replay, tmp_path):
    """A finding without an impact says why; one whose gain is within the spread says it costs
    nothing measurable; `impact_all` gets its own bar (stand-in impacts, module docstring)."""
    doc = copy.deepcopy(shift_replay)
    doc["findings"][0]["impact"] = None
    doc["findings"][0]["impact_unavailable"] = "the drafter has no embedding and no target"
    page = write_report_html(open_trace(SHIFT), tmp_path / "a.html", doc).read_text()
    assert "impact-unavailable" in page and "the drafter has no embedding and no target" in page
    assert "impact not computed" in page and '<figure class="impact"' not in page
    flat = copy.deepcopy(STAND_IN_IMPACT)
    flat["fixed"] = {"accept_length": 1.24, "ci": [1.12, 1.36], "per_position": [0.16, 0.06, 0.02]}
    flat.update(gain=0.03, gain_ci=[-0.08, 0.14], measurable=False, estimate_agrees=False)
    doc["findings"][0].update(impact=flat, impact_unavailable=None)
    doc["impact_all"] = {k: v for k, v in STAND_IN_IMPACT.items() if k != "fix"}
    page = write_report_html(open_trace(SHIFT), tmp_path / "b.html", doc).read_text()
    assert (
        "costs nothing measurable on these tokens (1.21 → 1.24, gain +0.03 [-0.08, +0.14]" in page
    )
    assert "still a fault, low priority" in page and "does NOT agree" in page
    assert page.count('<figure class="impact"') == 2
    assert "every fault fixed: fixing it raises the expected accept length 1.21 → 2.93" in page
    # a replay that computed no impact at all (made before it existed) draws no section
    old = copy.deepcopy(shift_replay)
    del old["findings"][0]["impact"]
    page = write_report_html(open_trace(SHIFT), tmp_path / "c.html", old).read_text()
    assert "What each fault costs" not in page


def _near(px: np.ndarray, x: float, y: float, rgb, tol: int = 40, r: int = 1) -> bool:
    """Some pixel within r of (x, y) is within tol (per channel) of rgb."""
    x, y = round(x), round(y)
    win = px[max(0, y - r) : y + r + 1, max(0, x - r) : x + r + 1].astype(int)
    return bool((np.abs(win - rgb).max(axis=2) <= tol).any())


def _hex(c: str) -> tuple[int, int, int]:
    return tuple(int(c[i : i + 2], 16) for i in (1, 3, 5))


def _shoot(
    browser: str, page: Path, size: tuple[int, int], shot: Path, profile: Path
) -> np.ndarray:
    shot.unlink(missing_ok=True)
    proc = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            "--force-device-scale-factor=1",
            f"--user-data-dir={profile}",
            f"--window-size={size[0]},{size[1]}",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.exists(), proc.stderr[-2000:]
    px = _png_pixels(shot)
    assert px.shape[:2] == (size[1], size[0])
    return px


def test_chromium_draws_the_pictures_that_explain_the_why(shift_replay, tmp_path):
    """The report page's own SVGs, laid out at known offsets and drawn by Chromium: the marked
    cells are outlined (solid or dashed) and no other cell is, each cell's shade sits where the
    legend puts its value, the impact bars' drawn lengths are proportional to their values, the
    realized diamond sits at its value, and the two coinciding agreement lines both show."""
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium: scripts/test.sh installs Debian's chromium when run as root")
    ARTIFACTS.mkdir(exist_ok=True)
    report = write_report_html(open_trace(SHIFT), ARTIFACTS / "why.html", shift_replay)
    page = report.read_text()
    # the browser's DOM of the whole page holds the same pictures
    dom = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={tmp_path / 'p0'}",
            "--dump-dom",
            report.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    els, caps = _svgs(dom), _captions(dom)
    check_slot_heatmap(els["heatmap slots"], caps["heatmap slots"], shift_replay)
    check_layer_heatmap(els["heatmap layers"])
    check_impact(els["impact"], shift_replay["findings"][0]["impact"])
    agreement = "Engine vs reference drafter agreement over steps"
    check_agreement(els[agreement], shift_replay)
    # the whole page drawn (kept in tests/artifacts/why.png for a human): the marks and both
    # impact bars are on it
    whole = _shoot(browser, report, (1280, 3000), ARTIFACTS / "why.png", tmp_path / "p2")
    for color in (svg.MARK_MATCH, svg.MARK_MISS, svg.SERVED, svg.FIXED):
        assert (np.abs(whole.astype(int) - _hex(color)).max(axis=2) <= 10).sum() > 100, color
    # the same SVG strings, stacked at known offsets
    raw = {
        ET.fromstring(m.group(0)).get("class")
        or ET.fromstring(m.group(0)).get("aria-label"): m.group(0)
        for m in re.finditer(r"<svg\b.*?</svg>", page, re.S)
    }
    order = ["heatmap slots", "impact", agreement]
    top, divs, offset = 0, [], {}
    for name in order:
        el = ET.fromstring(raw[name])
        offset[name] = top
        divs.append(f'<div style="position:absolute;left:0;top:{top}px">{raw[name]}</div>')
        top += int(el.get("height")) + 10
    width = max(int(ET.fromstring(raw[n]).get("width")) for n in order)
    harness = ARTIFACTS / "why-svgs.html"
    harness.write_text(
        "<!DOCTYPE html><html><head><meta charset='utf-8'><style>body{margin:0}</style></head>"
        f"<body>{''.join(divs)}</body></html>"
    )
    px = _shoot(browser, harness, (width, top), ARTIFACTS / "why-svgs.png", tmp_path / "p1")

    # slot heatmap: marks by pixels, cell shades against the legend's
    heat, dy = ET.fromstring(raw["heatmap slots"]), offset["heatmap slots"]
    marks = {(i, j): k for i, j, k in _marks(heat)}
    cells = [
        (
            int(c.get("data-row")),
            int(c.get("data-col")),
            float(c.get("data-value")),
            *(float(c.get(a)) for a in ("x", "y", "width", "height")),
        )
        for c in _all(heat, "rect", "cell")
    ]
    shade = {}
    for i, j, _v, x, y, w, h in cells:
        edge = [(x + 2, dy + y + t) for t in range(5, int(h) - 5)]
        for kind, color in (("match", svg.MARK_MATCH), ("miss", svg.MARK_MISS)):
            hit = np.mean([_near(px, ex, ey, _hex(color), tol=30, r=0) for ex, ey in edge])
            if marks.get((i, j)) == kind:
                # solid: the whole edge; dashed (5 on, 3 off): part of it
                assert (hit > 0.9) if kind == "match" else (0.35 < hit < 0.85), (i, j, kind, hit)
            else:
                assert hit == 0, f"cell {(i, j)} is outlined {kind} but is not decisive"
        shade[(i, j)] = px[round(dy + y + 8), round(x + w / 2)].astype(int)
    # darker where the cosine is higher, and the 1.0000 cell has the legend's top colour
    by_value = sorted(cells, key=lambda c: c[2])
    sums = [int(shade[(c[0], c[1])].sum()) for c in by_value]
    assert all(a > b for a, b in zip(sums, sums[1:], strict=False)), sums
    bands = _all(heat, "rect", "legend-band")
    lx, ly = float(bands[0].get("x")) + 8, float(bands[0].get("y")) + 1
    assert np.abs(shade[(1, 2)] - px[round(dy + ly), round(lx)]).max() <= 6
    ticks = {
        float(t.get("data-value")): float(t.get("data-y"))
        for t in _all(heat, "text", "legend-tick")
    }
    y_top, y_bot = ly + 1, float(bands[-1].get("y")) + float(bands[-1].get("height")) - 2
    at = {  # the legend's colour at each tick, sampled just inside its frame
        v: int(px[round(dy + min(max(y, y_top), y_bot)), round(lx)].astype(int).sum())
        for v, y in ticks.items()
    }
    for i, j, v, *_ in cells:  # each cell's shade lies between its bracketing ticks' shades
        hi_v = min((t for t in ticks if t >= v), default=max(ticks))  # top tick: "≥ 0.9999"
        lo_v = max(t for t in ticks if t <= v)
        assert at[hi_v] - 9 <= int(shade[(i, j)].sum()) <= at[lo_v] + 9, (i, j, v)

    # impact bars: drawn lengths proportional to the values, the realized diamond at its value
    imp, dy = ET.fromstring(raw["impact"]), offset["impact"]
    drawn = {}
    for b in _all(imp, "rect", "impact-bar"):
        x, y = float(b.get("x")), float(b.get("y"))
        color = _hex(b.get("fill"))
        row = px[round(dy + y + 3), :].astype(int)
        on = np.nonzero(np.abs(row - color).max(axis=1) <= 20)[0]
        assert on.size and abs(on[0] - x) <= 1
        drawn[b.get("data-kind")] = (on.min(), on.max() - on.min() + 1, float(b.get("data-value")))
    (x0s, ls, vs), (x0f, lf, vf) = drawn["served"], drawn["fixed"]
    assert x0s == x0f and ls / lf == pytest.approx(vs / vf, abs=0.01), drawn

    def x_of(v: float) -> float:  # the drawn bars' own scale, read off the pixels
        return x0s + ls * v / vs

    (dia,) = _all(imp, "polygon", "realized")
    ys = [float(p.split(",")[1]) for p in dia.get("points").split()]
    cy = dy + (min(ys) + max(ys)) / 2
    r = float(dia.get("data-value"))
    for y in (cy - 4, cy + 4):  # above and below the whisker line
        assert _near(px, x_of(r), y, _hex(svg.REALIZED), tol=30, r=2)
    assert not _near(px, x_of(r), cy - 9, _hex(svg.REALIZED), tol=30, r=1)  # a marker, no bar

    # agreement: the lines coincide, yet both show (dash gaps, both markers, both labels)
    ag, dy = ET.fromstring(raw[agreement]), offset[agreement]
    blue, red = _hex(svg.LINES[0]), _hex(svg.LINES[1])
    pts = [
        tuple(map(float, p.split(",")))
        for p in _all(ag, "polyline", "series")[0].get("points").split()
    ]
    mx = [float(m.get("cx")) for m in _all(ag, "circle", "marker")]
    ly_ = dy + pts[0][1]
    free = [
        x for x in range(round(pts[0][0]), round(pts[-1][0])) if min(abs(x - m) for m in mx) > 8
    ]
    seen = [px[round(ly_), x].astype(int) for x in free]
    n_blue = sum(np.abs(p - blue).max() <= 40 for p in seen)
    n_red = sum(np.abs(p - red).max() <= 40 for p in seen)
    assert n_blue > 0.15 * len(free) and n_red > 0.3 * len(free), (n_blue, n_red, len(free))
    for m in mx[:3]:  # at a shared point: the circle inside, the square around it
        assert _near(px, m, ly_ - 3, blue) and _near(px, m, ly_ - 5.5, red)
    for t in _all(ag, "text", "direct-label"):
        color = blue if t.get("data-series") == "0" else red
        x0, y0 = float(t.get("x")), dy + float(t.get("y"))
        box = px[round(y0) - 9 : round(y0) + 2, round(x0) : round(x0) + 80].astype(int)
        assert (np.abs(box - color).max(axis=2) <= 60).sum() > 20


def test_many_layers_are_labelled_every_few_columns_and_at_every_mark():
    """A 61-layer target (the seed incident's Kimi-K2.5) gives 62 narrow columns: labels every
    few columns so they do not overprint, and always under a marked cell."""
    n = 62
    matrix = [[1.0 - abs(j - c) / n for j in range(n)] for c in (13, 31, 47)]
    marks = {(i, c): svg.Mark("match", "") for i, c in enumerate((13, 31, 47))}
    el = ET.fromstring(
        svg.heatmap("t", matrix, ["a", "b", "c"], [str(j) for j in range(n)], "x", "y", marks=marks)
    )
    labelled = [int(t.get("data-col")) for t in _all(el, "text", "col-label")]
    assert {13, 31, 47} <= set(labelled) and 0 in labelled and len(labelled) < n / 2
    xs = sorted(float(t.get("x")) for t in _all(el, "text", "col-label"))
    assert min(b - a for a, b in zip(xs, xs[1:], strict=False)) >= 26
