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


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{temperature: 0.8}", "--sampling: not JSON"),
        ("[0.8]", "--sampling: give a JSON object"),
        ('{"temprature": 0.8}', "--sampling: unknown parameter(s) temprature"),
        ('{"top_p": "0.9"}', "--sampling: top_p must be a number"),
        ('{"min_tokens": 2.5}', "--sampling: min_tokens must be an integer"),
        ('{"stop_token_ids": [1, -2]}', "--sampling: stop_token_ids must be a list of non-neg"),
    ],
)
def test_record_sampling_is_checked_before_any_server_starts(tmp_path, value, message):
    out = run_main(
        "record",
        "--server-cmd",
        "python -m vllm.entrypoints.openai.api_server --model x",
        "--prompts-from",
        str(tmp_path),
        "--out",
        str(tmp_path / "t.zarr"),
        "--sampling",
        value,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hstrace: error: {message}"), out.stderr
