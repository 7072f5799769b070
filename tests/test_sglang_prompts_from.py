"""`hstrace record --prompts-from TRAINING_DIR --samples N`: the prompts sent hold exactly the
training samples' token ids (real readers, the tiny world's real dumps)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hstrace.prompts import load_prompts_from_training
from hstrace.training import open_training

TINY = Path(__file__).resolve().parents[1] / "traces" / "tiny-world"
DIRS = ["training-speculators", "training-speculators-legacy", "training-specforge"]


@pytest.mark.parametrize("name", DIRS)
def test_prompts_are_the_samples_token_ids(name: str) -> None:
    directory = TINY / name
    if not directory.is_dir():
        pytest.skip("the tiny world is not built (python traces/tiny-world/build.py)")
    prompts = load_prompts_from_training(directory, 3)
    data = open_training(directory)
    assert len(prompts) == 3
    for i, prompt in enumerate(prompts):
        assert list(prompt.input_ids) == data[i].input_ids.tolist()
        assert prompt.source_id == f"{name}:{i}"
    assert len(load_prompts_from_training(directory, 10_000)) == len(data)


def test_prompts_from_a_non_training_dir_is_a_clear_error(tmp_path: Path) -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hstrace",
            "record",
            "--engine",
            "reference",
            "--target",
            str(tmp_path),
            "--drafter",
            str(tmp_path),
            "--prompts-from",
            str(tmp_path),
            "--out",
            str(tmp_path / "t.zarr"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr
    assert "hstrace: error:" in res.stderr and str(tmp_path) in res.stderr
    assert "Traceback" not in res.stderr
