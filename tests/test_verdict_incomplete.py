"""Issue 24, item 1: an internal failure is never a verdict.

A check (or a piece of evidence) that raises makes the judgement incomplete: exit 3 "could not
judge", never `no-wiring-fault`, with one line naming the check and the error in every output
(text, --json, --markdown, the HTML page). A fault found by the other checks still exits 1 and
says the judgement is incomplete. Evidence that is legitimately unavailable is not a failure.
"""

from __future__ import annotations

import json

import pytest
from helpers.cli import EXAMPLES, TRAINING, run_main

CLEAN = EXAMPLES / "clean.zarr"
SHIFT = EXAMPLES / "aux-layer-shift.zarr"


def _break_check(monkeypatch, module: str, name: str, message: str) -> None:
    """Replace one of `diagnose.CHECKS` by a function of the same name that raises."""
    import importlib

    import hstrace.diagnose as diagnose

    original = getattr(importlib.import_module(f"hstrace.diagnose.{module}"), name)

    def broken(ev):
        raise ValueError(message)

    broken.__name__ = original.__name__
    checks = tuple(broken if c is original else c for c in diagnose.CHECKS)
    assert broken in checks, f"{name} is not one of diagnose.CHECKS"
    monkeypatch.setattr(diagnose, "CHECKS", checks)


def test_a_check_that_raises_is_exit_3_in_text_json_and_markdown(monkeypatch, tmp_path):
    # Without the failure this trace replays clean (exit 0, no-wiring-fault): see below.
    _break_check(monkeypatch, "capture", "hidden_corrupt", "slot matrix is ragged\nsecond line")
    md = tmp_path / "report.md"
    text = run_main("replay", str(CLEAN), "--against", str(TRAINING), "--markdown", str(md))
    assert text.returncode == 3, text.stdout + text.stderr
    line = "judgement incomplete: check hidden_corrupt failed internally: ValueError: slot matrix is ragged"
    assert line in text.stdout, text.stdout
    assert "second line" not in text.stdout  # one line per failure
    assert "no-wiring-fault" not in text.stdout and "could-not-judge" in text.stdout
    report = md.read_text()
    assert "**Verdict: `could-not-judge`**" in report
    assert "**Judgement incomplete** (exit 3: could not judge)" in report
    assert f"- {line}" in report
    assert "no-wiring-fault" not in report

    run = run_main("replay", str(CLEAN), "--against", str(TRAINING), "--json")
    assert run.returncode == 3, run.stderr
    doc = json.loads(run.stdout)
    assert doc["complete"] is False and doc["exit_code"] == 3
    assert doc["failed"] == {"check hidden_corrupt": "ValueError: slot matrix is ragged"}
    assert doc["verdict"]["code"] == "could-not-judge"
    assert doc["verdict"]["severity"] == "incomplete"
    assert "check hidden_corrupt failed internally" in doc["verdict"]["summary"]
    assert "no-wiring-fault" not in [f["code"] for f in doc["findings"]]
    assert "check hidden_corrupt" not in doc["skipped"]  # a failure, not missing evidence
    # the other checks and the metrics still ran
    assert doc["metrics"]["engine_vs_reference"]["top1_agreement"] == 1.0


def test_the_same_trace_without_a_failure_is_clean():
    run = run_main("replay", str(CLEAN), "--against", str(TRAINING), "--json")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["verdict"]["code"] == "no-wiring-fault"
    assert doc["complete"] is True and doc["failed"] == {} and doc["exit_code"] == 0


def test_a_fault_found_by_other_checks_exits_1_and_says_incomplete(monkeypatch, tmp_path):
    _break_check(monkeypatch, "draft_input", "token_shift", "offsets disagree")
    md = tmp_path / "report.md"
    run = run_main("replay", str(SHIFT), "--against", str(TRAINING), "--markdown", str(md))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "aux-layer-shift" in run.stdout
    line = "judgement incomplete: check token_shift failed internally: ValueError: offsets disagree"
    assert line in run.stdout
    report = md.read_text()
    assert "**Verdict: `aux-layer-shift`**" in report
    assert "**Judgement incomplete** (exit 1: a fault was found, but not every check ran)" in report
    assert f"- {line}" in report


