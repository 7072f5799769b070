"""The trace store round-trips every stream exactly, through both writer modes."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from hstrace.errors import TraceError
from hstrace.trace import TraceWriter, create_trace, open_trace, request_key


def _same(a, b) -> bool:
    """Bitwise equality for torch (bf16 compared as int16 bits) and numpy arrays."""
    if isinstance(a, torch.Tensor):
        a = a.view(torch.int16).numpy() if a.dtype == torch.bfloat16 else a.numpy()
    if isinstance(b, torch.Tensor):
        b = b.view(torch.int16).numpy() if b.dtype == torch.bfloat16 else b.numpy()
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def _events(seed: int = 0) -> list[tuple[str, dict]]:
    """A deterministic run touching every table of schema v1 and every column kind."""
    g = torch.Generator().manual_seed(seed)
    ev: list[tuple[str, dict]] = []
    keys = torch.tensor([request_key("a"), request_key("b")], dtype=torch.int64)
    ev.append(
        (
            "requests",
            dict(
                req={
                    "req_key": keys[:1],
                    "n_prompt": torch.tensor([5]),
                    "rid_len": torch.tensor([1]),
                },
                tok={"prompt_ids": torch.arange(5, dtype=torch.int32)},
                rid={"bytes": torch.tensor([97], dtype=torch.uint8)},
            ),
        )
    )
    for s in range(12):
        n = torch.randint(1, 17, (2,), generator=g)
        if s == 3:
            n = torch.tensor([2500, 700])  # a prefill of thousands of tokens between decodes
        t = int(n.sum())
        ev.append(
            (
                "target",
                dict(
                    step={"mode": int(s % 2)},
                    req={"req_key": keys, "n_tok": n},
                    tok={
                        "input_ids": torch.randint(
                            0, 1000, (t,), generator=g, dtype=torch.int64
                        ).to(torch.int32),
                        "positions": torch.arange(t, dtype=torch.int32),
                        "aux_hidden": torch.randn(t, 3 * 32, generator=g).to(torch.bfloat16),
                    },
                ),
            )
        )
        for name, width in (("draft_extend", 96), ("draft_step", 32)):
            step = {"step_index": s % 3} if name == "draft_step" else {}
            logits = torch.randn(t, 50, generator=g)
            lp, ids = torch.log_softmax(logits, -1).topk(4, -1)
            ev.append(
                (
                    name,
                    dict(
                        step=step,
                        req={"req_key": keys, "n_tok": n},
                        tok={
                            "input_ids": torch.arange(t, dtype=torch.int32),
                            "positions": torch.arange(t, dtype=torch.int32),
                            "hidden_in": torch.randn(t, width, generator=g).to(torch.bfloat16),
                            "topk_draft_ids": ids.to(torch.int32),
                            "topk_target_ids": (ids + 7).to(torch.int32),
                            "topk_logprobs": lp,
                            "lse": torch.logsumexp(logits, -1),
                            "logits": logits.to(torch.bfloat16),
                        },
                    ),
                )
            )
        acc = torch.randint(0, 4, (2,), generator=g)
        prop = torch.randint(0, 1000, (6,), generator=g)
        ev.append(
            (
                "verify",
                dict(
                    req={
                        "req_key": keys,
                        "accept_len": acc,
                        "bonus_id": torch.tensor([1, 2]),
                        "n_proposed": torch.tensor([3, 3]),
                        "n_accepted": acc,
                    },
                    proposed={"ids": prop},
                    accepted={"ids": torch.cat([prop[: int(acc[0])], prop[3 : 3 + int(acc[1])]])},
                ),
            )
        )
    return ev


@pytest.mark.parametrize("process", [False, True], ids=["in-process", "writer-process"])
def test_every_stream_round_trips(tmp_path, process):
    path = tmp_path / "t.zarr"
    create_trace(
        path, engine={"name": "test", "version": "1"}, command_line=["pytest"], static={"root": 1}
    )
    events = _events()
    # Small parts so that the 3200-token prefill is split into several staging parts.
    with TraceWriter(
        path, rank=0, process=process, staging_bytes=2 << 20, max_part_bytes=256 << 10
    ) as w:
        for table, axes in events:
            assert w.write(table, **axes)
        w.update_static({"drafter": {"hash": "abc"}})
        w.note_error("some-tap", "disabled: boom")
    with open_trace(path) as tr:
        assert tr.ranks == [0]
        r = tr.rank(0)
        assert r.clean_close and r.dropped_steps == {} and r.errors[0]["tap"] == "some-tap"
        assert tr.meta["static"] == {"root": 1, "drafter": {"hash": "abc"}}
        assert (
            tr.meta["engine"] == {"name": "test", "version": "1"} and tr.meta["schema_version"] == 1
        )
        assert sorted(r.tables) == ["draft_extend", "draft_step", "requests", "target", "verify"]
        per_table: dict[str, int] = {}
        seqs = []
        for i, (table, axes) in enumerate(events):
            t = r.table(table)
            s = per_table.get(table, 0)
            per_table[table] = s + 1
            got = t.step(s)
            seqs.append((int(got["step"]["seq"][0]), i))
            for axis, cols in axes.items():
                for col, want in cols.items():
                    want = torch.as_tensor(want)
                    if axis == "step":
                        want = want.reshape(1)
                    assert _same(got[axis][col], want), f"{table} step {s} {axis}/{col}"
        assert all(seq == i for seq, i in seqs)  # seq orders events across tables
        for table, n in per_table.items():
            assert r.table(table).num_steps == n


def test_all_bf16_bit_patterns_come_back_exact(tmp_path):
    path = tmp_path / "bf16.zarr"
    create_trace(path, engine={"name": "test"})
    bits = np.arange(65536, dtype=np.uint16).view(np.int16).reshape(256, 256)
    h = torch.from_numpy(bits.copy()).view(torch.bfloat16)
    with TraceWriter(path, rank=0, max_part_bytes=64 << 10) as w:  # also split into parts
        w.write(
            "target",
            step={"mode": 0},
            req={"req_key": torch.tensor([1]), "n_tok": torch.tensor([256])},
            tok={
                "input_ids": torch.zeros(256, dtype=torch.int32),
                "positions": torch.zeros(256, dtype=torch.int32),
                "aux_hidden": h,
            },
        )
    with open_trace(path) as tr:
        t = tr.rank(0).table("target")
        got = t.column("tok", "aux_hidden")
        assert got.dtype == torch.bfloat16
        assert np.array_equal(got.view(torch.int16).numpy(), bits)
        assert t.column_attrs("tok", "aux_hidden")["hstrace_dtype"] == "bfloat16"
        assert str(t._arrays[("tok", "aux_hidden")].dtype) == "uint16"  # what plain zarr sees


def test_column_attrs_and_plain_zarr_layout(tmp_path):
    import zarr

    path = tmp_path / "a.zarr"
    create_trace(path, engine={"name": "test"})
    with TraceWriter(path, rank=3, process=False) as w:
        for n in (5, 1, 16):
            w.write(
                "target",
                step={"mode": 1},
                req={"req_key": torch.tensor([7]), "n_tok": torch.tensor([n])},
                tok={
                    "input_ids": torch.arange(n, dtype=torch.int32),
                    "positions": torch.arange(n, dtype=torch.int32),
                    "aux_hidden": torch.ones(n, 6, dtype=torch.bfloat16),
                },
                column_attrs={"tok/aux_hidden": {"layer_ids": [1, 2, 3], "slot_width": 2}},
            )
    with open_trace(path) as tr:
        t = tr.rank(3).table("target")
        assert t.column_attrs("tok", "aux_hidden")["layer_ids"] == [1, 2, 3]
        assert list(t.offsets("tok")) == [0, 5, 6, 22]
    # A reader with only zarr: offsets + flat arrays, exact shapes after a clean close.
    g = zarr.open_group(str(path), mode="r")
    assert g.attrs["hstrace"]["schema_version"] == 1
    off = g["rank3/target/offsets"]
    assert off.attrs["axes"] == ["req", "tok"]
    assert off[:].tolist() == [[0, 0], [1, 5], [2, 6], [3, 22]]
    assert g["rank3/target/tok.aux_hidden"].shape == (22, 6)
    # Flat: a table group holds arrays only (no per-axis subgroups), one offsets array.
    assert [k for k, _ in g["rank3/target"].groups()] == []
    assert sorted(k for k, _ in g["rank3/target"].arrays()) == [
        "offsets",
        "req.n_tok",
        "req.req_key",
        "step.mode",
        "step.seq",
        "step.t_ns",
        "tok.aux_hidden",
        "tok.input_ids",
        "tok.positions",
    ]
    assert g["rank3"].attrs["hstrace"]["commit"]["tables"]["target"]["steps"] == 3


def test_first_write_fixes_columns(tmp_path):
    path = tmp_path / "c.zarr"
    create_trace(path, engine={"name": "test"})
    with TraceWriter(path, rank=0, process=False) as w:
        w.write(
            "target",
            step={"mode": 0},
            req={"req_key": torch.tensor([1]), "n_tok": torch.tensor([2])},
            tok={"input_ids": torch.zeros(2, dtype=torch.int32)},
        )
        with pytest.raises(TraceError, match="differ from the first write"):
            w.write(
                "target",
                step={"mode": 0},
                req={"req_key": torch.tensor([1]), "n_tok": torch.tensor([2])},
                tok={"input_ids": torch.zeros(2, dtype=torch.int64)},
            )
        with pytest.raises(TraceError, match="different row counts"):
            w.write(
                "target",
                step={"mode": 0},
                req={"req_key": torch.tensor([1, 2]), "n_tok": torch.tensor([2])},
                tok={"input_ids": torch.zeros(2, dtype=torch.int32)},
            )
        with pytest.raises(TraceError, match="no axis"):
            w.write("verify", req={"req_key": torch.tensor([1])}, tok={"x": torch.zeros(1)})


def test_rank_records_once_and_root_must_exist(tmp_path):
    with pytest.raises(TraceError, match="create_trace"):
        TraceWriter(tmp_path / "missing.zarr", rank=0, process=False)
    path = tmp_path / "d.zarr"
    create_trace(path, engine={"name": "test"})
    TraceWriter(path, rank=0, process=False).close()
    with pytest.raises(TraceError, match="already exists"):
        TraceWriter(path, rank=0)  # the writer process reports it; no traceback, no hang
    with pytest.raises(TraceError, match="already exists"):
        create_trace(path, engine={"name": "test"})


def test_drop_policy_counts_dropped_steps(tmp_path):
    path = tmp_path / "drop.zarr"
    create_trace(path, engine={"name": "test"})
    n_written = 300
    with TraceWriter(path, rank=0, on_full="drop", staging_bytes=1 << 20) as w:
        # The writer stopped while the burst comes: the 1 MiB ring fills after a few 256 KiB
        # steps and the rest must be dropped, however fast this host's writer is.
        os.kill(w.writer_pid, signal.SIGSTOP)
        try:
            kept = [
                w.write(
                    "target",
                    step={"mode": 0},
                    req={"req_key": torch.tensor([1]), "n_tok": torch.tensor([64])},
                    tok={"aux_hidden": torch.full((64, 2048), i, dtype=torch.bfloat16)},
                )
                for i in range(n_written)
            ]
        finally:
            os.kill(w.writer_pid, signal.SIGCONT)
    with open_trace(path) as tr:
        r = tr.rank(0)
        t = r.table("target")
        assert r.dropped_steps.get("target", 0) == kept.count(False) > 0
        assert t.num_steps == kept.count(True)
        seq = t.column("step", "seq")
        assert list(seq) == [
            i for i, k in enumerate(kept) if k
        ]  # the steps that were kept, in order
        first = t.step(t.num_steps - 1)["tok"]["aux_hidden"]
        assert float(first[0, 0]) == float(torch.tensor(seq[-1], dtype=torch.bfloat16))


def test_request_key_is_stable_63_bit():
    k = request_key("req-0001")
    assert k == request_key("req-0001") and 0 <= k < 2**63
    assert k != request_key("req-0002")
    # Pinned: traces written by other processes / versions must map rids to the same keys.
    assert k == 3041315713766516325
    assert request_key("abc") == 6455300059550759896


def test_fast_path_mixed_inputs_round_trip_and_keep_errors(tmp_path):
    """After a table's first write, steps take the per-table copy plan (one memmove per
    column, one pipe message); anything it does not cover falls back to the generic path.
    Every variant must come back bit-exact and in order, and bad writes still raise."""
    path = tmp_path / "fast.zarr"
    create_trace(path, engine={"name": "test"})
    g = torch.Generator().manual_seed(3)
    want = []

    def step(i: int, n: int, kind: str) -> dict:
        aux = torch.randn(n, 24, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32)
        want.append((i % 2, ids.clone(), aux.clone()))
        if kind == "numpy":
            ids = ids.numpy()
        elif kind == "strided":
            ids = torch.stack([ids, ids], 1)[:, 0]  # not contiguous
        elif kind == "grad":
            aux = aux.float().requires_grad_().to(torch.bfloat16)
        return {
            "step": {"mode": i % 2 if kind != "tensor" else torch.tensor(i % 2)},
            "req": {"req_key": torch.tensor([i]), "n_tok": torch.tensor([n])},
            "tok": {"input_ids": ids, "aux_hidden": aux},
        }

    kinds = ["scalar", "tensor", "numpy", "strided", "grad", "empty", "big"] * 3
    with TraceWriter(path, rank=0, max_part_bytes=64 << 10) as w:
        for i, kind in enumerate(kinds):
            n = {"empty": 0, "big": 3000}.get(kind, 1 + i % 7)  # "big" splits into parts
            assert w.write("target", **step(i, n, kind))
        with pytest.raises(TraceError, match="differ from the first write"):
            w.write(
                "target",
                step={"mode": 0},
                req={"req_key": torch.tensor([1]), "n_tok": torch.tensor([2])},
                tok={
                    "input_ids": torch.zeros(2, dtype=torch.int64),
                    "aux_hidden": torch.zeros(2, 24, dtype=torch.bfloat16),
                },
            )
        with pytest.raises(TraceError, match="different row counts"):
            w.write(
                "target",
                step={"mode": 0},
                req={"req_key": torch.tensor([1, 2]), "n_tok": torch.tensor([2])},
                tok={
                    "input_ids": torch.zeros(2, dtype=torch.int32),
                    "aux_hidden": torch.zeros(2, 24, dtype=torch.bfloat16),
                },
            )
    with open_trace(path) as tr:
        t = tr.rank(0).table("target")
        assert t.num_steps == len(kinds)
        assert list(t.column("step", "seq")) == list(range(len(kinds)))
        assert np.all(np.diff(t.column("step", "t_ns")) >= 0)
        for s, (mode, ids, aux) in enumerate(want):
            got = t.step(s)
            assert int(got["step"]["mode"][0]) == mode
            assert list(got["req"]["req_key"]) == [s]
            assert np.array_equal(got["tok"]["input_ids"], ids.numpy())
            assert torch.equal(got["tok"]["aux_hidden"].view(torch.int16), aux.view(torch.int16))


def _doc_snippet() -> str:
    """The "Reading with plain zarr" code block of docs/trace-format.md, verbatim."""
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "trace-format.md").read_text()
    section = doc.split("## Reading with plain zarr", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_plain_zarr_snippet_of_the_docs_reads_a_step(tmp_path, monkeypatch):
    """The documented plain-zarr reader, run as written (cwd holds its "run.zarr"), finds step
    5's tokens and mode exactly as the hstrace reader does."""
    monkeypatch.chdir(tmp_path)
    create_trace("run.zarr", engine={"name": "test"})
    with TraceWriter("run.zarr", rank=0, process=False) as w:
        for s in range(8):
            n = 1 + (s * 5) % 7
            w.write(
                "target",
                step={"mode": s % 2},
                req={"req_key": torch.tensor([s]), "n_tok": torch.tensor([n])},
                tok={
                    "input_ids": torch.arange(n, dtype=torch.int32) + s,
                    "positions": torch.arange(n, dtype=torch.int32),
                    "aux_hidden": torch.randn(n, 6).to(torch.bfloat16),
                },
            )
    scope: dict = {}
    exec(compile(_doc_snippet(), "docs/trace-format.md", "exec"), scope)
    with open_trace("run.zarr") as tr:
        want = tr.rank(0).table("target").step(5)
        S = tr.rank(0).table("target").num_steps
    assert scope["S"] == S == 8
    assert scope["mode"] == want["step"]["mode"][0] == 1
    assert np.array_equal(scope["aux_bits"], want["tok"]["aux_hidden"].view(torch.uint16).numpy())
    assert scope["aux_bits"].shape == (1 + 25 % 7, 6)


