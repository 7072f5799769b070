"""hstrace's own fast reader (hstrace/trace/chunkread.py): reads through a reused buffer, a
few chunks at a time, and returns exactly what plain zarr returns for any row range."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

from hstrace.trace import TraceWriter, chunkread, create_trace, open_trace
from hstrace.trace.write import rowlog


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """A sharded wide bf16 column (16 KiB rows: 256-row chunks inside shards) and an
    unsharded int32 column (4 KiB rows: one file per 1024-row chunk), some chunks stored
    raw (the writer told it is behind), the last chunk of each partly filled."""
    path = tmp_path_factory.mktemp("chunkread") / "t.zarr"
    create_trace(path, engine={"name": "test"})
    g = torch.Generator().manual_seed(11)
    scale = torch.exp(torch.randn(8192, generator=g) * 0.5)
    wide, narrow = [], []
    rowlog.configure(0, raw_when_behind=True)
    try:
        w = TraceWriter(path, process=False, tail_flush_s=60)
        for s in range(30):
            rowlog.set_behind(s % 3 == 0)
            n = 100 + 7 * s
            x = (torch.randn(n, 8192, generator=g) * scale).to(torch.bfloat16)
            ids = torch.randint(0, 512, (n, 1024), generator=g, dtype=torch.int32)
            wide.append(x)
            narrow.append(ids)
            w.write(
                "target",
                step={"mode": 0},
                req={"req_key": torch.tensor([s]), "n_tok": torch.tensor([n])},
                tok={"input_ids": ids[:, 0].contiguous(), "aux_hidden": x, "topk": ids},
            )
        w.close()
    finally:
        rowlog.configure(0, raw_when_behind=False)
        rowlog.set_behind(False)
    return path, torch.cat(wide).view(torch.uint16).numpy(), torch.cat(narrow).numpy()


RANGES = [(0, None), (0, 1), (255, 257), (300, 3000), (1023, 1025), (4000, None)]


@pytest.mark.parametrize("parallel_min", [1, 1 << 30], ids=["pool", "calling-thread"])
def test_any_row_range_reads_what_zarr_reads(trace, parallel_min, monkeypatch):
    path, wide, narrow = trace
    monkeypatch.setattr(chunkread, "PARALLEL_MIN_CHUNKS", parallel_min)
    z_wide = zarr.open_array(str(path / "rank0/target/tok.aux_hidden"), mode="r")
    z_narrow = zarr.open_array(str(path / "rank0/target/tok.topk"), mode="r")
    assert z_wide.shards is not None and z_narrow.shards is None  # both layouts under test
    n = len(wide)
    with open_trace(path) as tr:
        t = tr.rank(0).table("target")
        raw = tr.rank(0).meta["commit"]["tables"]["target"].get("uncompressed_chunks", {})
        assert raw.get("tok/aux_hidden", 0) > 0, raw  # raw and compressed chunks both read
        for a, b in RANGES:
            b = n if b is None else b
            got = t.column("tok", "aux_hidden", a, b).view(torch.uint16).numpy()
            assert np.array_equal(got, wide[a:b]), (a, b)
            assert np.array_equal(got, z_wide[a:b]), (a, b)
            got_n = t.column("tok", "topk", a, b)
            assert np.array_equal(got_n, narrow[a:b]), (a, b)
            assert np.array_equal(got_n, z_narrow[a:b]), (a, b)


def test_the_read_buffer_is_reused_not_reallocated(trace, monkeypatch):
    """Encoded bytes land in one per-thread buffer reused from read to read (fresh memory
    per shard read cost more than the decode itself), no bigger than a chunk."""
    path, wide, _ = trace
    monkeypatch.setattr(chunkread, "PARALLEL_MIN_CHUNKS", 1 << 30)  # on this thread
    with open_trace(path) as tr:
        arr = tr.rank(0).table("target")._arrays[("tok", "aux_hidden")]
        first = chunkread.read_rows(arr, 0, len(wide))
        buf = chunkread._buffer().buf
        second = chunkread.read_rows(arr, 0, len(wide))
    assert chunkread._buffer().buf is buf
    assert 0 < len(buf) <= arr.chunks[0] * 8192 * 2 + 1024
    assert np.array_equal(first, wide) and np.array_equal(second, wide)


def test_chunks_stored_raw_are_read_into_the_output_without_a_decode(trace, monkeypatch):
    """A chunk stored uncompressed (a Blosc level-0 frame) is read straight into its output
    rows: a decoder (the byte planes' or Blosc's) runs only for the compressed ones, and every
    row is still exact.
    A frame of that size whose header does not say memcpyed is decoded as usual."""
    path, wide, _ = trace
    decoded = []
    real = chunkread._BLOSC.decode

    class Counting:
        def decode(self, data, out=None):
            decoded.append(len(data))
            return real(data, out=out)

    planes = chunkread.blosc_planes.decompress_into

    def counting_planes(data, dest):
        done = planes(data, dest)
        if done:
            decoded.append(len(data))
        return done

    monkeypatch.setattr(chunkread, "_BLOSC", Counting())
    monkeypatch.setattr(chunkread.blosc_planes, "decompress_into", counting_planes)
    with open_trace(path) as tr:
        t = tr.rank(0).table("target")
        raw = tr.rank(0).meta["commit"]["tables"]["target"]["uncompressed_chunks"]["tok/aux_hidden"]
        arr = t._arrays[("tok", "aux_hidden")]
        decoded.clear()  # opening the table read its small columns
        got = chunkread.read_rows(arr, 0, len(wide))
    chunks = -(-len(wide) // arr.chunks[0])
    assert np.array_equal(got, wide)
    assert raw > 0 and len(decoded) == chunks - raw, (len(decoded), chunks, raw)
    assert all(n < arr.chunks[0] * 8192 * 2 for n in decoded)  # only compressed frames


def test_a_frame_of_raw_size_without_the_memcpyed_flag_is_not_taken_as_raw(tmp_path):
    """_read_raw_frame reads a frame into the output only when its header says memcpyed and
    its sizes match; anything else is left to the decoder (which checks and decodes it)."""
    import os
    import struct

    rows = np.arange(1024, dtype=np.uint16)
    for flags, nbytes, ok in [(0x93, 2048, True), (0x91, 2048, False), (0x93, 2046, False)]:
        p = tmp_path / f"f{flags}-{nbytes}"
        p.write_bytes(struct.pack("<BBBBIII", 2, 1, flags, 2, nbytes, 2048, 2064) + rows.tobytes())
        dest = np.zeros(1024, dtype=np.uint16)
        fd = os.open(p, os.O_RDONLY)
        try:
            assert chunkread._read_raw_frame(fd, 0, 2064, memoryview(dest).cast("B")) is ok
        finally:
            os.close(fd)
        if ok:
            assert np.array_equal(dest, rows)
