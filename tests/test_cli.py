"""The command line's contract: every command is listed, and bad input never shows a traceback."""

import subprocess
import sys

from hstrace.cli.main import COMMANDS


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hstrace", *args], capture_output=True, text=True)


def test_help_lists_every_command():
    out = run("--help")
    assert out.returncode == 0
    for name in COMMANDS:
        assert name in out.stdout


def test_unknown_option_is_a_usage_error():
    out = run("show", "--no-such-flag")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
