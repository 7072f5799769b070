"""hstrace's own producers through the shipped store conformance suite (hstrace.testing), and
the suite failing on producers that get the format wrong.

Each `Test*` class below is what an out-of-tree producer writes: a subclass of
`StoreConformance` with a `make_trace`. The trace is made once per class; every check runs on it.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from helpers.demo_trace import write_demo_trace

from hstrace.bundle import BundleOptions, make_bundle
from hstrace.testing import (
    ConformanceError,
    ProducedTrace,
    StoreConformance,
    check_committed_prefix,
    check_corrupt_chunk,
    check_offsets,
    check_plain_zarr,
    check_round_trip,
    check_schema,
    record_writes,
)
from hstrace.trace import (
    MemorySink,
    RecorderSink,
    Sink,
    TraceWriter,
    create_trace,
    request_key,
)

WIDTH = 64  # 2 aux slots of 32
ROWS = 65536 // WIDTH  # every bf16 bit pattern once


def every_bf16_pattern() -> torch.Tensor:
    """All 65,536 bf16 bit patterns (both zeros, infinities, every NaN payload), [ROWS, WIDTH]."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    return (
        bits[torch.randperm(65536, generator=torch.Generator().manual_seed(0))]
        .view(torch.bfloat16)
        .reshape(ROWS, WIDTH)
    )


def odd_float32(n: int) -> torch.Tensor:
    """float32 with NaN payloads, both infinities, -0.0 and subnormals among normal values."""
    special = np.array([0x7FC00001, 0xFFC0BEEF, 0x7F800000, 0xFF800000, 0x80000000, 1], np.uint32)
    vals = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    vals.view(np.uint32)[: len(special)] = special
    return torch.from_numpy(vals)


def write_bit_patterns(path: Path, make_sink=None, **writer_kw) -> Path:
    """Four engine steps of two requests (prefill, then verify rounds) through `TraceWriter`
    with `writer_kw` (process=False/True) or `sink=make_sink(path)`: every bf16 bit pattern in
    aux_hidden."""
    create_trace(path, engine={"name": "conformance", "version": "1"}, command_line=["test"])
    if make_sink is not None:
        writer_kw["sink"] = make_sink(path)
    rids = ["a", "b"]
    keys = [request_key(r) for r in rids]
    aux = every_bf16_pattern()
    per = ROWS // 8  # rows per request per step
    with TraceWriter(path, rank=0, **writer_kw) as w:
        for rid, key in zip(rids, keys, strict=True):
            b = torch.tensor(list(rid.encode()), dtype=torch.uint8)
            w.write(
                "requests",
                req={"req_key": [key], "n_prompt": [per], "rid_len": [len(b)], "n_cached": [0]},
                tok={"prompt_ids": torch.arange(per) % 500},
                rid={"bytes": b},
            )
        for s in range(4):
            rows = slice(2 * per * s, 2 * per * (s + 1))
            pos = torch.arange(per) + s * per
            w.write(
                "target",
                step={"mode": int(s > 0)},
                req={"req_key": keys, "n_tok": [per, per]},
                tok={
                    "input_ids": torch.arange(2 * per) % 500,
                    "positions": torch.cat([pos, pos]),
                    "aux_hidden": aux[rows],
                },
                column_attrs={"tok/aux_hidden": {"layer_ids": [1, 3], "slot_width": 32}},
            )
            topk = torch.randint(-1, 256, (2 * per, 4), generator=torch.Generator().manual_seed(s))
            w.write(
                "draft_extend",
                req={"req_key": keys, "n_tok": [per, per]},
                tok={
                    "input_ids": torch.arange(1, 2 * per + 1) % 500,
                    "positions": torch.cat([pos, pos]),
                    "hidden_in": aux[rows],
                    "topk_draft_ids": topk,
                    "topk_target_ids": topk,
                    "topk_logprobs": odd_float32(2 * per * 4).reshape(2 * per, 4),
                    "lse": odd_float32(2 * per),
                },
            )
            if s:
                w.write(
                    "verify",
                    req={
                        "req_key": keys,
                        "accept_len": [s - 1, 0],
                        "bonus_id": [7, 8],
                        "n_proposed": [3, 3],
                        "n_accepted": [s - 1, 0],
                    },
                    proposed={"ids": np.arange(6)},
                    accepted={"ids": np.arange(s - 1, dtype=np.int64)},
                )
    return path


