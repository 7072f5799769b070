"""The same write -> read round trip through every sink a TraceWriter can write through: the
memory sink (read back from RAM), the in-process recorder and the writer process (read back
from the trace on disk). Every column comes back byte for byte, on the fast path (a repeated
step shape), the general path (numpy, strided, lists) and split into several ring parts."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from helpers.trace_steps import step_data, verify_prefix

from hstrace.errors import TraceError
from hstrace.trace import TraceWriter, create_trace, open_trace
from hstrace.trace.write import protocol as P
from hstrace.trace.write.columns import row_counts, spec_of
from hstrace.trace.write.recorder import RankRecorder
from hstrace.trace.write.sink import MemorySink

SINKS = ["memory", "in-process", "writer-process"]


def _variant(s: int) -> dict:
    """step_data(s), handed over in one of the ways a producer does (not all take the fast path)."""
    d = step_data(s)
    kind = s % 5
    if kind == 1:
        d["tok"]["input_ids"] = d["tok"]["input_ids"].numpy()  # numpy, not a tensor
    elif kind == 2:
        ids = d["tok"]["input_ids"]
        d["tok"]["input_ids"] = torch.stack([ids, ids], 1)[:, 0]  # not contiguous
    elif kind == 3:
        d["req"]["n_tok"] = d["req"]["n_tok"].tolist()  # a list
    return d


def _writer(kind: str, path) -> tuple[TraceWriter, MemorySink | None]:
    if kind == "memory":
        sink = MemorySink()
        return TraceWriter(path, rank=0, sink=sink), sink
    return TraceWriter(
        path, rank=0, process=kind == "writer-process", max_part_bytes=64 << 10
    ), None


def _as_bytes(a) -> bytes:
    if isinstance(a, torch.Tensor):
        a = a.view(torch.int16) if a.dtype == torch.bfloat16 else a
        a = a.numpy()
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("kind", SINKS)
def test_round_trip_through_every_sink(tmp_path, kind):
    path = tmp_path / "t.zarr"
    create_trace(path, engine={"name": "test"})
    steps = 50  # step 7 and 47 are 3000-token prefills: 576 KiB, several 64 KiB parts
    w, mem = _writer(kind, path)
    with w:
        for s in range(steps):
            assert w.write("target", **_variant(s))
        w.update_static({"drafter": {"hash": "abc"}})
        w.note_error("some-tap", "disabled: boom")
        w.flush()
    want = {
        (axis, col): b"".join(_as_bytes(step_data(s)[axis][col]) for s in range(steps))
        for axis, col in [
            ("req", "req_key"),
            ("req", "n_tok"),
            ("tok", "input_ids"),
            ("tok", "positions"),
            ("tok", "aux_hidden"),
        ]
    }
    want[("step", "mode")] = np.array(
        [step_data(s)["step"]["mode"] for s in range(steps)], np.int64
    ).tobytes()
    want[("step", "seq")] = np.arange(steps, dtype=np.int64).tobytes()
    if mem is not None:
        assert mem.closed and mem.flushes == 1
        assert mem.static == {"drafter": {"hash": "abc"}}
        assert mem.errors == [("some-tap", "disabled: boom")]
        got = {k: mem.column("target", *k).tobytes() for k in want}
        spec = mem.tables["target"]["spec"]
        assert spec["tok"]["aux_hidden"] == ("uint16", "bfloat16", (96,))
        assert list(spec["step"]) == ["mode", "seq", "t_ns"]  # the writer fills seq, t_ns
        t_ns = mem.column("target", "step", "t_ns")
    else:
        with open_trace(path) as tr:
            r = tr.rank(0)
            assert r.clean_close and r.errors[0]["tap"] == "some-tap"
            assert tr.meta["static"]["drafter"] == {"hash": "abc"}
            t = r.table("target")
            assert t.num_steps == steps
            got = {(a, c): _as_bytes(t.column(a, c)) for a, c in want}
            assert t.column_attrs("tok", "aux_hidden")["hstrace_dtype"] == "bfloat16"
            t_ns = t.column("step", "t_ns")
    for key, b in want.items():
        assert got[key] == b, f"{kind}: {key[0]}/{key[1]} differs"
    assert np.all(np.diff(t_ns) >= 0) and t_ns[0] > 0


@pytest.mark.parametrize("kind", SINKS)
def test_every_sink_gets_the_same_validation(tmp_path, kind):
    """Validation is the writer's, before any sink: a mismatch reaches no sink."""
    path = tmp_path / "v.zarr"
    create_trace(path, engine={"name": "test"})
    w, mem = _writer(kind, path)
    with w:
        w.write("target", **step_data(0))
        bad = step_data(1)
        bad["tok"]["input_ids"] = bad["tok"]["input_ids"].long()
        with pytest.raises(
            TraceError,
            match=r"tok/input_ids:int64.*differ from the first write's .*tok/input_ids:int32",
        ):
            w.write("target", **bad)
        ragged = step_data(2)
        ragged["req"]["req_key"] = torch.tensor([1, 2, 3])
        with pytest.raises(TraceError, match=r"axis 'req' have different row counts"):
            w.write("target", **ragged)
        w.write("target", **step_data(3))
    if mem is not None:
        assert len(mem.tables["target"]["steps"]) == 2
        assert mem.column("target", "step", "seq").tolist() == [0, 1]  # failed writes: no gap
    else:
        with open_trace(path) as tr:
            assert tr.rank(0).table("target").column("step", "seq").tolist() == [0, 1]


