"""hstrace's own fast reader (hstrace/trace/chunkread.py): reads through a reused buffer, a
few chunks at a time, and returns exactly what plain zarr returns for any row range."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

from hstrace.trace import TraceWriter, chunkread, create_trace, open_trace, rowlog


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


@pytest.mark.parametrize("group_bytes", [32 << 20, 1], ids=["default", "one-chunk-per-group"])
def test_any_row_range_reads_what_zarr_reads(trace, group_bytes, monkeypatch):
    path, wide, narrow = trace
    monkeypatch.setattr(chunkread, "GROUP_BYTES", group_bytes)
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


def test_the_read_buffer_is_reused_not_reallocated(trace):
    """Encoded bytes land in one per-thread buffer reused from read to read (fresh memory
    per shard read cost more than the decode itself); it stays at GROUP_BYTES."""
    path, wide, _ = trace
    with open_trace(path) as tr:
        arr = tr.rank(0).table("target")._arrays[("tok", "aux_hidden")]
        first = chunkread.read_rows(arr, 0, len(wide))
        buf = chunkread._buffer().buf
        second = chunkread.read_rows(arr, 0, len(wide))
    assert chunkread._buffer().buf is buf
    assert len(buf) <= chunkread.GROUP_BYTES
    assert np.array_equal(first, wide) and np.array_equal(second, wide)
