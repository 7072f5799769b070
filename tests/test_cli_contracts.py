"""Issue 24, item 3: the user-facing contracts the README states, each checked as a user meets
it: `bundle --against` exits with the verdict's code and prints it; Markdown table cells are
escaped; click usage errors are one line; every command has `--json`; `show` on a directory that
is not a trace says so in one line."""

from __future__ import annotations

import json
import re

import pytest
from helpers.cli import EXAMPLES, REPO, TRAINING, run_main
from hstrace.cli.main import COMMANDS

from hstrace.bundle import bundle_info

SHIFT = EXAMPLES / "aux-layer-shift.zarr"
CLEAN = EXAMPLES / "clean.zarr"


def _cells(line: str) -> list[str]:
    """A Markdown table row split as GitHub splits it: at every `|` not escaped by `\\`."""
    inner = line.strip()[1:-1]
    return [c.strip() for c in re.split(r"(?<!\\)\|", inner)]


# -- bundle --against: the verdict's exit code, and the verdict printed --------------------------
def test_bundle_against_exits_with_the_verdict_and_prints_it(tmp_path):
    run = run_main(
        "bundle", str(SHIFT), "-o", str(tmp_path / "bug.zip"), "--against", str(TRAINING),
        cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    verdict = [ln for ln in run.stdout.splitlines() if ln.startswith("verdict: ")]
    assert verdict and verdict[0].startswith("verdict: aux-layer-shift (target-capture): "), (
        run.stdout
    )
    report = bundle_info(tmp_path / "bug.zip")["report"]
    # REPORT.md's metrics table: every row has exactly two cells on GitHub, the value kept
    rows = [ln for ln in report.splitlines() if "logprob diff" in ln]
    assert rows and rows[0].startswith("| engine vs reference, max \\|logprob diff\\|"), rows
    label, value = _cells(rows[0])
    assert label == "engine vs reference, max \\|logprob diff\\| (fp32 judge)"
    assert re.fullmatch(r"\d+\.\d{4}", value), rows[0]
    table = report[report.index("## Metrics") :].split("\n\n")[1].splitlines()
    assert all(len(_cells(ln)) == 2 for ln in table), table
    findings = report[report.index("## Findings") :].split("\n\n")[1].splitlines()
    assert all(len(_cells(ln)) == 5 for ln in findings), findings


def test_bundle_against_json_and_clean_exit_0(tmp_path):
    run = run_main(
        "bundle", str(CLEAN), "-o", str(tmp_path / "ok.zip"), "--against", str(TRAINING),
        "--json", cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["verdict"]["code"] == "no-wiring-fault" and doc["exit_code"] == 0
    assert doc["path"] == str(tmp_path / "ok.zip") and doc["bytes"] > 0
    assert doc["engine_steps"] == doc["total_engine_steps"] and doc["report"] == "replay"
    assert doc["complete"] is True and doc["failed"] == {}


def test_bundle_without_against_json(tmp_path):
    run = run_main("bundle", str(CLEAN), "-o", str(tmp_path / "b.zip"), "--steps", "0:5", "--json")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["verdict"] is None and doc["report"] == "summary" and doc["exit_code"] == 0
    assert doc["engine_steps"] == {"0": 5}
    assert (tmp_path / "b.zip").stat().st_size == doc["bytes"]


def test_acceptance_markdown_rows_are_escaped():
    from hstrace.report.markdown import row

    assert row("a|b", "c\nd") == "| a\\|b | c d |"
    assert _cells(row("max |x|", "1.0")) == ["max \\|x\\|", "1.0"]


# -- usage errors: one line, exit 2, for every command --------------------------------------------
USAGE = {
    "unknown option": (["--no-such-option"], "No such option '--no-such-option'"),
    "missing argument": ([], "Missing"),
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", list(USAGE))
def test_usage_errors_are_one_line(command, case):
    args, needle = USAGE[case]
    run = run_main(command, *args)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(f"hstrace: error: hstrace {command}: "), lines
    assert needle in lines[0] and f"(see 'hstrace {command} --help')" in lines[0]
    assert run.stdout == ""


@pytest.mark.parametrize(
    "args",
    [
        ["bundle", "x.zarr", "-o", "y.zip", "--redact", "everything"],
        ["record", "--engine", "tgi", "--out", "x.zarr"],
        ["check", "ck", "--dialect", "medusa"],
        ["check", "ck", "--samples", "0"],
        ["arm", "run-dir", "--out", "x.zarr", "--hold-mb", "0"],
        ["arm", "run-dir", "--out", "x.zarr", "--hold-mb", "64", "--drain-wait", "-1"],
        ["arm", "run-dir", "--out", "x.zarr", "--hold-mb", "64", "--drain-wait", "301"],
    ],
    ids=[
        "bundle --redact",
        "record --engine",
        "check --dialect",
        "check --samples",
        "arm --hold",
        "arm --drain-wait",
        "arm --drain-wait max",
    ],
)
def test_bad_choices_are_one_line(args):
    run = run_main(*args)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hstrace: error: hstrace {args[0]}: ")
    assert "Invalid value for" in lines[0]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--stream", "--drain-wait", "5"], "--drain-wait applies to a held session, not with"),
        (["--stream", "--hold-mb", "64"], "--stream and --hold-mb: a session streams or holds"),
    ],
    ids=["drain-wait", "hold-mb"],
)
def test_a_streamed_session_with_a_holds_option_is_one_line(args, says):
    run = run_main("arm", "run-dir", "--out", "x.zarr", *args)
    assert run.returncode == 2 and run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hstrace: error: hstrace arm: ")
    assert says in lines[0]


def test_unknown_command_is_one_line():
    run = run_main("replya")
    assert run.returncode == 2
    assert run.stderr.strip() == (
        "hstrace: error: hstrace: No such command 'replya' (see 'hstrace --help')"
    )


# -- --json everywhere ---------------------------------------------------------------------------
@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_has_json(command):
    run = run_main(command, "--help")
    assert run.returncode == 0 and "--json" in run.stdout, run.stdout


def test_report_json(tmp_path):
    page = tmp_path / "p.html"
    run = run_main("report", str(CLEAN), "--html", str(page), "--json")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["html"] == str(page) and doc["bytes"] == page.stat().st_size
    assert doc["verdict"] is None and doc["exit_code"] == 0


def test_record_json(tmp_path):
    world = REPO / "traces" / "tiny-world"
    out = tmp_path / "r.zarr"
    run = run_main(
        "record", "--engine", "reference", "--target", str(world / "target"),
        "--drafter", str(world / "drafter-speculators"), "--prompts-from", str(TRAINING),
        "--samples", "2", "--max-new-tokens", "3", "--out", str(out), "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["out"] == str(out) and doc["engine"] == "reference"
    assert doc["prompts_sent"] == 2 and doc["prompts_completed"] == 2
    assert doc["ok"] is True and doc["error"] is None and doc["exit_code"] == 0
    assert (out / "zarr.json").is_file()


# -- show on something that is not a trace ---------------------------------------------------------
@pytest.mark.parametrize("what", ["empty dir", "model dir", "dir of files"])
def test_show_on_a_directory_that_is_not_a_trace(tmp_path, what):
    if what == "model dir":
        path = REPO / "traces" / "tiny-world" / "target"
    else:
        path = tmp_path / "d"
        path.mkdir()
        if what == "dir of files":
            (path / "notes.txt").write_text("hello")
            (path / "c").mkdir()
    run = run_main("show", str(path))
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert lines == [
        f"hstrace: error: {path}: not a trace: a directory without zarr.json (a trace is the "
        "directory `hstrace record --out` made, or a bundle .zip)"
    ]
    for internal in ("GroupNotFoundError", "WrapperStore", "LocalStore", "zarr.core"):
        assert internal not in run.stderr