def test_writer_and_recorder_share_one_schema_check(tmp_path):
    """RankRecorder.write_step (numpy level) refuses what TraceWriter refuses, in the same words."""
    rows = {
        "step": {"mode": np.zeros(1, np.int64)},
        "req": {"req_key": np.zeros(2, np.int64), "n_tok": np.zeros(1, np.int64)},
    }
    with pytest.raises(TraceError) as from_columns:
        row_counts("target", rows)
    path = tmp_path / "r.zarr"
    create_trace(path, engine={"name": "test"})
    rec = RankRecorder(str(path), 0)
    with pytest.raises(TraceError) as from_recorder:
        rec.write_step("target", rows)
    assert str(from_recorder.value) == str(from_columns.value)
    assert "different row counts {'req_key': 2, 'n_tok': 1}" in str(from_columns.value)
    spec = spec_of({"tok": {"h": torch.zeros(3, 4, dtype=torch.bfloat16)}})
    assert spec == {"tok": {"h": ("uint16", "bfloat16", (4,))}}  # tensors without converting


def test_protocol_messages_round_trip():
    codec = P.StepCodec(table_id=3, n_axes=3)
    frame = codec.frame(4096, 8192, (1, 2, 17), 9)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4  # Connection's framing
    assert P.decode(frame[4:]) == P.Step(3, 4096, 8192, (1, 2, 17))
    assert P.after(frame[4:]) == 9  # taken after the first 9 descriptors
    for msg in (
        P.Table(0, "target", {"step": {"mode": ("int64", "int64", ())}}, None),
        P.Part(1, 0, 128, (("tok", "aux_hidden", 0, 5),), {"step": 1, "tok": 5}),
        P.Static({"a": 1}),
        P.Error("tap", "boom"),
        P.Dropped({"target": 2}),
        P.Flush({}),
        P.Close({"target": 2}),
    ):
        framed = P.frame_control(msg, 12345)
        assert P.decode(framed[4:]) == msg and P.after(framed[4:]) == 12345
    with pytest.raises(ValueError, match="unknown message kind"):
        P.decode(b"\x09")


@pytest.mark.parametrize("kind", SINKS)
def test_python_int_step_columns_stay_exact_at_the_int64_edges(tmp_path, kind):
    """A Python int on an int64 step column is handed to the sink as it is (the fast path makes
    no numpy scalar of it): the extremes come back exactly, one past them is refused by name."""
    path = tmp_path / "i.zarr"
    create_trace(path, engine={"name": "test"})
    edges = [0, (1 << 63) - 1, -(1 << 63), -1, 5]

    def event(value) -> dict:
        return {"step": {"value": value}, "tok": {"x": torch.arange(3, dtype=torch.int32)}}

    w, mem = _writer(kind, path)
    with w:
        for value in edges:
            assert w.write("events", **event(value))
        with pytest.raises(TraceError, match=r"step/value:uint64.*differ.*step/value:int64"):
            w.write("events", **event(1 << 63))
        with pytest.raises(TraceError, match=r"step/value:object.*differ.*step/value:int64"):
            w.write("events", **event(-(1 << 63) - 1))
        with pytest.raises(TraceError, match=r"step/value:bool.*differ.*step/value:int64"):
            w.write("events", **event(True))  # a bool is not an int64 column's value
    if mem is not None:
        got = mem.column("events", "step", "value")
        seq = mem.column("events", "step", "seq")
    else:
        with open_trace(path) as tr:
            t = tr.rank(0).table("events")
            got, seq = t.column("step", "value"), t.column("step", "seq")
    assert got.dtype == np.int64 and got.tolist() == edges
    assert seq.tolist() == list(range(len(edges)))


