"""The command line's contract: every command is listed, and bad input never shows a traceback."""

import pytest
from helpers.cli import run_cli, run_main
from hstrace.cli.main import COMMANDS


def test_help_lists_every_command():
    out = run_main("--help")
    assert out.returncode == 0
    for name in COMMANDS:
        assert name in out.stdout


def test_unknown_option_is_a_usage_error():
    out = run_main("show", "--no-such-flag")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "--no-such-flag" in out.stderr


def test_an_unexpected_error_is_one_line_not_a_traceback(tmp_path):
    """The last line of defence in the entry point: whatever escapes a command (here a file that
    is not a trace at all, handed to the reader as a zip) ends as one line and exit 2, through a
    real interpreter exit (a subprocess: nothing printed by Python after main())."""
    bogus = tmp_path / "bogus.zip"
    bogus.write_bytes(b"PK\x03\x04" + b"\x00" * 64)
    out = run_cli("show", str(bogus))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hstrace: error: "), out.stderr


def test_the_entry_point_turns_any_exception_into_one_line(monkeypatch, capsys):
    from hstrace.cli import main as entry

    def boom(*_a, **_k):
        raise RuntimeError("first line\nsecond line")

    monkeypatch.delenv("HSTRACE_DEBUG", raising=False)
    monkeypatch.setattr(entry.cli, "main", boom)
    with pytest.raises(SystemExit) as exit_info:
        entry.main(["show", "x"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unexpected RuntimeError: first line" in err[0]