def zip_store(src: Path, dst: Path) -> Path:
    """A trace directory zipped as docs/trace-format.md says: keys at the root, stored."""
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zf:
        for p in sorted(src.rglob("*")):
            if p.is_file():
                zf.write(p, p.relative_to(src).as_posix())
    return dst


def produce(path: Path, **writer_kw) -> ProducedTrace:
    with record_writes() as log:
        write_bit_patterns(path, **writer_kw)
    return ProducedTrace(path, written=log.only())


class TestInProcessWriter(StoreConformance):
    def make_trace(self, tmp_path):
        return produce(tmp_path / "inproc.zarr", process=False)


class TestWriterProcess(StoreConformance):
    def make_trace(self, tmp_path):
        return produce(tmp_path / "proc.zarr", process=True)


class TestZipOfADirectoryStore(StoreConformance):
    def make_trace(self, tmp_path):
        made = produce(tmp_path / "src.zarr", process=False)
        return ProducedTrace(zip_store(made.path, tmp_path / "trace.zip"), made.written)


class _Tee(Sink):
    """Every step to the store (the in-process RecorderSink) and to a MemorySink."""

    def __init__(self, path: Path) -> None:
        self.store, self.memory = RecorderSink(str(path), 0), MemorySink()
        self.stats = self.store.stats

    def write_step(self, plan, arrays, counts, host, may_drop):
        self.memory.write_step(plan, arrays, counts, host, may_drop)
        return self.store.write_step(plan, arrays, counts, host, may_drop)

    def control(self, msg):
        self.memory.control(msg)
        self.store.control(msg)

    def flush(self, dropped):
        self.memory.flush(dropped)
        self.store.flush(dropped)

    def close(self, dropped):
        self.memory.close(dropped)
        self.store.close(dropped)


def written_by(sink: MemorySink, rank: int = 0) -> dict:
    """What a MemorySink took, in `ProducedTrace.written`'s form (bf16 as int16 bits)."""
    out: dict[str, list] = {}
    for table, t in sink.tables.items():
        spec = t["spec"]
        out[table] = [
            {
                axis: {
                    c: (
                        spec[axis][c][1],
                        rows.view(np.int16) if spec[axis][c][1] == "bfloat16" else rows,
                    )
                    for c, rows in cols.items()
                }
                for axis, cols in step.items()
            }
            for step in t["steps"]
        ]
    return {rank: out}


class TestMemorySinkTee(StoreConformance):
    """The store holds exactly what the writer handed its sink: the round trip is checked
    against a MemorySink beside the store (seq and t_ns, filled in by the writer, included)."""

    def make_trace(self, tmp_path):
        path = tmp_path / "tee.zarr"
        sinks = []

        def tee(p):
            sinks.append(_Tee(p))
            return sinks[-1]

        write_bit_patterns(path, make_sink=tee)
        memory = sinks[0].memory
        assert memory.closed and sum(len(t["steps"]) for t in memory.tables.values()) == 13
        return ProducedTrace(path, written=written_by(memory))


class TestDemoDirectoryStore(StoreConformance):
    """The trace the bundle, diff and report tests share: every v1 table, chains of drafts."""

    def make_trace(self, tmp_path):
        with record_writes() as log:
            path = write_demo_trace(tmp_path / "demo.zarr", rounds=3)
        return ProducedTrace(path, written=log.only())


class TestBundleSubset(StoreConformance):
    """`hstrace bundle --steps 1:3`: a subset written by the bundle's own writer, zipped with
    its manifest beside the store's keys."""

    def make_trace(self, tmp_path):
        src = write_demo_trace(tmp_path / "demo.zarr", rounds=4)
        with record_writes() as log:  # only the subset's writer writes in here
            res = make_bundle(src, tmp_path / "bundle.zip", BundleOptions(steps="1:3"))
        assert res.engine_steps[0] == [1, 2]
        return ProducedTrace(res.path, written=log.only())


# --- the suite fails on producers that get the format wrong ---------------------------------


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> ProducedTrace:
    return produce(tmp_path_factory.mktemp("good") / "good.zarr", process=False)


def _broken(good: ProducedTrace, tmp_path: Path) -> Path:
    copy = tmp_path / "broken.zarr"
    shutil.copytree(good.path, copy)
    return copy


def test_decreasing_offsets_fail_the_suite(good, tmp_path):
    path = _broken(good, tmp_path)
    off = zarr.open_array(str(path / "rank0" / "target" / "offsets"), mode="r+")
    rows = np.asarray(off[:])
    tok = off.attrs["axes"].index("tok")
    rows[2, tok] = rows[1, tok] - 1  # step 1 ends before it starts
    off[:] = rows
    with pytest.raises(ConformanceError, match=r"rank0/target: offsets of axis tok decrease at"):
        check_offsets(path)


