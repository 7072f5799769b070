"""The third-party producer example of docs/trace-format.md runs, and replay's reader sees in
its trace what the doc says: the cached prefix by its absence (true positions, `n_cached`),
one target step per prefill chunk, the batch composition per step."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from hstrace.replay.read import accept_len_by_rank, read_serving
from hstrace.testing import ProducedTrace, StoreConformance, record_writes
from hstrace.trace import TraceWriter, open_trace, request_key, summarize

DOC = Path(__file__).resolve().parent.parent / "docs" / "trace-format.md"


def _example() -> str:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("### A writer call for every table", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


class TestDocExampleStore(StoreConformance):
    """The doc's producer passes the store conformance suite (hstrace.testing), the way the
    doc tells a third party to check its own."""

    def make_trace(self, tmp_path):
        path = tmp_path / "third-party.zarr"
        with record_writes() as log:
            exec(compile(_example(), str(DOC), "exec"), {"path": path})  # noqa: S102
        return ProducedTrace(path, written=log.only())


def test_doc_example_writes_a_trace_replay_reads(tmp_path):
    path = tmp_path / "third-party.zarr"
    exec(compile(_example(), str(DOC), "exec"), {"path": path})  # noqa: S102 - our own doc
    with open_trace(path) as tr:
        assert tr.rank(0).clean_close
        show = summarize(tr)
        serving = read_serving(tr)
    assert show["steps"] == {
        "requests": 2,
        "target": 3,
        "draft_extend": 2,
        "draft_step": 2,
        "verify": 1,
    }
    by = {r.name: r for r in serving.requests}
    a, b = by["req-a"], by["req-b"]
    # The cache hit: rows from position 8 on, the cached ids from the prompt, n_cached read.
    assert (b.aux_start, b.n_cached, b.aux_rows) == (8, 8, 4)
    assert b.tokens.tolist() == [*range(2, 10), 30, 31, 32, 33]
    assert b.draft.index.tolist() == [8, 9, 10, 11]
    assert b.draft.positions.tolist() == [8, 9, 10, 11]
    # Chunked prefill: two mode-0 blocks, the seam at position 7 fed the next prompt token.
    assert a.prefill_chunks == [(0, 8), (8, 12)] and a.seams == [7]
    assert int(a.draft.input_ids[7]) == int(a.tokens[8])
    # Verify: the first 1 + accept_len rows are committed.
    assert a.aux_rows == 12 + 3 and a.tokens[12:].tolist() == [7, 51, 52]
    assert len(a.chains) == 1 and a.chains[0].step_index.tolist() == [1, 2]
    # The batch composition of every step.
    ka, kb = request_key("req-a"), request_key("req-b")
    assert serving.target_batches == [[ka, kb], [ka], [ka]]
    assert serving.draft_batches == [[ka, kb], [ka]]
    assert serving.accept_by_key == {ka: [2]}
    assert np.asarray(b.draft.topk_draft_ids).shape == (4, 8)


def test_accept_len_by_rank(tmp_path):
    """A DP rank with its own writer: acceptance per rank, beside rank 0's replay."""
    path = tmp_path / "two-ranks.zarr"
    exec(compile(_example(), str(DOC), "exec"), {"path": path})  # noqa: S102 - our own doc
    with TraceWriter(path, rank=1, process=False) as w:
        for accept in (0, 0, 1):
            w.write(
                "verify",
                req={
                    "req_key": [request_key("req-c")],
                    "accept_len": [accept],
                    "bonus_id": [5],
                    "n_proposed": [3],
                    "n_accepted": [accept],
                },
                proposed={"ids": np.array([1, 2, 3])},
                accepted={"ids": np.array([1][:accept], dtype=np.int64)},
            )
    with open_trace(path) as tr:
        assert accept_len_by_rank(tr) == {
            "0": {"verify_rows": 1, "mean_accept_len": 2.0},
            "1": {"verify_rows": 3, "mean_accept_len": 0.3333},
        }
