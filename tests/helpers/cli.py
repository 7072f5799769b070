"""Running the `hstrace` command from tests.

* `invoke`: the click command in-process (CliRunner), for what a command prints and returns.
* `run_main`: in-process through `hstrace.cli.main.main`, the entry point's own error handling
  (exit code 0/1/2, the one `hstrace: error:` line): the contract, without a new interpreter
  (each subprocess imports torch again, 2-4 s).
* `run_cli`: `python -m hstrace` in a subprocess; kept for a few tests per command, so the
  contract is also checked through a real interpreter exit (nothing printed by Python itself).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
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


@dataclass
class Ran:
    """What `run_main` saw: the fields of a `subprocess.CompletedProcess` that tests read."""

    returncode: int
    stdout: str
    stderr: str


def run_main(*args: str, cwd: Path | None = None, columns: int = 80) -> Ran:
    """`hstrace ARGS` in-process through `main()`, stdout and stderr apart, at a terminal
    `columns` wide, from `cwd` (restored afterwards). HSTRACE_DEBUG is unset, as for a user."""
    from click.testing import CliRunner
    from hstrace.cli.main import main

    runner = CliRunner()
    old = Path.cwd()
    code: Any = 0
    with runner.isolation(env={"COLUMNS": str(columns), "HSTRACE_DEBUG": None}) as (out, err, _):
        try:
            if cwd is not None:
                os.chdir(cwd)
            main(list(args))
        except SystemExit as exc:
            code = exc.code
        finally:
            os.chdir(old)
            sys.stdout.flush()
            sys.stderr.flush()
        stdout, stderr = out.getvalue(), err.getvalue()
    if code is None:
        code = 0
    if not isinstance(code, int):  # sys.exit("message"): Python prints it and exits 1
        stderr, code = stderr + f"{code}\n", 1
    return Ran(code, stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace"))


def assert_one_line_error(run: subprocess.CompletedProcess | Ran, needle: str) -> None:
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
