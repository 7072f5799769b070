"""Whole chunks of unsharded columns (hstrace/trace/write/rowlog.py: _write_chunk_file): a frame
in page-aligned memory goes to its key with O_DIRECT where the file system takes it, padded to
whole blocks and then cut to the frame's length, atomically (temp file + rename); the key
holds the same bytes as through the page cache, and a failed write leaves the key as it was
and no temp file behind."""

from __future__ import annotations

import errno
import os
import struct

import numpy as np
import pytest
import torch
from numcodecs import Blosc

from hstrace.trace import TraceWriter, create_trace, open_trace
from hstrace.trace.codecs.blosc_into import aligned_buffer
from hstrace.trace.write import rowlog

WIDTH = 2048  # float32: 8 KiB rows, under SHARD_MIN_ROW_BYTES: unsharded, 512-row chunks
ROWS = 128  # a step's rows: the first chunk fills at the fourth step


def _direct_ok(d) -> bool:
    rowlog.ENCODER.read_flags()  # this environment's HSTRACE_DIRECT_IO, not a test's before
    fd, direct = rowlog._open_new_file(os.path.join(d, "probe.partial"))
    os.close(fd)
    os.unlink(os.path.join(d, "probe.partial"))
    return direct


def _frame_of(chunk: np.ndarray) -> rowlog.Aligned:
    out = aligned_buffer(chunk.nbytes + rowlog.MAX_FRAME_OVERHEAD)
    return rowlog._compress_into(chunk, out)


def _cbytes(frame: bytes) -> int:
    return struct.unpack_from("<I", frame, 12)[0]


def _record(path, steps: int) -> np.ndarray:
    create_trace(path, engine={"name": "test"})
    w = TraceWriter(path, process=False, tail_flush_s=60)
    rows = []
    for s in range(steps):
        x = torch.arange(s * ROWS * WIDTH, (s + 1) * ROWS * WIDTH, dtype=torch.float32)
        x = x.reshape(ROWS, WIDTH).sin()  # compresses, but not to nothing
        w.write("target", step={"mode": 0}, tok={"x": x})
        rows.append(x)
        w.flush()
    w.close()
    return torch.cat(rows).numpy()


def _key(path) -> str:
    return os.path.join(path, "rank0", "target", "tok.x", "c", "0", "0")


def test_a_whole_chunk_goes_to_its_key_with_o_direct_cut_to_its_frame(tmp_path, monkeypatch):
    if not _direct_ok(tmp_path):
        pytest.skip("this file system refuses O_DIRECT: the page-cache path is tested below")
    opened: list[tuple[str, bool]] = []
    real = rowlog._open_new_file

    def spy(p: str) -> tuple[int, bool]:
        fd, direct = real(p)
        opened.append((p, direct))
        return fd, direct

    monkeypatch.setattr(rowlog, "_open_new_file", spy)
    path = tmp_path / "t.zarr"
    rows = _record(path, 5)  # chunk 0 whole at the fourth step, a tail after it
    key = _key(path)
    assert [os.path.dirname(p) for p, direct in opened if direct] == [os.path.dirname(key)]
    assert os.path.basename(opened[0][0]).startswith("0.") and opened[0][0].endswith(".partial")
    with open(key, "rb") as f:
        frame = f.read()
    # cut to the frame: not padded to the 4096-byte blocks it was written in
    assert len(frame) == _cbytes(frame)
    assert len(frame) % 4096 != 0  # (this chunk's frame is not a whole number of blocks)
    first = np.frombuffer(Blosc().decode(frame), np.float32).reshape(-1, WIDTH)
    assert np.array_equal(first, rows[: len(first)])
    with open_trace(path) as tr:
        assert np.array_equal(np.asarray(tr.rank(0).table("target").column("tok", "x")), rows)
    assert not [f for f in os.listdir(os.path.dirname(key)) if f.endswith(".partial")]


def test_the_key_holds_the_same_bytes_through_the_page_cache(tmp_path, monkeypatch):
    direct = tmp_path / "direct.zarr"
    cached = tmp_path / "cached.zarr"
    monkeypatch.setenv("HSTRACE_DIRECT_IO", "1")
    _record(direct, 5)
    monkeypatch.setenv("HSTRACE_DIRECT_IO", "0")
    _record(cached, 5)
    with open(_key(direct), "rb") as a, open(_key(cached), "rb") as b:
        assert a.read() == b.read()


def test_the_write_function_alone(tmp_path, monkeypatch):
    chunk = np.sin(np.arange(512 * 300, dtype=np.float32)).reshape(512, 300)
    data = _frame_of(chunk)
    key = tmp_path / "k"
    rowlog._write_chunk_file(str(key), data)
    stored = key.read_bytes()
    assert stored == bytes(data.block[: data.nbytes])
    assert np.array_equal(np.frombuffer(Blosc().decode(stored), np.float32), chunk.reshape(-1))
    # without O_DIRECT (a flag off, or a file system that refuses it): the same bytes
    monkeypatch.setattr(rowlog.ENCODER, "direct_io", False)
    rowlog._write_chunk_file(str(tmp_path / "k2"), data)
    assert (tmp_path / "k2").read_bytes() == stored
    # a frame in ordinary memory (numcodecs' bytes), or an aligned one marked `cached` (a raw
    # chunk of a writer far behind): through the page cache, the same bytes
    rowlog._write_chunk_file(str(tmp_path / "k3"), bytes(stored))
    assert (tmp_path / "k3").read_bytes() == stored
    monkeypatch.setattr(rowlog.ENCODER, "direct_io", True)
    rowlog._write_chunk_file(str(tmp_path / "k4"), rowlog.Aligned(data.block, data.nbytes, True))
    assert (tmp_path / "k4").read_bytes() == stored


def test_a_failed_write_leaves_the_key_and_no_temp_file(tmp_path, monkeypatch):
    key = tmp_path / "k"
    key.write_bytes(b"the last tail flush")
    chunk = np.cos(np.arange(512 * 300, dtype=np.float32)).reshape(512, 300)

    def eio(fd, view, offset):
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(rowlog, "_write_all", eio)
    with pytest.raises(OSError, match="injected"):
        rowlog._write_chunk_file(str(key), _frame_of(chunk))
    assert key.read_bytes() == b"the last tail flush"
    assert os.listdir(tmp_path) == ["k"]