def test_round_trip_through_the_pipe_alone(tmp_path, monkeypatch):
    """Where the descriptor queue is off (not x86: process_sink.DESCRIPTORS), every step goes
    down the data pipe: the same round trip, byte for byte."""
    from hstrace.trace.write import process_sink

    monkeypatch.setattr(process_sink, "DESCRIPTORS", False)
    test_round_trip_through_every_sink(tmp_path, "writer-process")
    path = tmp_path / "p.zarr"
    create_trace(path, engine={"name": "test"})
    with TraceWriter(path, rank=0) as w:
        for s in range(30):
            w.write("target", **step_data(s))
        published = w.sink._published
    assert published == 0
    with open_trace(path) as tr:
        assert tr.rank(0).table("target").column("step", "seq").tolist() == list(range(30))


def _route_steps(s: int) -> tuple[str, dict]:
    """Step s of a run that mixes what the native step takes (plain tensors, views at an
    offset, Python ints at the int64 edges, a 0-d tensor for an int column, requires_grad)
    with what it hands to the Python route (numpy, lists, strided, a Parameter, a prefill of
    several parts)."""
    if s % 4 == 1:  # a second table with an axis of its own and 2-d rows
        g = torch.Generator().manual_seed(s)
        kv = torch.randn(3, 2, 8, generator=g).to(torch.bfloat16)
        if s % 8 == 5:
            kv.requires_grad_(True)
        step = {"layer": torch.tensor(s) if s % 16 == 9 else s, "t_ns": 1000 + s}
        return "blocks", {"step": step, "blk": {"kv": kv}, "tok": {"ids": torch.arange(s, s + 2)}}
    # numpy, strided, lists (s % 5 in 1, 2, 3); s = 7, 47, 87: 3000-token prefills
    d = step_data(s) if s % 40 == 7 and s > 40 else _variant(s)
    d["step"]["t_ns"] = 10**12 + s  # the writer's own clock would differ between the two runs
    if s % 11 == 4:
        pos = d["tok"]["positions"]
        d["tok"]["positions"] = torch.cat([pos[:1], pos])[1:]  # contiguous, at an offset
    elif s % 11 == 6:
        d["tok"]["aux_hidden"] = torch.nn.Parameter(d["tok"]["aux_hidden"], requires_grad=False)
    elif s % 11 == 8:
        d["step"]["mode"] = (1 << 63) - 1 if s % 2 else -(1 << 63)
    return "target", d


def _store_files(root) -> dict[str, object]:
    """Every file of a trace, the commit's time stamps left out of the JSON ones."""
    import json
    from pathlib import Path

    out: dict[str, object] = {}
    for f in sorted(Path(root).rglob("*")):
        if f.is_file():
            data = f.read_bytes()
            if f.name == "zarr.json":
                doc = json.loads(data)
                h = doc.get("attributes", {}).get("hstrace", {})
                h.pop("created", None)
                h.get("commit", {}).pop("updated_ns", None)
                data = doc
            out[str(f.relative_to(root))] = data
    return out


