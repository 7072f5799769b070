"""Running the `hstrace` command from tests: in-process through click's CliRunner (quick: no
new interpreter, no second torch import) or as a subprocess for the exit-code and
no-traceback contract (`python -m hstrace` goes through `main()`'s error handling)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "traces" / "examples"
TINY_WORLD = REPO / "traces" / "tiny-world"
TRAINING = TINY_WORLD / "training-speculators"


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m hstrace ARGS` in a subprocess, output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "hstrace", *args], capture_output=True, text=True, cwd=cwd
    )


def assert_one_line_error(run: subprocess.CompletedProcess, needle: str) -> None:
    """Bad input: exit 2, no traceback, exactly one `hstrace: error:` line that says `needle`."""
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("hstrace: error:")]
    assert len(lines) == 1 and needle in lines[0], run.stderr


def invoke(*args: str, columns: int = 80) -> Any:
    """`hstrace ARGS` in-process at a terminal `columns` wide; the command's return value (its
    exit code) is `result.return_value`. Raises if the command raised."""
    from click.testing import CliRunner

    from cli.main import cli

    res = CliRunner().invoke(cli, list(args), env={"COLUMNS": str(columns)}, standalone_mode=False)
    assert res.exception is None, res.output
    return res
