"""The writer process's native step (hstrace/trace/write/_native.c copy_rows, driven by
writer_process._write_step): the rows of every column that fits its chunk buffer are copied
in one call, the rest are left to RowLog.append_from, and a trace written with it holds the
same rows, and the same chunk files, as one written through the Python route."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from hstrace.trace import create_trace, open_trace
from hstrace.trace.write import rowlog, writer_process
from hstrace.trace.write.protocol import ALIGN
from hstrace.trace.write.recorder import RankRecorder

native = pytest.importorskip("hstrace.trace.write._native")
if not hasattr(native, "copy_rows"):
    pytest.skip("the native extension predates copy_rows", allow_module_level=True)

W = 2048  # float32: 8 KiB rows, unsharded, 512-row chunks: a chunk ends every few steps
SPEC = {
    "step": {"mode": ("int64", "int64", ())},
    "tok": {"x": ("float32", "float32", (W,)), "ids": ("int64", "int64", ())},
}


def _state(cols: list[dict]) -> np.ndarray:
    st = np.zeros((len(cols), rowlog.CR_WORDS), np.int64)
    for i, c in enumerate(cols):
        st[i, rowlog.CR_DST] = c["dst"].ctypes.data if c.get("dst") is not None else 0
        st[i, rowlog.CR_FILL] = c.get("fill", 0)
        st[i, rowlog.CR_CAP] = c["cap"]
        st[i, rowlog.CR_ROWB] = c["rowb"]
        st[i, rowlog.CR_AXIS] = c["axis"]
        st[i, rowlog.CR_GATE] = c.get("gate", 0)
    return st


def test_copy_rows_copies_what_fits_and_lists_the_rest():
    src = np.arange(4096, dtype=np.uint8)
    a, b, c, d, e = (np.zeros(64, np.uint8) for _ in range(5))
    cols = [
        {"dst": a, "fill": 2, "cap": 8, "rowb": 8, "axis": 0},  # 1 row: copied after 2
        {"dst": b, "cap": 8, "rowb": 4, "axis": 1, "gate": 1},  # gated: left
        {"dst": None, "cap": 8, "rowb": 4, "axis": 1},  # no buffer in hand: left
        {"dst": d, "fill": 5, "cap": 8, "rowb": 4, "axis": 1},  # 3 rows end the chunk: left
        {"dst": e, "cap": 8, "rowb": 2, "axis": 2},  # no rows: not listed
        {"dst": c, "fill": 1, "cap": 8, "rowb": 4, "axis": 1, "gate": 0},  # copied
    ]
    st = _state(cols)
    slow = np.full((len(cols), 2), -7, np.int64)
    counts = (1, 3, 0)
    k = native.copy_rows(src.ctypes.data, src.nbytes, 128, counts, st.ctypes.data, len(cols),
                         slow.ctypes.data)  # fmt: skip
    assert k == 3
    # each column at an ALIGN-aligned offset after the previous one, from base 128
    assert slow[:k].tolist() == [[1, 128 + ALIGN], [2, 128 + 2 * ALIGN], [3, 128 + 3 * ALIGN]]
    assert a[16:24].tolist() == src[128:136].tolist() and not a[:16].any() and not a[24:].any()
    assert c[4:16].tolist() == src[128 + 4 * ALIGN : 128 + 4 * ALIGN + 12].tolist()
    assert not b.any() and not d.any() and not e.any()
    assert st[:, rowlog.CR_FILL].tolist() == [3, 0, 0, 5, 0, 4]
    # rows past the end of the ring are never read: left to Python (which raises there)
    st = _state([{"dst": a, "cap": 64, "rowb": 8, "axis": 0}])
    assert native.copy_rows(src.ctypes.data, 132, 128, (1,), st.ctypes.data, 1,
                            slow.ctypes.data) == 1  # fmt: skip


@pytest.mark.parametrize(
    ("counts", "axis", "message"),
    [((-1,), 0, "negative row count"), ((1,), 1, "axis 1 of 1"), ((1 << 50,), 0, "beyond")],
)
def test_copy_rows_refuses_bad_counts(counts, axis, message):
    src = np.zeros(256, np.uint8)
    st = _state([{"dst": np.zeros(8, np.uint8), "cap": 8, "rowb": 8, "axis": axis}])
    slow = np.zeros((1, 2), np.int64)
    with pytest.raises(ValueError, match=message):
        native.copy_rows(src.ctypes.data, 256, 0, counts, st.ctypes.data, 1, slow.ctypes.data)
    with pytest.raises(TypeError):
        native.copy_rows(src.ctypes.data, 256, 0, list(counts), st.ctypes.data, 1, 0)


class _Ring:
    """The writer's view of a staging ring (RingView's buf, addr and size), filled here."""

    def __init__(self, size: int) -> None:
        self.buf = mmap.mmap(-1, size)
        self.size = size
        self.view = np.frombuffer(self.buf, np.uint8)
        self.addr = self.view.ctypes.data

    def stage(self, base: int, arrays: list[np.ndarray]) -> None:
        """The step's columns at base, each at an ALIGN-aligned offset (ProcessSink's layout)."""
        off = base
        for a in arrays:
            raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            self.view[off : off + raw.nbytes] = raw
            off += -(-raw.nbytes // ALIGN) * ALIGN


def _steps(n: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    g = np.random.default_rng(0)
    out = []
    for s in range(n):
        rows = int(g.integers(0, 90)) if s % 7 else 0  # empty steps too
        x = np.sin(np.arange(rows * W, dtype=np.float32) + s).reshape(rows, W)
        out.append((s % 2, x, np.arange(rows, dtype=np.int64) + 1000 * s))
    return out


def _record(path, copy_rows, monkeypatch, steps) -> dict:
    create_trace(path, engine={"name": "test"})
    rec = RankRecorder(str(path), 0, tail_flush_s=60)
    t = rec.table("target", SPEC)
    ring = _Ring(1 << 22)
    left = []
    if copy_rows is not None:

        def counting(*args):
            k = copy_rows(*args)
            left.append(k)
            return k

        monkeypatch.setattr(writer_process, "COPY_ROWS", counting)
    else:
        monkeypatch.setattr(writer_process, "COPY_ROWS", None)
    for i, (mode, x, ids) in enumerate(steps):
        base = (i % 3) * (1 << 20)
        ring.stage(base, [np.array([mode], np.int64), x, ids])
        writer_process._write_step(rec, ring, base, "target", (1, len(ids)))
        if i % 10 == 9:
            for log in rec._all_logs():
                log.flush_tail()  # tail flushes in between, as the writer's ticks make them
    rec.close()
    assert t.steps == len(steps)
    return {"left": left}


def _files(path) -> dict[str, bytes]:
    root = os.path.join(path, "rank0", "target")
    out = {}
    for a, _, fs in os.walk(root):
        for f in fs:
            if f != "zarr.json":
                with open(os.path.join(a, f), "rb") as fh:
                    out[os.path.relpath(os.path.join(a, f), root)] = fh.read()
    return out


def test_a_trace_written_natively_is_the_python_routes(tmp_path, monkeypatch):
    steps = _steps(60)
    fast = _record(tmp_path / "native.zarr", native.copy_rows, monkeypatch, steps)
    _record(tmp_path / "python.zarr", None, monkeypatch, steps)
    # the native route took most columns' rows itself: 3 columns a step, a few left
    assert len(fast["left"]) == len(steps)
    assert sum(fast["left"]) < len(steps)
    with open_trace(tmp_path / "native.zarr") as a, open_trace(tmp_path / "python.zarr") as b:
        ta, tb = a.rank(0).table("target"), b.rank(0).table("target")
        assert ta.num_steps == tb.num_steps == len(steps)
        x = np.concatenate([s[1] for s in steps])
        ids = np.concatenate([s[2] for s in steps])
        assert np.array_equal(np.asarray(ta.column("tok", "x")), x)
        assert np.array_equal(np.asarray(ta.column("tok", "ids")), ids)
        assert np.array_equal(np.asarray(ta.column("step", "mode")), [s[0] for s in steps])
        for axis, col in (("tok", "x"), ("tok", "ids"), ("step", "mode")):
            assert np.array_equal(
                np.asarray(ta.column(axis, col)), np.asarray(tb.column(axis, col))
            )
    assert _files(tmp_path / "native.zarr") == _files(tmp_path / "python.zarr")
