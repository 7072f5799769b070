"""Tail flushes (hstrace/trace/write/rowlog.py): an unsharded column's key is rewritten by
swapping it with a spare file in place (TailFile), never by creating a file per flush, and
holds a complete chunk at every flush; without the swap every flush renames, as before. A
column is created with its first capacity, so its first tail flush rewrites no metadata."""

from __future__ import annotations

import ctypes
import errno
import json
import os

import numpy as np
import pytest
import torch

from hstrace.trace import TraceWriter, create_trace, open_trace
from hstrace.trace.write import rowlog

WIDTH = 2048  # float32: 8 KiB rows, under SHARD_MIN_ROW_BYTES: unsharded, 512-row chunks
ROWS = 128  # a step's rows: a chunk fills at the fourth step


def _key_dir(path) -> str:
    return os.path.join(path, "rank0", "target", "tok.x", "c")


def _files(path) -> dict[str, int]:
    """Every file under the column's chunk directory: relative name -> inode."""
    d = _key_dir(path)
    return {
        os.path.relpath(os.path.join(a, f), d): os.stat(os.path.join(a, f)).st_ino
        for a, _, fs in os.walk(d)
        for f in fs
    }


def _step(w: TraceWriter, s: int) -> torch.Tensor:
    x = torch.arange(s * ROWS * WIDTH, (s + 1) * ROWS * WIDTH, dtype=torch.float32)
    x = x.reshape(ROWS, WIDTH)
    w.write("target", step={"mode": 0}, tok={"x": x})
    return x


def _read(path) -> np.ndarray:
    with open_trace(path) as tr:
        return np.asarray(tr.rank(0).table("target").column("tok", "x"))


def _record(path, steps: int, after_flush=None) -> list[torch.Tensor]:
    create_trace(path, engine={"name": "test"})
    w = TraceWriter(path, process=False, tail_flush_s=60)
    rows = []
    for s in range(steps):
        rows.append(_step(w, s))
        w.flush()
        if after_flush is not None:
            after_flush(s, rows)
    w.close()
    return rows


def test_tail_flushes_swap_two_files_and_the_key_holds_every_row(tmp_path):
    path = tmp_path / "t.zarr"
    seen: list[dict[str, int]] = []

    def check(s: int, rows: list[torch.Tensor]) -> None:
        seen.append(_files(path))
        # the key holds every row flushed so far, read as a reader reads a live trace
        got = _read(path)
        assert np.array_equal(got, torch.cat(rows).numpy()), s

    if rowlog.TailFile.exchange is None:
        pytest.skip("no renameat2 on this host: the fallback is tested below")
    rows = _record(path, 3, check)
    # first flush: the key only; second: the key and its spare (the first version)
    assert set(seen[0]) == {"0/0"}
    assert set(seen[1]) == set(seen[2]) == {"0/0", "0/0.tail.partial"}
    # third flush: written over the spare and swapped: the same two inodes, names exchanged
    assert set(seen[2].values()) == set(seen[1].values())
    assert seen[2]["0/0"] == seen[1]["0/0.tail.partial"]
    assert seen[2]["0/0.tail.partial"] == seen[1]["0/0"]
    # closed: the spare is gone, every row reads back
    assert set(_files(path)) == {"0/0"}
    assert np.array_equal(_read(path), torch.cat(rows).numpy())
    with open_trace(path) as tr:
        assert tr.rank(0).clean_close


def test_a_chunk_written_whole_drops_its_spare(tmp_path):
    """The fourth step fills unit 0: it is written whole (a rename, as every whole unit), its
    spare removed; the fifth step's tail starts unit 1 as a first flush."""
    path = tmp_path / "t.zarr"
    seen: list[set[str]] = []
    rows = _record(path, 5, lambda s, rows: seen.append(set(_files(path))))
    if rowlog.TailFile.exchange is not None:
        assert seen[2] == {"0/0", "0/0.tail.partial"}
    assert seen[3] == {"0/0"}
    assert seen[4] == {"0/0", "1/0"}
    assert set(_files(path)) == {"0/0", "1/0"}
    assert np.array_equal(_read(path), torch.cat(rows).numpy())


def test_without_the_swap_every_flush_renames(tmp_path, monkeypatch):
    monkeypatch.setattr(rowlog.TailFile, "exchange", None)
    path = tmp_path / "t.zarr"
    seen: list[set[str]] = []
    rows = _record(path, 3, lambda s, rows: seen.append(set(_files(path))))
    assert seen == [{"0/0"}] * 3  # no spare kept
    assert np.array_equal(_read(path), torch.cat(rows).numpy())


def _refusing(code: int):
    calls = []

    def swap(*args):
        calls.append(args)
        ctypes.set_errno(code)
        return -1

    return swap, calls


def test_a_file_system_that_refuses_the_swap_falls_back_to_renames(tmp_path, monkeypatch):
    swap, calls = _refusing(errno.EINVAL)
    monkeypatch.setattr(rowlog.TailFile, "exchange", swap)
    # the refusal must reach ctypes.get_errno as the real call's would
    monkeypatch.setattr(ctypes, "get_errno", lambda: errno.EINVAL)
    t = rowlog.TailFile(str(tmp_path / "key"))
    for i in range(4):
        t.write([f"version {i}".encode()])
        assert (tmp_path / "key").read_bytes() == f"version {i}".encode()
        assert not (tmp_path / "key.tail.partial").exists()
    assert len(calls) == 1  # asked once (the second write), then renames for good
    assert rowlog.TailFile.exchange is None


def test_a_failed_swap_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    swap, _ = _refusing(errno.EIO)
    monkeypatch.setattr(rowlog.TailFile, "exchange", swap)
    monkeypatch.setattr(ctypes, "get_errno", lambda: errno.EIO)
    t = rowlog.TailFile(str(tmp_path / "key"))
    t.write([b"first"])
    with pytest.raises(OSError, match="Input/output error"):
        t.write([b"second"])
    assert (tmp_path / "key").read_bytes() == b"first"  # the key is untouched


@pytest.mark.skipif(rowlog.TailFile.exchange is None, reason="no renameat2 on this host")
def test_a_shorter_version_over_a_longer_spare_is_cut_to_size(tmp_path):
    t = rowlog.TailFile(str(tmp_path / "key"))
    for data in (b"a" * 100, b"b" * 300, b"c" * 10, b"d" * 5):
        t.write([data[:2], data[2:]])
        assert (tmp_path / "key").read_bytes() == data
    t.drop()
    assert os.listdir(tmp_path) == ["key"]


def test_a_first_tail_flush_rewrites_no_array_metadata(tmp_path):
    """The column's zarr.json is written once, at creation, with its first capacity: the
    first tail flush leaves it byte for byte (it used to resize every column through zarr);
    the close trims the shape to the rows written."""
    path = tmp_path / "t.zarr"
    create_trace(path, engine={"name": "test"})
    w = TraceWriter(path, process=False, tail_flush_s=60)
    x = _step(w, 0)
    meta = path / "rank0" / "target" / "tok.x" / "zarr.json"
    before = meta.read_bytes()
    assert json.loads(before)["shape"] == [rowlog.GROW_UNITS * 512, WIDTH]
    w.flush()
    assert meta.read_bytes() == before
    assert np.array_equal(_read(path), x.numpy())  # the commit record's rows, not the shape
    w.close()
    assert json.loads(meta.read_bytes())["shape"] == [ROWS, WIDTH]
    assert np.array_equal(_read(path), x.numpy())
