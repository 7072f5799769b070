"""Replay reads only the target / draft rows it uses (issue 14 item 4), with the same findings.

`hstrace.trace.rows.gather` plans reads in stored chunks; the examples' columns fit in one
chunk, so the tests that count rows set the read unit to one row (exact windows) and compare
with a forced whole-column read: the rows requested through `TableView.column` are counted.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.cli import EXAMPLES, TRAINING, invoke
from helpers.wide_trace import write_wide_trace

from hstrace.replay.read import read_serving
from hstrace.trace import open_trace
from hstrace.trace import rows as rows_mod
from hstrace.trace.reader import TableView


def test_windows_cover_only_chunks_with_wanted_rows():
    rows = np.array([0, 1, 5, 40, 41, 95, 96])
    # unit 8: chunks 0, 5, 11, 12 -> [0, 8), [40, 48), [88, 100) (clipped to n = 100)
    assert rows_mod.windows(rows, 8, 100) == [(0, 8), (40, 48), (88, 100)]
    # a window holds at most max_chunks neighbouring chunks
    assert rows_mod.windows(np.arange(0, 40), 8, 100, max_chunks=2) == [(0, 16), (16, 32), (32, 40)]
    assert rows_mod.windows(np.array([], dtype=np.int64), 8, 100) == []


@pytest.mark.parametrize("unit", [1, 3, 64, 10**9])
def test_gather_equals_indexing_the_whole_column(monkeypatch, unit):
    monkeypatch.setattr(rows_mod, "read_unit", lambda *_: unit)
    with open_trace(EXAMPLES / "clean.zarr") as tr:
        target = tr.rank(0).table("target")
        full = target.column("tok", "aux_hidden")
        n = target.num_rows("tok")
        idx = np.array([n - 1, 0, 5, 5, 2, n // 2], dtype=np.int64)  # any order, repeats
        got = rows_mod.gather(target, "tok", "aux_hidden", idx)
        assert got.dtype == torch.bfloat16 and torch.equal(got, full[torch.from_numpy(idx)])
        ids = rows_mod.gather(target, "tok", "input_ids", idx)
        assert np.array_equal(ids, np.asarray(target.column("tok", "input_ids"))[idx])
        empty = rows_mod.gather(target, "tok", "aux_hidden", np.zeros(0, np.int64))
        assert tuple(empty.shape) == (0, full.shape[1])


def _replay(path: Path, monkeypatch, mode: str) -> tuple[dict, dict]:
    """Replay JSON, and the rows requested per (table, column) through TableView.column."""
    asked: dict[tuple[str, str], int] = {}
    column = TableView.column

    def counting(self, axis, name, start=None, stop=None):
        out = column(self, axis, name, start, stop)
        asked[(self.name, name)] = asked.get((self.name, name), 0) + len(out)
        return out

    with monkeypatch.context() as m:
        m.setattr(TableView, "column", counting)
        if mode == "exact":
            m.setattr(rows_mod, "read_unit", lambda *_: 1)
        else:  # "full": one window over the whole column, i.e. what replay read before
            m.setattr(rows_mod, "windows", lambda rows, unit, n, *a: [(0, n)] if len(rows) else [])
        res = invoke("replay", str(path), "--against", str(TRAINING), "--json")
    assert res.exit_code in (0, 1), res.output
    return json.loads(res.output), asked


@pytest.mark.parametrize("name", ["clean", "aux-layer-shift"])
def test_replay_reads_fewer_aux_rows_with_the_same_findings(monkeypatch, name):
    path = EXAMPLES / f"{name}.zarr"
    exact, asked = _replay(path, monkeypatch, "exact")
    full, asked_full = _replay(path, monkeypatch, "full")
    assert exact == full  # every finding, metric and piece of evidence
    if name == "clean":
        assert exact["verdict"]["code"] == "no-wiring-fault"
    with open_trace(path) as tr:
        view = tr.rank(0)
        n_target = view.table("target").num_rows("tok")
        n_ext = view.table("draft_extend").num_rows("tok")
        serving = read_serving(tr)
    committed = sum(r.aux_rows for r in serving.requests)
    drafted = sum(len(r.draft.rows) for r in serving.requests if r.draft is not None)
    # The whole-column read asked for every target row, the windowed one for the committed
    # rows only (the rejected drafts of each verify round are left on disk); every draft row
    # a request keeps, and no other, of `draft_extend.hidden_in`.
    assert asked_full[("target", "aux_hidden")] == n_target
    assert asked[("target", "aux_hidden")] == committed < n_target
    assert asked[("draft_extend", "hidden_in")] == drafted <= n_ext


def test_wide_rows_skip_the_chunks_of_rejected_drafts(tmp_path, monkeypatch):
    """Kimi-wide aux rows (64-row chunks): a 128-row verify block that keeps 1 + 3 rows leaves
    its second chunk unread; what is read equals a whole-column read."""
    path = tmp_path / "wide.zarr"
    # prefill 64 rows (chunk 0), then verify blocks at rows 64, 192, 320 (chunks 1-2, 3-4, 5-6)
    write_wide_trace(path, steps=3, batch=1, draft_tokens=128, accept=3, hidden=7168)
    asked: list[tuple[int, int]] = []
    column = TableView.column

    def counting(self, axis, name, start=None, stop=None):
        if (self.name, name) == ("target", "aux_hidden") and start != stop:
            asked.append((start, stop))  # (an empty call, the column's shape, reads nothing)
        return column(self, axis, name, start, stop)

    monkeypatch.setattr(TableView, "column", counting)
    with open_trace(path) as tr:
        target = tr.rank(0).table("target")
        assert target.read_unit("tok", "aux_hidden") == 64 and target.num_rows("tok") == 448
        windowed = read_serving(tr)
        with monkeypatch.context() as m:
            m.setattr(rows_mod, "windows", lambda rows, unit, n, *a: [(0, n)])
            full = read_serving(tr)
    # chunk 0 and 1 are neighbours (one window); chunks 3 and 5 each hold one block's 4 kept rows
    assert asked[:3] == [(0, 128), (192, 256), (320, 384)] and asked[3:] == [(0, 448)]
    (w,), (f,) = windowed.requests, full.requests
    # positions 0..74: each verify block starts at the last committed position, keeps 1 + 3
    assert w.aux_rows == 75 and np.array_equal(w.aux_steps, f.aux_steps)
    assert torch.equal(w.aux, f.aux)
    assert torch.equal(w.draft.hidden_in, f.draft.hidden_in)
    assert np.array_equal(w.tokens, f.tokens)
