"""The trace store's two layers (issue 23 item 4): importing any of its modules binds no C
extension and reads no environment flag; a writer or a reader reads them as it is built."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch

from hstrace.trace import TraceWriter, create_trace, open_trace
from hstrace.trace.write import process_sink, rowlog

TRACE_MODULES = [
    "hstrace.trace",
    "hstrace.trace.reader",
    "hstrace.trace.chunkread",
    "hstrace.trace.summary",
    "hstrace.trace.codecs.blosc_into",
    "hstrace.trace.codecs.blosc_planes",
    "hstrace.trace.write.writer",
    "hstrace.trace.write.sink",
    "hstrace.trace.write.process_sink",
    "hstrace.trace.write.rowlog",
    "hstrace.trace.write.recorder",
    "hstrace.trace.write.writer_process",
]


def test_importing_the_store_binds_no_extension():
    """Every module of the store imported, in a fresh interpreter: neither C extension is
    loaded, c-blosc's symbol is not looked up, and no flag was read into a module global."""
    code = f"""
import importlib, sys
for m in {TRACE_MODULES!r}:
    importlib.import_module(m)
from hstrace.trace.codecs import blosc_into, blosc_planes
from hstrace.trace.write import process_sink, rowlog, writer_process
print(sorted(m for m in ("hstrace.trace.write._native", "hstrace.trace.codecs._planes")
             if m in sys.modules))
print(blosc_into._compress_ctx is blosc_into._UNBOUND, blosc_planes._bound is blosc_planes._UNBOUND,
      process_sink._native is process_sink._UNBOUND)
print(sorted(n for n in ("NATIVE", "DIRECT_IO", "PREFETCH", "AVAILABLE", "MMAP_THRESHOLD")
             for mod in (process_sink, rowlog, writer_process, blosc_into, blosc_planes)
             if hasattr(mod, n)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:3] == ["[]", "True True True", "[]"], out.stdout


def _write(path) -> None:
    create_trace(path, engine={"name": "test"})
    with TraceWriter(path, rank=0, process=False) as w:
        h = torch.arange(64 * 2048, dtype=torch.float32).reshape(64, 2048).to(torch.bfloat16)
        w.write("target", step={"mode": 0}, tok={"aux_hidden": h})


def test_a_writer_reads_its_flags_as_it_is_built(tmp_path, monkeypatch):
    monkeypatch.setenv("HSTRACE_DIRECT_IO", "0")
    monkeypatch.setenv("HSTRACE_PLANES", "0")
    _write(tmp_path / "a.zarr")
    assert (rowlog.ENCODER.direct_io, rowlog.ENCODER.planes) == (False, False)
    monkeypatch.setenv("HSTRACE_DIRECT_IO", "1")
    monkeypatch.delenv("HSTRACE_PLANES")
    _write(tmp_path / "b.zarr")
    assert rowlog.ENCODER.direct_io is True
    from hstrace.trace.codecs import blosc_planes

    assert rowlog.ENCODER.planes is blosc_planes.available()
    # both read back the same, whichever encoder wrote them
    with open_trace(tmp_path / "a.zarr") as a, open_trace(tmp_path / "b.zarr") as b:
        ta, tb = a.rank(0).table("target"), b.rank(0).table("target")
        x, y = ta.column("tok", "aux_hidden"), tb.column("tok", "aux_hidden")
        assert torch.equal(x.view(torch.int16), y.view(torch.int16)) and len(x) == 64


def test_a_reader_reads_its_flags_as_it_is_opened(tmp_path, monkeypatch):
    _write(tmp_path / "t.zarr")
    monkeypatch.setenv("HSTRACE_PREFETCH", "0")
    monkeypatch.setenv("HSTRACE_PLANES", "0")
    with open_trace(tmp_path / "t.zarr") as tr:
        assert (tr.read_flags.prefetch, tr.read_flags.planes) == (False, False)
        off = tr.rank(0).table("target").column("tok", "aux_hidden")
    monkeypatch.delenv("HSTRACE_PREFETCH")
    monkeypatch.delenv("HSTRACE_PLANES")
    with open_trace(tmp_path / "t.zarr") as tr:
        assert tr.read_flags.prefetch is True
        on = tr.rank(0).table("target").column("tok", "aux_hidden")
    assert np.array_equal(off.view(torch.int16).numpy(), on.view(torch.int16).numpy())


def test_the_native_route_is_read_when_a_sink_is_built(monkeypatch):
    monkeypatch.setenv("HSTRACE_NATIVE", "0")
    assert process_sink.native_route() is None
    monkeypatch.setenv("HSTRACE_NATIVE", "1")
    want = process_sink.native_extension() if process_sink.DESCRIPTORS else None
    assert process_sink.native_route() is want
