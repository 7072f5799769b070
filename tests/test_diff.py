"""`hstrace diff`: alignment by prompt ids, first difference in dataflow order, tolerances."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.cli import assert_one_line_error, run_cli, run_main
from helpers.demo_trace import copy_trace, write_demo_trace

from hstrace.bundle import BundleOptions, make_bundle
from hstrace.diff import diff_traces
from hstrace.trace import open_trace


@pytest.fixture(scope="module")
def base(demo_trace):
    return demo_trace(rounds=5)


def test_same_prompts_other_request_ids_are_identical(base, tmp_path):
    other = write_demo_trace(
        tmp_path / "b.zarr", rounds=5, rid_prefix="sglang-xyz", engine="sglang"
    )
    res = diff_traces(open_trace(base), open_trace(other))
    assert res.identical and res.matched == 3 and res.exit_code == 0
    assert (
        all(s.differing_rows == 0 for s in res.streams)
        and sum(s.compared_rows for s in res.streams) > 500
    )


def _nudge(ulps_away: int, rows=slice(0, None)):
    """aux_hidden moved by `ulps_away` bf16 ulps (through the uint16 bit pattern)."""

    def f(table, axis, col, v):
        if table == "target" and col == "aux_hidden":
            bits = v.view(torch.int16).clone()
            bits[rows] += ulps_away
            return bits.view(torch.bfloat16)
        return v

    return f


def test_one_ulp_of_bf16_rounding_is_within_tolerance(base, tmp_path):
    b = copy_trace(base, tmp_path / "ulp.zarr", _nudge(1))
    res = diff_traces(open_trace(base), open_trace(b))
    aux = next(s for s in res.streams if s.stream == "target/tok/aux_hidden")
    assert 0 < aux.max_rel_err <= res.tolerance.rel  # it differs, but rounding explains it
    assert res.identical
    out = run_main("diff", str(base), str(b), "--json")
    assert out.returncode == 0
    doc = json.loads(out.stdout)
    assert doc["identical"] and doc["tolerance"]["compute_dtype"] == "bfloat16"
    assert "ulp" in doc["tolerance"]["rule"]


def test_beyond_rounding_is_a_difference_in_target_aux_hidden(base, tmp_path):
    b = copy_trace(base, tmp_path / "far.zarr", _nudge(40, rows=slice(2, 3)))
    res = diff_traces(open_trace(base), open_trace(b))
    assert not res.identical
    f = res.first
    assert f.stream == "target/tok/aux_hidden" and f.stage == "target aux hidden" and f.round == 0
    assert f.evidence["rel_err"] > res.tolerance.rel
    # a looser tolerance (e.g. for TP2 vs TP1 reductions) accepts it, and says so
    assert diff_traces(open_trace(base), open_trace(b), ulps=1e4).identical


def test_first_difference_is_the_earliest_in_dataflow_order(base, tmp_path):
    # The aux slot layout changes from round 2 on; every later stream diverges as a consequence
    b = write_demo_trace(tmp_path / "shift.zarr", rounds=5, slot_shift_from_round=2)
    res = diff_traces(open_trace(base), open_trace(b))
    assert (res.first.stream, res.first.round) == ("target/tok/aux_hidden", 2)
    # Acceptance differs from round 1: verify/accept of round 1 comes before anything in round 2
    c = write_demo_trace(tmp_path / "acc.zarr", rounds=5, accept_seed=99)
    res = diff_traces(open_trace(base), open_trace(c))
    assert res.first.stage == "verify/accept" and res.first.stream.startswith("verify/req/")
    out = run_main("diff", str(base), str(c))
    assert out.returncode == 1 and "FIRST DIFFERENCE: verify/req/" in out.stdout


def test_draft_difference_is_named_as_draft_topk(base, tmp_path):
    def f(table, axis, col, v):
        if table == "draft_step" and col == "topk_logprobs":
            return v * 1.5
        return v

    b = copy_trace(base, tmp_path / "lp.zarr", f)
    res = diff_traces(open_trace(base), open_trace(b))
    assert res.first.stream == "draft_step/tok/topk_logprobs" and res.first.stage == "draft top-k"


def test_unmatched_prompts_and_bundles(base, tmp_path):
    other = write_demo_trace(tmp_path / "o.zarr", rounds=5, seed=7)
    res = diff_traces(open_trace(base), open_trace(other))
    assert res.first.stage == "prompt ids" and res.matched == 0
    # a bundle of the same trace reads directly and is identical to its source
    z = make_bundle(base, tmp_path / "b.zip", BundleOptions()).path
    out = run_main("diff", str(base), str(z))
    assert out.returncode == 0, out.stdout + out.stderr
    # a bundle with hashed ids no longer aligns with the plain trace, and diff says why
    r = make_bundle(base, tmp_path / "r.zip", BundleOptions(redact=("ids",), salt=b"s" * 16)).path
    res = diff_traces(open_trace(base), open_trace(r))
    assert res.first.stage == "prompt ids" and any("salted hashes" in n for n in res.notes)


def test_bad_input_exits_2(tmp_path, base):
    junk = tmp_path / "junk.zip"
    junk.write_bytes(b"PK\x03\x04 not really a zip")
    for args in (
        [str(base), str(junk)],
        [str(base), str(tmp_path / "missing.zarr")],
        [str(base), str(base), "--rank", "3"],
    ):
        out = run_main("diff", *args)
        assert (
            out.returncode == 2
            and "Traceback" not in out.stderr
            and out.stderr.startswith("hstrace: error:")
        )
    # the same contract through a real interpreter (subprocess)
    assert_one_line_error(run_cli("diff", str(base), str(junk)), "junk.zip")