def test_native_and_python_routes_write_byte_identical_traces(tmp_path, monkeypatch):
    """The same 120 steps (and the same refused ones) through the native one-call step and the
    pure-Python route: identical trace files, identical errors; the native route took every
    step it may take and none of the others."""
    from helpers.native_route import use_route

    traces, errors, taken = {}, {}, {}
    for route in ("native", "python"):
        use_route(monkeypatch, route)
        path = tmp_path / f"{route}.zarr"
        create_trace(path, engine={"name": "test"})
        errs = []
        with TraceWriter(path, rank=0, max_part_bytes=64 << 10) as w:
            for s in range(120):
                table, d = _route_steps(s)
                assert w.write(table, **d)
                if s % 30 == 29:  # refused: a dtype, a ragged axis, a missing column
                    bad = _route_steps(s + 1)[1]
                    for how in ("dtype", "ragged", "missing"):
                        b = {a: dict(v) for a, v in bad.items()}
                        if how == "dtype":
                            b["tok"]["input_ids"] = b["tok"]["input_ids"].long()
                        elif how == "ragged":
                            b["req"]["req_key"] = torch.tensor([1, 2, 3])
                        else:
                            del b["tok"]["positions"]
                        with pytest.raises(TraceError) as e:
                            w.write("target", **b)
                        errs.append(str(e.value))
            cur = w.sink._cur
            taken[route] = getattr(cur, "taken", None)
        traces[route] = _store_files(path)
        errors[route] = errs
    assert traces["native"].keys() == traces["python"].keys()
    for name, data in traces["native"].items():
        assert data == traces["python"][name], f"{name} differs between the routes"
    assert errors["native"] == errors["python"] and len(errors["native"]) == 12
    # The Python route has no native cursor. The native one took exactly the steps after each
    # table's first whose every column is a contiguous torch.Tensor or an int.
    # (A strided view of one row is contiguous: one-token strided steps count as plain.)
    plain = [
        s
        for s in range(2, 120)  # 0 and 1: each table's first step
        if s % 40 != 7  # the prefills: several ring parts
        and all(
            type(v) is int or (type(v) is torch.Tensor and v.is_contiguous())
            for cols in _route_steps(s)[1].values()
            for v in cols.values()
        )
    ]
    assert taken["python"] is None and taken["native"] == len(plain)
    with open_trace(tmp_path / "native.zarr") as tr:
        b = tr.rank(0).table("blocks")
        assert b.num_steps == 30 and b.column("step", "layer").tolist() == list(range(1, 120, 4))


def test_the_native_step_refuses_without_a_trace_and_only_what_python_refuses(
    tmp_path, monkeypatch
):
    """The native call either stages a step whole (and the writer's own checks would pass it
    with the same rows) or hands it back with the ring cursor untouched."""
    from helpers.native_route import use_route

    use_route(monkeypatch, "native")
    path = tmp_path / "n.zarr"
    create_trace(path, engine={"name": "test"})
    with TraceWriter(path, rank=0) as w:
        w.write("target", **step_data(1))
        m, cur = w._matchers["target"], w.sink._cur
        assert m.fast is not None
        ok = step_data(2)
        strided = step_data(2)
        strided["tok"]["input_ids"] = torch.arange(
            2 * len(ok["tok"]["input_ids"]), dtype=torch.int32
        )[::2]
        cases = {
            "ok": (ok, True),
            "numpy": (
                {**ok, "tok": {**ok["tok"], "positions": ok["tok"]["positions"].numpy()}},
                None,
            ),
            "strided": (strided, None),
            "float": ({**ok, "req": {**ok["req"], "n_tok": ok["req"]["n_tok"].float()}}, None),
            "ragged": ({**ok, "req": {**ok["req"], "n_tok": torch.tensor([1, 2, 3])}}, None),
            "width": (
                {**ok, "tok": {**ok["tok"], "aux_hidden": ok["tok"]["aux_hidden"][:, :8]}},
                None,
            ),
            "extra": ({**ok, "tok": {**ok["tok"], "more": ok["tok"]["positions"]}}, None),
            "bool": ({**ok, "step": {"mode": True}}, None),
            "big int": ({**ok, "step": {"mode": 1 << 63}}, None),
            "axis": ({**ok, "blk": {"x": torch.zeros(1)}}, None),
            "no req": ({**ok, "req": None}, None),
        }
        for name, (d, want) in cases.items():
            d = dict(d)
            step, req, tok = d.pop("step"), d.pop("req"), d.pop("tok")
            hit = m.match(w._seq, step, req, tok, d)
            before = (cur.head, cur.published, cur.taken)
            got = m.fast(w._seq, step, req, tok, d)
            assert got is want, name
            if got:
                assert hit is not None, f"{name}: native took what the writer's checks refuse"
                w._seq += 1
                assert cur.published == before[1] + 1 and cur.taken == before[2] + 1
            else:
                assert (cur.head, cur.published, cur.taken) == before, f"{name}: left a trace"
    with open_trace(path) as tr:
        t = tr.rank(0).table("target")
        assert t.num_steps == 2
        assert _as_bytes(t.column("tok", "aux_hidden"))[
            -len(_as_bytes(ok["tok"]["aux_hidden"])) :
        ] == _as_bytes(ok["tok"]["aux_hidden"])