def test_evidence_that_fails_internally_is_a_failure_too(monkeypatch):
    """An exception while the evidence is built (here the slot fingerprints) is not "missing
    evidence": the capture checks that read it could not judge."""
    import hstrace.replay.slots as slots

    def broken(*a, **k):
        raise IndexError("fingerprint index 7 out of range")

    monkeypatch.setattr(slots, "_slot_pair", broken)
    run = run_main("replay", str(CLEAN), "--against", str(TRAINING), "--json")
    assert run.returncode == 3, run.stderr
    doc = json.loads(run.stdout)
    assert doc["failed"]["slot fingerprints"] == "IndexError: fingerprint index 7 out of range"
    assert doc["verdict"]["code"] == "could-not-judge"


def test_the_html_report_says_incomplete_and_exits_3(monkeypatch, tmp_path):
    _break_check(monkeypatch, "capture", "hidden_corrupt", "slot matrix is ragged")
    page = tmp_path / "r.html"
    run = run_main("report", str(CLEAN), "--against", str(TRAINING), "--html", str(page), "--json")
    assert run.returncode == 3, run.stderr
    html = page.read_text()
    assert "Judgement incomplete</b> (exit 3)" in html
    assert (
        "judgement incomplete: check hidden_corrupt failed internally: "
        "ValueError: slot matrix is ragged" in html
    )
    assert "no-wiring-fault" not in html
    doc = json.loads(run.stdout)
    assert doc["verdict"] == "could-not-judge" and doc["exit_code"] == 3


def test_debug_raises_the_failure_with_its_traceback(monkeypatch):
    from hstrace.pipelines import replay_trace

    _break_check(monkeypatch, "capture", "hidden_corrupt", "slot matrix is ragged")
    monkeypatch.setenv("HSTRACE_DEBUG", "1")
    with pytest.raises(ValueError, match="slot matrix is ragged"):
        replay_trace(CLEAN, TRAINING)


# -- pure: the result type ---------------------------------------------------------------------
def test_unavailable_evidence_is_not_a_failure():
    from hstrace.findings import Finding
    from hstrace.replay.result import ReplayResult
    from hstrace.replay.unavailable import Unavailable, split_failures

    u = Unavailable()
    u.note("drafter forward", "no target model (give --target DIR)")
    assert u.guarded("acc0_serving", lambda: 1 / 0) is None
    skipped, failed = split_failures(u.frozen())
    assert skipped == {"drafter forward": "no target model (give --target DIR)"}
    assert failed == {"acc0_serving": "ZeroDivisionError: division by zero"}

    clean = Finding("no-wiring-fault", "agree", severity="info")
    ok = ReplayResult([clean], skipped=skipped)
    assert ok.exit_code == 0 and ok.complete and ok.verdict.code == "no-wiring-fault"
    bad = ReplayResult([clean], skipped=skipped, failed=failed)
    assert bad.exit_code == 3 and not bad.complete
    assert bad.verdict.code == "could-not-judge"
    assert [f.code for f in bad.findings] == []  # a clean claim is dropped
    warn = Finding("metric-overstates", "w", severity="warning")
    assert ReplayResult([warn], failed=failed).exit_code == 3
    fault = Finding("aux-layer-shift", "f")
    both = ReplayResult([fault], failed=failed)
    assert both.exit_code == 1 and both.verdict.code == "aux-layer-shift"
    assert both.incomplete_lines == [
        "judgement incomplete: acc0_serving failed internally: ZeroDivisionError: division by zero"
    ]
    assert both.to_json()["complete"] is False
