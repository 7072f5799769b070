"""`hstrace show`: the numbers match what the reader returns, in rich and --json form."""

from __future__ import annotations

import json

import numpy as np
import torch
from helpers.cli import REPO, Ran, run_main

from hstrace.trace import TraceWriter, create_trace, open_trace

EXAMPLE = REPO / "traces" / "example.zarr"
KEYS = {
    "path",
    "schema_version",
    "hstrace_version",
    "engine",
    "created",
    "host",
    "command_line",
    "ranks",
    "clean_close",
    "steps",
    "requests",
    "request_list",
    "tokens",
    "draft_rows",
    "acceptance",
    "dropped_steps",
    "tap_errors",
    "per_rank",
}


def show(*args: str) -> Ran:
    """In-process (the exit-code contract of `show` is tested through a subprocess in
    test_cli.py and test_trace_errors.py)."""
    return run_main("show", *args)


def test_show_example_json_matches_the_reader():
    out = show(str(EXAMPLE), "--json")
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert set(s) == KEYS
    with open_trace(EXAMPLE) as tr:
        r = tr.rank(0)
        target, verify = r.table("target"), r.table("verify")
        assert s["schema_version"] == 1 and s["engine"]["name"] == "synthetic"
        assert s["ranks"] == [0] and s["clean_close"] is True
        assert s["steps"] == {name: r.table(name).num_steps for name in r.tables}
        mode = target.column("step", "mode")
        per_step = np.diff(target.offsets("tok"))
        assert s["tokens"] == {
            "total": int(per_step.sum()),
            "prefill": int(per_step[mode == 0].sum()),
            "verify": int(per_step[mode == 1].sum()),
        }
        assert s["draft_rows"]["draft_step"] == r.table("draft_step").num_rows("tok")
        assert s["requests"] == len(np.unique(r.table("requests").column("req", "req_key")))
        req = r.table("requests")
        rid_bytes = bytes(np.asarray(req.column("rid", "bytes"), dtype=np.uint8))
        assert "".join(e["rid"] for e in s["request_list"]) == rid_bytes.decode()
        assert [e["n_prompt"] for e in s["request_list"]] == req.column("req", "n_prompt").tolist()
        al = verify.column("req", "accept_len")
        acc = s["acceptance"]
        assert acc["verify_rows"] == al.size
        assert abs(acc["mean_accept_len"] - al.mean()) < 1e-6
        assert abs(acc["mean_accept_len_incl_bonus"] - (al.mean() + 1)) < 1e-6
        assert sum(acc["histogram"].values()) == al.size
        assert acc["rate_by_position"][0] == round(float((al > 0).mean()), 6)
        assert "excluding the bonus" in acc["convention"]
        assert s["dropped_steps"] == {"total": 0}


def test_show_example_table():
    out = show(str(EXAMPLE))
    assert out.returncode == 0, out.stderr
    for word in (
        "synthetic",
        "closed cleanly",
        "mean accept length",
        "including it",
        "dropped steps",
    ):
        assert word in out.stdout


def test_show_reports_unclean_close_dropped_steps_and_tap_errors(tmp_path):
    path = tmp_path / "t.zarr"
    create_trace(path, engine={"name": "test", "version": "9"})
    w = TraceWriter(path, rank=0, process=False)
    w.write(
        "target",
        step={"mode": 0},
        req={"req_key": torch.tensor([1]), "n_tok": torch.tensor([4])},
        tok={"input_ids": torch.arange(4, dtype=torch.int32)},
    )
    w.note_error("draft-tap", "KeyError: boom")
    w.dropped = {"target": 3}  # as if 3 steps had found the staging ring full
    w.flush()  # committed but never closed, like a server that died
    s = json.loads(show(str(path), "--json").stdout)
    assert s["clean_close"] is False
    assert s["dropped_steps"] == {"target": 3, "total": 3}
    assert s["tap_errors"] == [{"rank": 0, "tap": "draft-tap", "message": "KeyError: boom"}]
    assert s["tokens"]["total"] == 4 and s["acceptance"]["mean_accept_len"] is None
    text = show(str(path)).stdout
    assert "no" in text and "draft-tap" in text