def _fixed_step(s: int) -> dict:
    g = torch.Generator().manual_seed(s)
    return {
        "step": {"value": s},
        "req": {"req_key": torch.tensor([s])},
        "tok": {
            "input_ids": torch.arange(s, s + 128, dtype=torch.int32),
            "aux_hidden": torch.randn(128, 96, generator=g).to(torch.bfloat16),
        },
    }


@pytest.mark.parametrize("route", ["native", "python"])
def test_a_full_ring_drops_the_same_steps_on_both_routes(tmp_path, monkeypatch, route):
    """With the writer process stopped, a 1 MiB ring fills after the same steps on either route;
    on_full="drop" drops the rest (counted), and after the writer catches up steps are kept
    again. The kept steps come back bit-exact."""
    import os
    import signal

    from helpers.native_route import use_route

    use_route(monkeypatch, route)
    path = tmp_path / "d.zarr"
    create_trace(path, engine={"name": "test"})
    w = TraceWriter(path, rank=0, on_full="drop", staging_bytes=1 << 20)
    os.kill(w.writer_pid, signal.SIGSTOP)
    try:
        kept = [s for s in range(80) if w.write("events", **_fixed_step(s))]
    finally:
        os.kill(w.writer_pid, signal.SIGCONT)
    w.flush()
    kept += [s for s in range(80, 90) if w.write("events", **_fixed_step(s))]
    taken = getattr(w.sink._cur, "taken", None)
    w.close()
    # 25.2 KB a step (ids, aux, the step and request words, each 64-byte aligned) in 1 MiB
    assert kept == list(range(41)) + list(range(80, 90))
    assert (taken is None) == (route == "python") and (taken is None or taken == len(kept) - 1)
    with open_trace(path) as tr:
        r = tr.rank(0)
        assert r.dropped_steps == {"events": 80 - 41}
        t = r.table("events")
        assert t.column("step", "seq").tolist() == kept
        assert t.column("step", "value").tolist() == kept
        want = b"".join(_as_bytes(_fixed_step(s)["tok"]["aux_hidden"]) for s in kept)
        assert _as_bytes(t.column("tok", "aux_hidden")) == want


def test_a_control_message_never_makes_the_reader_import_a_module():
    """The writer process imports no torch; a pickled `torch.__version__` (a TorchVersion) in
    a Static message made it import torch at every arm (4 CPU-seconds out of serving)."""
    import subprocess
    import sys

    framed = P.frame_control(P.Static({"torch": torch.__version__}), 0)
    code = (
        "import sys\n"
        "from hstrace.trace.write import protocol as P\n"
        "buf = sys.stdin.buffer.read()\n"
        "try:\n"
        "    P.decode(buf)\n"
        "except P.NotPlainData as exc:\n"
        "    print('refused:', exc)\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=framed[4:], capture_output=True, check=True
    ).stdout.decode()
    assert "refused: a control message carries torch.torch_version.TorchVersion" in out
    assert "torch imported: False" in out


def test_static_items_reach_the_writer_as_plain_data(tmp_path):
    path = tmp_path / "t.zarr"
    create_trace(path, engine={"name": "test"})
    with TraceWriter(path, rank=0, process=True) as w:
        w.update_static({"serving": {"torch": torch.__version__, "n": np.int64(3)}})
        with pytest.raises(TraceError, match="static audit items must be JSON data"):
            w.update_static({"bad": object()})
        w.write("t", step={"x": torch.ones(1)})
        w.flush()
        with open(f"/proc/{w.writer_pid}/maps") as f:  # what the writer process has loaded
            assert "libtorch" not in f.read()
    static = open_trace(path).meta["static"]
    assert static["serving"] == {"torch": str(torch.__version__), "n": 3}
    assert type(static["serving"]["torch"]) is str