def test_counts_that_disagree_with_the_offsets_fail_the_suite(good, tmp_path):
    path = _broken(good, tmp_path)
    n_tok = zarr.open_array(str(path / "rank0" / "draft_extend" / "req.n_tok"), mode="r+")
    n_tok[3] = int(n_tok[3]) + 1  # step 1's second request claims a row it has not
    with pytest.raises(ConformanceError, match=r"draft_extend: step 1: req/n_tok sums to 257"):
        check_offsets(path)


def test_a_changed_bf16_bit_fails_the_round_trip_but_not_plain_zarr(good, tmp_path):
    """Plain zarr and hstrace read the same (wrong) bits; only the round trip against what
    the producer wrote sees the lost bit, and names the step, column and row."""
    path = _broken(good, tmp_path)
    aux = zarr.open_array(str(path / "rank0" / "target" / "tok.aux_hidden"), mode="r+")
    row = int(aux.shape[0]) - 5  # in the last step
    value = np.asarray(aux[row])
    value[3] ^= 1
    aux[row] = value
    check_plain_zarr(path)
    with pytest.raises(ConformanceError, match=r"step 3 tok/aux_hidden: .* index \[251, 3\]"):
        check_round_trip(path, good.written)


def test_a_missing_root_attribute_fails_the_schema(good, tmp_path):
    path = _broken(good, tmp_path)
    meta = json.loads((path / "zarr.json").read_text())
    del meta["attributes"]["hstrace"]["created"]
    (path / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(ConformanceError, match="root created is not a str"):
        check_schema(path)


def test_capacity_left_after_a_clean_close_fails_the_prefix_check(good, tmp_path):
    path = _broken(good, tmp_path)
    lse = zarr.open_array(str(path / "rank0" / "draft_extend" / "tok.lse"), mode="r+")
    lse.resize((lse.shape[0] + 100,))
    check_committed_prefix(path, clean_close=False)  # as capacity it is allowed
    with pytest.raises(ConformanceError, match=r"draft_extend/tok/lse: shape 1124 after a clean"):
        check_committed_prefix(path, clean_close=True)


def test_a_reader_that_ignored_a_cut_chunk_would_fail_the_suite(good, tmp_path, monkeypatch):
    """The corrupt-chunk check itself can fail: with the reader's read made to return zeros
    instead of raising, the cut chunk goes unnoticed and the check says so. (Only a read that
    fails reads as zeros: the offsets and `step/seq`, which the reader checks at open, are
    read as they are, so what goes unnoticed is the cut chunk itself.)"""
    from hstrace.errors import TraceError
    from hstrace.trace import reader

    read = reader.TableView._read

    def zeros(self, arr, start, stop, what):
        try:
            return read(self, arr, start, stop, what)
        except TraceError:
            return np.zeros((stop - start, *arr.shape[1:]), arr.dtype)

    monkeypatch.setattr(reader.TableView, "_read", zeros)
    with pytest.raises(ConformanceError, match="cut short, and every column still read"):
        check_corrupt_chunk(good.path, tmp_path / "work")


def test_a_subclass_of_a_broken_producer_fails_under_pytest(pytester):
    """Out of tree, as a producer would run it: a subclass whose trace has a count that does
    not match its offsets fails the CSR test and passes the others it does not touch."""
    pytester.makepyfile(
        test_broken_producer="""
        import zarr
        from hstrace.testing import ProducedTrace, StoreConformance
        from hstrace.trace import TraceWriter, create_trace

        class TestBroken(StoreConformance):
            def make_trace(self, tmp_path):
                path = tmp_path / "t.zarr"
                create_trace(path, engine={"name": "broken", "version": "0"}, command_line=[])
                with TraceWriter(path, process=False) as w:
                    for _ in range(3):
                        w.write("target", step={"mode": 0}, req={"req_key": [1], "n_tok": [2]},
                                tok={"input_ids": [5, 6]})
                n = zarr.open_array(str(path / "rank0/target/req.n_tok"), mode="r+")
                n[1] = 3  # the producer's bug: a count that is not its rows
                return ProducedTrace(path)
        """
    )
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) >= 1 and outcomes.get("passed", 0) >= 3, outcomes
    result.stdout.fnmatch_lines(["*FAILED*test_offsets_are_consistent_csr*"])
    result.stdout.fnmatch_lines(["*req/n_tok sums to 3, the offsets give 2 tok rows*"])
