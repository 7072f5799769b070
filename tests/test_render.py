"""Renderers (hstrace.report): one count of acceptance by position printed the same way by
`hstrace show`, `hstrace report` and a bundle's REPORT.md, both conventions named; the
terminal findings readable in 80 columns with the evidence under each finding. In-process
through click's CliRunner at COLUMNS=80."""

from __future__ import annotations

import re
import zipfile

import numpy as np
import pytest
from helpers.cli import EXAMPLES, TRAINING, invoke

from hstrace.html.verify_stats import acceptance_of
from hstrace.trace import open_trace, summarize
from hstrace.trace.acceptance_by_position import by_position

TRACE = EXAMPLES / "aux-layer-shift.zarr"
_run = invoke  # at COLUMNS=80


def _pct(x):
    return "-" if x is None else f"{x:.1%}"


def test_by_position_counts_offered_reached_accepted_by_hand():
    # rows: (accept_len, n_proposed) = (0, 3), (2, 2), (3, 3), (1, unknown)
    got = by_position(np.array([0, 2, 3, 1]), np.array([3, 2, 3, -1]))
    assert [(p.offered, p.reached, p.accepted) for p in got] == [(4, 4, 3), (4, 3, 2), (3, 1, 1)]
    assert got[2].rate_of_offered == pytest.approx(1 / 3) and got[2].rate_of_reached == 1.0


def test_show_prints_both_conventions_in_80_columns_with_the_numbers_of_every_output(tmp_path):
    with open_trace(TRACE) as tr:
        positions = summarize(tr)["acceptance"]["by_position"]
        html_side = acceptance_of(tr).to_json()["by_position"]
    assert positions and positions == html_side  # one count for show --json and the page
    # the two conventions differ on this trace, so printing one under the other's name shows
    assert any(p["rate_of_offered"] != p["rate_of_reached"] for p in positions)

    out = _run("show", str(TRACE)).output
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "rate_of_offered = accepted / rows that offered position i" in " ".join(out.split())
    assert "rate_of_reached = accepted / rows that reached position i" in " ".join(out.split())
    table_rows = [
        re.findall(r"[\d.%-]+", line)
        for line in out.splitlines()
        if re.match(r"^│\s+\d+ │", line) and line.count("│") == 7
    ]
    want = [
        [
            str(p["position"]),
            str(p["offered"]),
            str(p["reached"]),
            str(p["accepted"]),
            _pct(p["rate_of_offered"]),
            _pct(p["rate_of_reached"]),
        ]
        for p in positions
    ]
    assert table_rows == want

    page = tmp_path / "r.html"
    _run("report", str(TRACE), "--html", str(page))
    html = page.read_text()
    for row in want:
        assert "<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" in html

    _run("bundle", str(TRACE), "-o", str(tmp_path / "b.zip"))
    with zipfile.ZipFile(tmp_path / "b.zip") as z:
        md = z.read("hstrace-bundle/REPORT.md").decode()
    for row in want:
        assert "| " + " | ".join(row) + " |" in md
    assert "rate_of_offered" in md and "rate_of_reached" in md


def test_replay_findings_fit_80_columns_with_evidence_under_each_finding():
    res = _run("replay", str(TRACE), "--against", str(TRAINING))
    assert res.return_value == 1
    lines = res.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    head = next(i for i, line in enumerate(lines) if line.startswith("1. aux-layer-shift"))
    assert "(target-capture, fault)" in lines[head]
    block = []
    for line in lines[head + 1 :]:
        if not line.startswith("   "):
            break
        block.append(line)
    summary = [ln for ln in block if re.match(r"^ {3}\S", ln)]  # 3 spaces in: the summary
    assert "every slot is" in " ".join(" ".join(summary).split())
    # 5 spaces in, under the summary: one `key: value` line per evidence item
    evidence = dict(m.groups() for ln in block if (m := re.match(r"^ {5}(\w+): (.*?)\s*$", ln)))
    assert evidence["serving_layers"] == "[3, 5, 6]"
    assert evidence["training_layers"] == "[2, 4, 5]"
    assert evidence["shift"] == "1"
    # arrays are cut on one line, never wrapped one token per line
    assert evidence["slot_cos"].startswith("[[") and evidence["slot_cos"].endswith("...")
