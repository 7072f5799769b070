"""`hstrace report --html`: one self-contained page; rendered for real in headless Chromium.

The replay result shown here is built from the replay room's real types (`ReplayResult`,
`Finding`, `slot_matrix` on recorded hidden states); running the replay itself is covered by
the replay room's tests. What is tested here is the page: content, self-containedness, and
that a browser draws it.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
from helpers.cli import run_cli, run_main
from helpers.demo_trace import H, K

from hstrace.bundle import BundleOptions, make_bundle
from hstrace.findings import Finding
from hstrace.html import write_report_html
from hstrace.replay.compare import as_slots, slot_matrix
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
