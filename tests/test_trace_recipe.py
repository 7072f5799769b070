"""The notebook recipe at the top of docs/trace-format.md, run as written on the bundled
example trace and checked value for value against hstrace's own reader: the plain-zarr block
(one table with its offsets, bf16 reinterpreted) and the xarray block (one Dataset per table)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from hstrace.trace import open_trace

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = "traces/example.zarr"


def _blocks() -> list[str]:
    doc = (REPO / "docs" / "trace-format.md").read_text()
    section = doc.split("## Notebook recipe\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2, "the recipe is a plain-zarr block, then an xarray block"
    return blocks


def _run(blocks: list[str], monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.chdir(REPO)  # the recipe opens traces/example.zarr as a notebook would
    scope: dict = {"__name__": "recipe"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/trace-format.md (recipe block {i + 1})", "exec"), scope)
    return scope


def _as_numpy(x) -> np.ndarray:
    """The reader's column as the recipe holds it: bf16 widened to float32 (exact)."""
    if isinstance(x, torch.Tensor):
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()
    return np.asarray(x)


def test_the_zarr_block_reads_a_table_with_its_offsets(monkeypatch):
    scope = _run(_blocks()[:1], monkeypatch)
    with open_trace(REPO / EXAMPLE) as tr:
        target = tr.rank(0).table("target")
        want = _as_numpy(target.column("tok", "aux_hidden"))
        step5 = _as_numpy(target.step(5)["tok"]["aux_hidden"])
        assert scope["S"] == target.num_steps
        assert np.array_equal(scope["off"][:, scope["axes"].index("tok")], target.offsets("tok"))
    assert scope["bits"].dtype == np.uint16 and scope["aux"].dtype == np.float32
    # bit for bit: float32 widening of bf16 is exact
    assert scope["aux"].shape == want.shape and len(want) > 0
    assert np.array_equal(scope["aux"].view(np.uint32), want.view(np.uint32))
    assert len(step5) > 0 and np.array_equal(scope["step5"].view(np.uint32), step5.view(np.uint32))


def test_the_xarray_block_builds_one_dataset_per_table(monkeypatch):
    pytest.importorskip("xarray", reason="xarray is not installed (the `test` extra has it)")
    scope = _run(_blocks(), monkeypatch)
    tables = scope["tables"]
    with open_trace(REPO / EXAMPLE) as tr:
        rank = tr.rank(0)
        assert sorted(tables) == sorted(rank.tables)
        for name in rank.tables:
            t, ds = rank.table(name), tables[name]
            assert ds.attrs == {"table": name, "steps": t.num_steps}, name
            assert ds.sizes["step"] == t.num_steps, name
            want_vars = {f"{a}.{c}" for a, cols in t.columns.items() for c in cols}
            assert set(ds.data_vars) == want_vars, name
            for axis, cols in t.columns.items():
                if axis != "step":
                    assert ds.sizes[axis] == t.num_rows(axis), (name, axis)
                    start = ds[f"{axis}_start"].values
                    assert np.array_equal(start, t.offsets(axis)[:-1]), (name, axis)
                for col in cols:
                    got = ds[f"{axis}.{col}"].values
                    want = _as_numpy(t.column(axis, col))
                    assert got.dtype == want.dtype and got.shape == want.shape, (name, axis, col)
                    assert np.array_equal(got, want, equal_nan=got.dtype.kind == "f"), (
                        name,
                        axis,
                        col,
                    )
    # the recipe's last line: mean accept length by draft length, from the verify table
    verify = tables["verify"]
    assert verify.sizes["req"] > 0 and float(verify["req.accept_len"].mean()) >= 0
