"""A column's zarr.json written directly (rowlog.array_metadata / write_metadata) is the one
zarr 3 writes for the same create_array call, and the column behaves as one zarr made: it
opens, resizes and reads back through zarr."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import zarr
from zarr.storage import LocalStore

from hstrace.trace.write import rowlog
from hstrace.trace.write.rowlog import COMPRESSORS, RowLog, array_metadata, write_metadata

DTYPES = ["bool", "uint8", "int8", "uint16", "int32", "int64", "float16", "float32", "float64"]
ROWS = [(), (8,), (3, 64)]
ATTRS = {"hstrace_dtype": "bfloat16", "units": ["a", 1, None, {"b": 2.5}], "empty": {}}


def _zarr_made(root: Path, name: str, shape, chunks, dtype, shard_rows, attrs) -> bytes:
    group = zarr.open_group(LocalStore(str(root)), mode="a")
    extra = {"shards": (shard_rows, *chunks[1:])} if shard_rows else {}
    group.create_array(
        name,
        shape=shape,
        chunks=chunks,
        dtype=dtype,
        compressors=COMPRESSORS,
        fill_value=0,
        attributes=attrs,
        config={"write_empty_chunks": True},
        **extra,
    )
    return (root / name / "zarr.json").read_bytes()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_shape", ROWS)
@pytest.mark.parametrize("shard_rows", [None, 1024])
def test_the_metadata_is_zarrs_own_byte_for_byte(tmp_path, dtype, row_shape, shard_rows) -> None:
    dt = np.dtype(dtype)
    shape, chunks = (4096, *row_shape), (64, *row_shape)
    theirs = _zarr_made(tmp_path / "z", "col", shape, chunks, dt, shard_rows, ATTRS)
    meta = array_metadata(shape, chunks, dt, shard_rows, ATTRS)
    assert meta is not None
    write_metadata(str(tmp_path / "d" / "col"), meta)
    ours = (tmp_path / "d" / "col" / "zarr.json").read_bytes()
    assert json.loads(ours) == json.loads(theirs)
    assert ours == theirs  # the same formatting too: a reader sees no difference at all
    assert sorted(p.name for p in (tmp_path / "d" / "col").iterdir()) == ["zarr.json"]


@pytest.mark.parametrize(
    ("dtype", "attrs"),
    [
        ("complex64", {}),  # a dtype it does not describe
        (">i4", {}),  # big-endian
        ("float32", {"x": math.nan}),  # attributes JSON cannot hold as zarr would
        ("float32", {"x": object()}),
    ],
)
def test_what_it_does_not_know_is_left_to_zarr(dtype, attrs) -> None:
    assert array_metadata((64,), (64,), np.dtype(dtype), None, attrs) is None


def test_a_column_made_directly_opens_resizes_and_reads_back_through_zarr(tmp_path) -> None:
    group = zarr.open_group(LocalStore(str(tmp_path)), mode="w").create_group("t")
    log = RowLog(group, "c", (3,), np.dtype(np.float32), "float32", {"k": "v"})
    assert log.arr is None  # nothing made through zarr
    arr = zarr.open_group(LocalStore(str(tmp_path)), mode="r")["t/c"]
    assert arr.shape == (log.capacity, 3) and arr.dtype == np.float32
    assert arr.attrs["hstrace_dtype"] == "float32" and arr.attrs["k"] == "v"
    rows = np.arange(30, dtype=np.float32).reshape(10, 3)
    log.append(rows)
    log.flush_tail()  # the partly filled chunk written at its key
    log._set_rows(10)  # a resize: its zarr.json rewritten directly, nothing opened
    assert log.arr is None
    back = zarr.open_group(LocalStore(str(tmp_path)), mode="r")["t/c"]
    assert back.shape == (10, 3)
    np.testing.assert_array_equal(back[:], rows)
    log.close()


@pytest.mark.parametrize("shard_rows", [None, 1024])
def test_a_resize_writes_what_zarrs_resize_writes(tmp_path, shard_rows) -> None:
    dt, shape, chunks = np.dtype(np.uint16), (4096, 192), (64, 192)
    _zarr_made(tmp_path / "z", "col", shape, chunks, dt, shard_rows, ATTRS)
    arr = zarr.open_group(LocalStore(str(tmp_path / "z")), mode="r+")["col"]
    arr.resize((77, 192))
    meta = array_metadata(shape, chunks, dt, shard_rows, ATTRS)
    write_metadata(str(tmp_path / "d" / "col"), meta)
    meta["shape"][0] = 77
    write_metadata(str(tmp_path / "d" / "col"), meta)  # over the existing one, by a rename
    theirs = (tmp_path / "z" / "col" / "zarr.json").read_bytes()
    assert (tmp_path / "d" / "col" / "zarr.json").read_bytes() == theirs
    assert sorted(p.name for p in (tmp_path / "d" / "col").iterdir()) == ["zarr.json"]


def test_an_existing_column_is_left_to_zarr_which_refuses_it(tmp_path) -> None:
    group = zarr.open_group(LocalStore(str(tmp_path)), mode="w").create_group("t")
    RowLog(group, "c", (), np.dtype(np.int64), "int64").close()
    with pytest.raises(Exception, match="c"):
        RowLog(group, "c", (), np.dtype(np.int64), "int64")
    assert rowlog.ZARR_JSON == "zarr.json"
