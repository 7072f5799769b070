"""End to end on the tiny world: the reference engine records a clean and a miswired run, then
`bundle --against` embeds the real replay verdict, `diff` names the first differing stream,
and `report --against` draws the real fingerprint matrix. Slow: it may build the tiny world."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers.cli import run_main

from hstrace.bundle import bundle_info
from hstrace.engines.base import EngineConfig, RecordOptions
from hstrace.engines.reference.engine import ReferenceEngine

pytestmark = pytest.mark.slow

REPO_WORLD = Path(__file__).resolve().parents[1] / "traces" / "tiny-world"
PARTS = ("target", "training-speculators", "drafter-speculators")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    if all((REPO_WORLD / p).is_dir() and any((REPO_WORLD / p).iterdir()) for p in PARTS):
        return REPO_WORLD
    out = tmp_path_factory.mktemp("tiny-world")
    proc = subprocess.run(
        [sys.executable, str(REPO_WORLD / "build.py"), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def _record(world: Path, out: Path, **knobs) -> Path:
    from hstrace.prompts import load_prompts_from_training as load  # the CLI's prompts

    engine = ReferenceEngine(
        EngineConfig(target=world / "target", drafter=world / "drafter-speculators", extra=knobs)
    )
    engine.check_supported()
    engine.record(
        load(world / "training-speculators", 3),
        out,
        RecordOptions(max_new_tokens=12, show_progress=False),
    )
    return out


@pytest.fixture(scope="module")
def runs(world, tmp_path_factory):
    d = tmp_path_factory.mktemp("runs")
    return _record(world, d / "clean.zarr"), _record(world, d / "swapped.zarr", aux_order=[1, 0, 2])


def test_bundle_embeds_the_real_verdict_and_reproduces(world, runs, tmp_path):
    clean, swapped = runs
    args = [
        "--against",
        str(world / "training-speculators"),
        "--drafter",
        str(world / "drafter-speculators"),
    ]
    out = run_main("bundle", str(swapped), "-o", str(tmp_path / "bug.zip"), *args)
    # the README's contract: the command exits with the verdict's code and prints the verdict
    assert out.returncode == 1, out.stderr
    assert "verdict: aux-order (target-capture)" in out.stdout
    info = bundle_info(tmp_path / "bug.zip")
    verdict = info["manifest"]["replay"]["verdict"]["code"]
    assert verdict == "aux-order" and f"`{verdict}`" in info["report"]
    # the one-line command in the bundle gives the same verdict from the zip itself (a real
    # interpreter from the bundle's directory, as a user would run it)
    line = info["reproduce"].split()
    assert line[:3] == ["hstrace", "replay", "bug.zip"]
    again = subprocess.run(
        [sys.executable, "-m", "hstrace", *line[1:], "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert again.returncode == 1 and json.loads(again.stdout)["verdict"]["code"] == verdict
    # `report` on the bundle shows the verdict it carries, and says where it came from
    page = run_main("report", str(tmp_path / "bug.zip"), "--html", str(tmp_path / "bug.html"))
    assert page.returncode == 1 and "aux-order" in (tmp_path / "bug.html").read_text()
    assert "bundle&#x27;s manifest" in (tmp_path / "bug.html").read_text()
    # hidden states redacted: the verdict comes from the same steps before redaction, and says so
    red = run_main(
        "bundle", str(swapped), "-o", str(tmp_path / "red.zip"), "--redact", "hidden", *args
    )
    assert red.returncode == 1, red.stderr
    info = bundle_info(tmp_path / "red.zip")
    assert (
        info["manifest"]["replay"]["verdict"]["code"] == verdict
        and "before redaction" in info["report"]
    )
    # hashed ids cannot be replayed (and the evidence could quote clear ids): refused up front
    ids = run_main(
        "bundle", str(swapped), "-o", str(tmp_path / "ids.zip"), "--redact", "ids", *args
    )
    assert ids.returncode == 2 and "--redact ids cannot be combined with --against" in ids.stderr
    ok = run_main("bundle", str(clean), "-o", str(tmp_path / "ok.zip"), *args)
    assert (
        ok.returncode == 0
        and bundle_info(tmp_path / "ok.zip")["manifest"]["replay"]["verdict"]["code"]
        == "no-wiring-fault"
    )


def test_diff_names_target_aux_hidden_first(runs):
    clean, swapped = runs
    out = run_main("diff", str(clean), str(swapped), "--json")
    assert out.returncode == 1, out.stderr
    doc = json.loads(out.stdout)
    assert doc["requests"]["matched"] == 3
    first = doc["first_difference"]
    assert first["stream"] == "target/tok/aux_hidden" and first["round"] == 0
    assert first["evidence"]["rel_err"] > doc["tolerance"]["rel_l2"]


def test_report_draws_the_real_fingerprints(world, runs, tmp_path):
    _, swapped = runs
    out = run_main(
        "report",
        str(swapped),
        "--against",
        str(world / "training-speculators"),
        "--drafter",
        str(world / "drafter-speculators"),
        "--html",
        str(tmp_path / "r.html"),
    )
    assert out.returncode == 1, out.stderr  # a fault was found
    page = (tmp_path / "r.html").read_text()
    assert "aux-order" in page and "<script" not in page
    slots = re.search(r'<svg[^>]*class="heatmap slots".*?</svg>', page, re.S).group(0)
    assert slots.count('class="cell"') == 9
    # the cells that decided it are outlined: each serving slot on the training slot it holds
    order = json.loads(
        run_main(
            "replay",
            str(swapped),
            "--against",
            str(world / "training-speculators"),
            "--drafter",
            str(world / "drafter-speculators"),
            "--json",
        ).stdout
    )["findings"][0]["evidence"]["serving_slot_is_training_slot"]
    held = re.findall(r'class="mark mark-match" data-row="(\d+)" data-col="(\d+)"', slots)
    assert sorted((int(i), int(j)) for i, j in held) == list(enumerate(order))
    assert order != [0, 1, 2]
    with zipfile.ZipFile(tmp_path / "x.zip", "w") as zf:  # an unrelated zip is a clean error
        zf.writestr("a.txt", "x")
    bad = run_main("report", str(tmp_path / "x.zip"), "--html", str(tmp_path / "b.html"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
