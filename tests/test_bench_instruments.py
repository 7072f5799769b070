"""The bench's scratch instrument stays usable: `bench/step_segments.patch` (applied to a copy
of the tree to time vLLM's step in segments, bench/step_segments.py) must apply to this tree.
A patch whose context no longer matches fails at `git apply` with a rejected hunk, which is
how the nineteenth pass's review left it (a removed function named in a hunk's header line)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PATCH = REPO / "bench" / "step_segments.patch"


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_step_segments_patch_applies_to_this_tree() -> None:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    got = subprocess.run(
        ["git", "apply", "--check", str(PATCH)], cwd=REPO, capture_output=True, text=True
    )
    assert got.returncode == 0, got.stderr
    # it patches the files step_segments.py reads the logs of, and nothing else
    touched = {
        line.split(" b/", 1)[1].strip()
        for line in PATCH.read_text().splitlines()
        if line.startswith("diff --git ")
    }
    assert touched == {
        "hooks/common.py",
        "hooks/vllm_patches.py",
        "hstrace/trace/write/rowlog.py",
        "hstrace/trace/write/writer_process.py",
    }