@pytest.mark.parametrize("raw", [False, True], ids=["compressed", "stored-raw-while-behind"])
def test_wide_column_files_read_by_plain_zarr_and_by_the_fast_reader(
    tmp_path, raw, monkeypatch, saturated_encoders
):
    """The writer encodes chunks and shards itself (not through zarr): plain zarr decodes
    them, hstrace's own reader (chunkread) reads any row range of them, bit for bit, and
    chunks stored uncompressed while the writer was behind are counted in the commit record."""
    import zarr

    from hstrace.trace import chunkread
    from hstrace.trace.write import rowlog

    path = tmp_path / "wide.zarr"
    create_trace(path, engine={"name": "test"})
    g = torch.Generator().manual_seed(5)
    rows = []
    # No disk budget here: every chunk goes raw while behind (the budget: tests/test_rowlog.py).
    monkeypatch.setattr(rowlog, "DISK_BUDGET", 2.0)
    rowlog.configure(1, raw_when_behind=raw)
    rowlog.set_behind(raw)
    try:
        w = TraceWriter(path, process=False, tail_flush_s=0.05)
        for s in range(9):
            n = 300 if s == 4 else 100
            x = torch.randn(n, 8192, generator=g).to(torch.bfloat16)  # 16 KiB rows: sharded
            rows.append(x)
            w.write(
                "target",
                step={"mode": 0},
                req={"req_key": torch.tensor([s]), "n_tok": torch.tensor([n])},
                tok={"input_ids": torch.arange(n, dtype=torch.int32), "aux_hidden": x},
            )
            if s == 2:
                w.flush()  # a tail flush inside an unfinished shard, later completed
        w.close()
    finally:
        rowlog.configure(0, raw_when_behind=False)
        rowlog.set_behind(False)
    want = torch.cat(rows)
    arr = zarr.open_array(str(path / "rank0/target/tok.aux_hidden"), mode="r")
    assert arr.shards is not None and arr.shards[0] > arr.chunks[0]  # the layout under test
    assert np.array_equal(arr[:], want.view(torch.uint16).numpy())  # plain zarr decodes it
    with open_trace(path) as tr:
        t = tr.rank(0).table("target")
        assert chunkread.layout_of(t._arrays[("tok", "aux_hidden")]) is not None
        assert _same(t.column("tok", "aux_hidden"), want)
        assert _same(t.column("tok", "aux_hidden", 250, 630), want[250:630])  # partial chunks
        assert _same(t.column("tok", "input_ids")[100:200], torch.arange(100, dtype=torch.int32))
        entry = tr.rank(0).meta["commit"]["tables"]["target"]
    counted = entry.get("uncompressed_chunks", {})
    if raw:
        assert counted.get("tok/aux_hidden", 0) >= 3, entry  # the full inner chunks, at least
    else:
        assert counted == {}, entry
