"""`hstrace check` from tests: in-process through `main()` (exit code, the --json document or
the text, stderr), and the edits tests make to a saved checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hstrace.cli.main import main
from safetensors.torch import load_file, save_file


def run_check(capsys: Any, *args: str) -> tuple[int, dict | str, str]:
    with pytest.raises(SystemExit) as exc:
        main(["check", *args])
    out, err = capsys.readouterr()
    doc = json.loads(out) if "--json" in args and exc.value.code != 2 else out
    return exc.value.code, doc, err


def codes(doc: dict) -> list[str]:
    return [f["code"] for f in doc["findings"]]


def edit_config(ck: Path, fn) -> None:
    p = ck / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.write_text(json.dumps(cfg))


def edit_weights(ck: Path, fn) -> None:
    f = ck / "model.safetensors"
    save_file(fn(load_file(str(f))), str(f), metadata={"format": "pt"})


def specforge_data(root, width: int) -> None:
    """Two SpecForge-layout training samples (`rows_0-2000/data_i.ckpt`) of random tensors with
    `width`-wide hidden states: the shape of training data, for checks about shapes only."""
    rows = root / "rows_0-2000"
    rows.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        T = 10
        torch.save(
            {
                "input_ids": torch.randint(0, 97, (T,), generator=g),
                "loss_mask": torch.ones(T, dtype=torch.long),
                "aux_hidden_state": torch.randn(1, T, 3 * width, generator=g),
                "hidden_state": torch.randn(1, T, width, generator=g),
            },
            rows / f"data_{i}.ckpt",
        )