def test_the_writer_holds_a_batch_only_early_in_the_engines_gap() -> None:
    """`RingView.gap_left`: the producer's engine is between two steps (its last step ended
    after the last one started) and the gap is younger than the last one lasted (a quarter
    more and GAP_MARGIN_NS; the hold where none was told): the rest of it; in a step, past
    that (an idle server), or never told (SGLang, a test): nothing; never more than the hold."""
    import numpy as np

    from hstrace.trace.write.ring import (
        GAP_MARGIN_NS,
        STEP_ENDED,
        STEP_GAP,
        STEP_STARTED,
        TRAILER_WORDS,
        RingView,
    )

    hold = 5_000_000
    view = RingView.__new__(RingView)
    view._trailer = np.zeros(TRAILER_WORDS, dtype=np.int64)
    tr = view._trailer
    assert view.gap_left(10**9, hold) == 0  # never told
    tr[STEP_STARTED], tr[STEP_ENDED] = 1_000_000, 2_000_000  # no gap measured yet: the hold
    assert view.gap_left(2_400_000, hold) == 4_600_000
    tr[STEP_GAP] = 1_200_000  # the last gap lasted 1.2 ms: this one is expected to last 1.5
    assert view.gap_left(2_400_000, hold) == 2_000_000 + 1_500_000 + GAP_MARGIN_NS - 2_400_000
    assert view.gap_left(2_000_000 + 1_500_000 + GAP_MARGIN_NS, hold) == 0  # longer: idle
    tr[STEP_STARTED] = 2_600_000  # the next step runs
    assert view.gap_left(2_700_000, hold) == 0
    tr[STEP_STARTED], tr[STEP_GAP] = 1_000_000, 10**12  # a gap told longer than the hold
    assert view.gap_left(2_000_000, hold) == hold
    tr[STEP_ENDED] = 10**15  # a gap that ends in the future: still the hold at most
    assert view.gap_left(2_000_000, hold) == hold


def test_the_producer_tells_the_step_its_gap() -> None:
    """`ProcessSink.step_phase`: a start stores when, and how long the gap before it lasted."""
    from hstrace.trace.write.process_sink import ProcessSink
    from hstrace.trace.write.ring import STEP_ENDED, STEP_GAP, STEP_STARTED

    sink = ProcessSink.__new__(ProcessSink)
    words = np.zeros(8, dtype=np.int64)
    sink._phase_lock, sink._phase_words = threading.Lock(), words
    sink.step_phase(True)  # no step ended yet: no gap
    assert words[STEP_STARTED] > 0 and words[STEP_GAP] == 0
    sink.step_phase(False)
    ended = int(words[STEP_ENDED])
    assert ended >= words[STEP_STARTED]
    sink.step_phase(True)
    assert words[STEP_GAP] == words[STEP_STARTED] - ended >= 0
    sink._phase_words = None  # closed (`_teardown`): a late mark stores nothing
    sink.step_phase(False)


def test_a_step_mark_after_the_close_stores_nothing(tmp_path) -> None:
    """The engine's serving thread may mark a step while a disarm closes the writer: after
    the close the mark is a no-op, never a store into the unmapped ring."""
    out = tmp_path / "t.zarr"
    create_trace(out, engine={"name": "test"})
    w = TraceWriter(out, rank=0, process=True)
    w.step_phase(True)
    w.close()
    w.step_phase(False)
    w.step_phase(True)


def test_an_engine_always_between_steps_never_starves_the_writer(tmp_path) -> None:
    """A producer whose engine is forever in a gap younger than the hold (its words say so;
    at its extreme, an engine whose steps are far shorter than the hold): each batch waits
    once, at most the hold, and every step is taken (the ring's TAKEN word), no flush needed
    to push it through."""
    from hstrace.trace.write.process_sink import ProcessSink
    from hstrace.trace.write.ring import PUBLISHED, STEP_ENDED, TAKEN

    out = tmp_path / "t.zarr"
    create_trace(out, engine={"name": "test"})
    w = TraceWriter(out, rank=0, process=True)
    sink = w.sink
    assert isinstance(sink, ProcessSink)
    w.step_phase(True)
    w.step_phase(False)
    sink._trailer[STEP_ENDED] = time.monotonic_ns() + 10**15  # a gap that never ages
    try:
        for s in range(50):
            assert w.write("target", **_variant(s))
            time.sleep(0.001)
        deadline = time.monotonic() + 60
        while sink._trailer[TAKEN] < sink._trailer[PUBLISHED] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sink._trailer[PUBLISHED] >= 1 and sink._trailer[TAKEN] == sink._trailer[PUBLISHED]
    finally:
        w.close()
    assert verify_prefix(out) == 50
