"""Field classes (issue 11): prefix caches, chunk seams, batches, simulated acceptance.

Clean traces come from the reference engine with the serving feature on (prefix cache,
chunked prefill, batched steps written by a third-party producer) and must replay as
`no-wiring-fault`. Faults are injected outside the reference engine where possible: a clean
trace is read back, specific rows / requests are corrupted as a faulty engine would, the
drafter's outputs on corrupted inputs are recomputed, and the trace is written again through
the public `TraceWriter` (`tests/helpers/field_producer.py`). Every test asserts the evidence: the
requests, positions and rows named, not only the code.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import field_producer as fp

from hstrace import replay_trace
from hstrace.drafter import load_drafter
from hstrace.engines import EngineConfig, Prompt, RecordOptions, get_engine
from hstrace.reference.target import ReferenceTarget
from hstrace.replay.read import read_serving
from hstrace.trace import open_trace, request_key
from hstrace.training import open_training

WORLD = Path(__file__).resolve().parent.parent / "traces" / "tiny-world"
TARGET = WORLD / "target"
DRAFTER = WORLD / "drafter-speculators"
TRAINING = WORLD / "training-speculators"
HELDOUT = range(40, 44)
NEW_TOKENS = 8

pytestmark = pytest.mark.skipif(not TARGET.is_dir(), reason="tiny world not built")


@pytest.fixture(scope="module")
def ids():
    td = open_training(TRAINING)
    return {i: td[i].input_ids.tolist() for i in HELDOUT}


@pytest.fixture(scope="module")
def heldout_prompts(ids):
    return [Prompt(input_ids=tuple(ids[i][:24]), source_id=f"heldout:{i}") for i in HELDOUT]


@pytest.fixture(scope="module")
def cache_prompts(ids):
    """Two requests per sample: the longer one finds the shorter one's committed sequence in
    the prefix cache (17 and 29 positions cached, counted like SGLang's EAGLE radix cache:
    bigram keys; b-short shares only its first token with a, which caches nothing)."""
    return [
        Prompt(input_ids=tuple(ids[40][:16]), source_id="a-short"),
        Prompt(input_ids=tuple(ids[41][:24]), source_id="b-short"),
        Prompt(input_ids=tuple(ids[40][:28]), source_id="a-long"),
        Prompt(input_ids=tuple(ids[41][:30]), source_id="b-long"),
    ]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("field")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def drafter():
    model, _ = load_drafter(DRAFTER)
    return model.eval()


def record(out: Path, prompts, **knobs) -> Path:
    engine = get_engine("reference", EngineConfig(target=TARGET, drafter=DRAFTER, extra=knobs))
    engine.check_supported()
    res = engine.record(prompts, out, RecordOptions(max_new_tokens=NEW_TOKENS, show_progress=False))
    assert res.ok and res.prompts_completed == len(prompts)
    return out


@pytest.fixture(scope="module")
def clean(work, heldout_prompts):
    return record(work / "clean.zarr", heldout_prompts)


@pytest.fixture(scope="module")
def cached(work, cache_prompts):
    return record(work / "cached.zarr", cache_prompts, prefix_cache=True)


def codes(result) -> list[str]:
    return [f.code for f in result.findings]


def dump(result) -> list[dict]:
    return [f.to_json() for f in result.findings]


# -- 1. prefix caching is the normal case ------------------------------------------------------
def test_cache_hit_trace_replays_clean(cached):
    with open_trace(cached) as tr:
        serving = read_serving(tr)
    by_name = {r.name: r for r in serving.requests}
    # Suffix-only prefill at true positions; the cached prefix comes from the prompt.
    assert {n: r.aux_start for n, r in by_name.items()} == {
        "a-short": 0,
        "b-short": 0,
        "a-long": 17,
        "b-long": 29,
    }
    assert all(r.n_cached == r.aux_start for r in serving.requests)
    assert by_name["a-long"].aux_rows == by_name["a-long"].aux_end - 17
    assert int(by_name["a-long"].draft.positions[0]) == 17
    assert int(by_name["a-long"].draft.index[0]) == 17
    result = replay_trace(cached, TRAINING)
    assert result.verdict.code == "no-wiring-fault", dump(result)
    assert result.exit_code == 0 and not result.faults
    assert "token-shift" not in codes(result) and "target-drift" not in codes(result)
    assert result.coverage["aligned_requests"] == 4
    split = result.metrics["engine_vs_reference_by_cache"]
    assert split["cache_hit"]["requests"] == 2 and split["cache_hit"]["agrees"]
    assert split["fresh"]["requests"] == 2 and split["fresh"]["agrees"]
    assert result.metrics["engine_vs_reference"]["within_noise"]


def test_sglang_shaped_cache_hits_replay_clean(work, cached):
    """The cache-hit trace with SGLang's top-k conventions (top-k on each extend's last row
    only, ids -1 / log-prob -inf elsewhere; NaN log-probs after a verify): still clean."""
    t = fp.read(cached)
    seen: set[int] = set()
    for e in t.of("draft_extend"):
        tok = e.axes["tok"]
        for key, a, b in e.blocks():
            tok["topk_draft_ids"][a : b - 1] = -1
            tok["topk_target_ids"][a : b - 1] = -1
            tok["topk_logprobs"][a : b - 1] = -np.inf
            if key in seen:
                tok["topk_logprobs"][b - 1] = np.nan
            seen.add(key)
    result = replay_trace(fp.write(t, work / "cached-sglang-shape.zarr"), TRAINING)
    assert result.verdict.code == "no-wiring-fault", dump(result)
    evr = result.metrics["engine_vs_reference"]
    assert evr["rows_without_topk"] > 0 and evr["rows_ids_only"] > 0
    assert result.metrics["engine_vs_reference_by_cache"]["cache_hit"]["agrees"]


@pytest.mark.parametrize("redact", [(), ("ids",), ("hidden",)])
def test_cache_hit_bundles_replay_clean(work, cached, redact):
    """A cache-hit trace shared as a bundle (also with ids or hidden states redacted) replays
    clean, and no check fails internally on the cached spans."""
    from hstrace.bundle import BundleOptions, make_bundle

    out = work / f"cached-bundle-{'-'.join(redact) or 'plain'}.zip"
    make_bundle(cached, out, BundleOptions(redact=redact))
    result = replay_trace(out, TRAINING)
    assert result.verdict.code == "no-wiring-fault", dump(result)
    assert not [k for k, v in result.skipped.items() if "failed internally" in v], result.skipped
    if "hidden" not in redact:
        assert result.metrics["engine_vs_reference_by_cache"]["cache_hit"]["agrees"]


@pytest.mark.parametrize(
    ("code", "knobs"),
    [
        ("norm-flag-mismatch", {"norm_flags": {"norm_before_residual": True}}),
        ("aux-layer-shift", {"capture_convention": "output_of_layer"}),
    ],
)
def test_cache_hits_do_not_mask_a_real_fault(work, cache_prompts, code, knobs):
    """With prefix caching on, a wiring fault that hits every request is still named (not
    draft-kv-stale: fresh requests disagree too)."""
    trace = record(work / f"cached-{code}.zarr", cache_prompts, prefix_cache=True, **knobs)
    result = replay_trace(trace, TRAINING)
    assert result.verdict.code == code, dump(result)
    assert "draft-kv-stale" not in codes(result)
    if code == "norm-flag-mismatch":
        assert result.verdict.evidence["what_if"] == "norm_before_residual=True"
    else:
        assert result.verdict.evidence["shift"] == 1


# -- 2. draft-kv-stale --------------------------------------------------------------------------
def _assert_kv_stale(result, stale_requests: set[str]) -> None:
    assert result.verdict.code == "draft-kv-stale", dump(result)
    ev = result.verdict.evidence
    assert ev["fresh"]["agrees"] and ev["fresh"]["requests"] == 2
    assert not ev["cache_hit"]["agrees"]
    named = {r["request"]: r for r in ev["cache_hit_requests"]}
    assert stale_requests <= set(named)
    assert named["a-long"]["n_cached"] == 17 and named["a-long"]["n_cached_recorded"] == 17
    assert named["a-long"]["max_logprob_diff"] > ev["tolerance"]
    assert named["a-long"]["first_disagreeing_position"] >= 17  # only rows after the span
    assert named["a-long"]["cached_span_rebuilt_from"] == "recorded capture of a-short"
    assert named["b-long"]["cached_span_rebuilt_from"] == "recorded capture of b-short"
    fix = result.verdict.fix
    assert "--disable-radix-cache" in fix and "--no-enable-prefix-caching" in fix
    assert "#19897" in fix and "vllm#41838" in fix
    # No misreading of the drafter is claimed for a cache-only fault.
    assert not {"weights-dropped", "norm-flag-mismatch", "rope-mismatch"} & set(codes(result))
    assert result.metrics["whatif"]["ran"] is False


def test_draft_kv_stale_zero_kv(work, cache_prompts):
    """The engine's drafter attends over zero states for every cached span."""
    trace = record(work / "kv-zero.zarr", cache_prompts, prefix_cache=True, draft_kv_stale="zeros")
    result = replay_trace(trace, TRAINING)
    _assert_kv_stale(result, {"a-long", "b-long"})
    assert result.verdict.evidence["what_if_cached_span_zero_top1"] >= 0.9


def test_draft_kv_stale_third_party(work, cached, drafter):
    """A third-party engine whose drafter has no KV for the cached span at all (the cache hit
    dropped it): its draft top-k on the long requests is computed over the suffix alone."""
    t = fp.read(cached)
    for rid in ("a-long", "b-long"):
        fp.redraft(t, request_key(rid), drafter)
    trace = fp.write(t, work / "kv-dropped.zarr")
    result = replay_trace(trace, TRAINING)
    _assert_kv_stale(result, {"a-long", "b-long"})
    assert result.verdict.evidence["cache_hit"]["top1_agreement"] < 0.9


# -- 3. hidden states zero for part of a request -----------------------------------------------
def _zero_rows(t: fp.Trace, key: int, positions: range) -> None:
    for table, col in (("target", "aux_hidden"), ("draft_extend", "hidden_in")):
        for e, a, b in fp.request_rows(t, table, key):
            pos = np.asarray(e.axes["tok"]["positions"][a:b])
            rows = [a + i for i, p in enumerate(pos) if int(p) in positions]
            if table == "target" and e.axes["step"]["mode"] == 1:
                continue  # verify rows are past the zeroed prompt span
            e.axes["tok"][col][rows] = 0


def test_partly_zero_hidden_is_hidden_corrupt(work, clean, drafter):
    t = fp.read(clean)
    key = request_key("heldout:42")
    _zero_rows(t, key, range(0, 8))
    fp.redraft(t, key, drafter)
    result = replay_trace(fp.write(t, work / "zero-part.zarr"), TRAINING)
    assert result.verdict.code == "hidden-corrupt", dump(result)
    assert "target-drift" not in codes(result)
    dead = result.verdict.evidence["dead_rows"]
    assert dead == [
        {
            "request": "heldout:42",
            "positions": [[0, 7]],
            "rows": 8,
            "of_rows": dead[0]["of_rows"],
            "slots": [0, 1, 2],
            "kind": "all-zero",
        }
    ]
    assert dead[0]["of_rows"] > 8


def test_zero_filled_cached_prefix_is_hidden_corrupt(work, cached):
    """A producer that writes zero rows for a cache hit's cached prompt part instead of
    leaving it out (the cached span has no target rows)."""
    t = fp.read(cached)
    key = request_key("a-long")
    e, a, b = fp.request_rows(t, "target", key)[0]  # its (suffix-only) prefill
    assert int(e.axes["tok"]["positions"][a]) == 17 and len(e.blocks()) == 1
    prompt = next(
        np.asarray(r.axes["tok"]["prompt_ids"]) for r in t.of("requests") if r.keys == [key]
    )
    tok = e.axes["tok"]
    width = tok["aux_hidden"].shape[1]
    tok["input_ids"] = np.concatenate([prompt[:17], tok["input_ids"]])
    tok["positions"] = np.concatenate([np.arange(17), tok["positions"]])
    tok["aux_hidden"] = torch.cat([torch.zeros(17, width, dtype=torch.bfloat16), tok["aux_hidden"]])
    e.axes["req"]["n_tok"] = e.axes["req"]["n_tok"] + 17
    result = replay_trace(fp.write(t, work / "zero-prefix.zarr"), TRAINING)
    assert result.verdict.code == "hidden-corrupt", dump(result)
    assert "target-drift" not in codes(result)
    dead = result.verdict.evidence["dead_rows"]
    assert [(d["request"], d["positions"], d["rows"]) for d in dead] == [("a-long", [[0, 16]], 17)]
    assert dead[0]["within_cached_prefix"] is True
    assert "prefix cache" in result.verdict.fix


def test_missing_chunk_is_hidden_corrupt(work, chunked):
    """The capture missed one prefill chunk of a request (no target rows at 8..15, its draft
    rows are there): missing rows, named, never a cache hit or target-drift."""
    t = fp.read(chunked)
    key = request_key("heldout:41")
    e = [e for e, _a, _b in fp.request_rows(t, "target", key) if e.axes["step"]["mode"] == 0][1]
    assert e.keys == [key] and int(e.axes["tok"]["positions"][0]) == 8
    t.events.remove(e)
    result = replay_trace(fp.write(t, work / "missing-chunk.zarr"), TRAINING)
    assert result.verdict.code == "hidden-corrupt", dump(result)
    assert "target-drift" not in codes(result)
    dead = result.verdict.evidence["dead_rows"]
    assert [(d["request"], d["positions"], d["rows"], d["kind"]) for d in dead] == [
        ("heldout:41", [[8, 15]], 8, "missing")
    ]
    assert "engine vs reference (missing rows)" in result.skipped


def test_rows_beyond_the_declared_cache_are_missing(work, cached):
    """n_cached says 17 but the target rows start at 21: positions 17..20 are missing, not
    cached."""
    t = fp.read(cached)
    key = request_key("a-long")
    e, a, b = fp.request_rows(t, "target", key)[0]
    assert int(e.axes["tok"]["positions"][a]) == 17 and e.keys == [key]
    for col, v in e.axes["tok"].items():
        e.axes["tok"][col] = v[4:]
    e.axes["req"]["n_tok"] = e.axes["req"]["n_tok"] - 4
    result = replay_trace(fp.write(t, work / "beyond-cache.zarr"), TRAINING)
    assert result.verdict.code == "hidden-corrupt", dump(result)
    dead = result.verdict.evidence["dead_rows"]
    assert [(d["request"], d["positions"], d["kind"], d["n_cached"]) for d in dead] == [
        ("a-long", [[17, 20]], "missing", 17)
    ]


# -- 4. acceptance-simulated --------------------------------------------------------------------
def test_simulated_acceptance_leads_the_verdict(work, heldout_prompts):
    trace = record(work / "simulated.zarr", heldout_prompts, simulate_accept_len=3)
    result = replay_trace(trace, TRAINING)
    assert result.verdict.code == "acceptance-simulated", dump(result)
    assert result.findings[0].code == "acceptance-simulated"
    ev = result.verdict.evidence
    assert ev["switches"] == {
        "static.acceptance_simulation.settings.SGLANG_SIMULATE_ACC_LEN": "3",
        "static.acceptance_simulation.settings.SGLANG_SIMULATE_ACC_METHOD": "fixed",
        "static.acceptance_simulation.enabled": "True",
    }
    assert ev["recorded_accept_lens"]["mean_accept_len"] == 3.0
    assert result.exit_code == 1


@pytest.mark.parametrize("where", ["speculative_config", "command_line", "env", "vllm_audit"])
def test_simulated_acceptance_third_party(work, clean, where):
    """A vLLM or SGLang producer records the switch in its own words."""
    t = fp.read(clean)
    if where == "vllm_audit":  # the shape hstrace's vLLM hooks write
        t.meta["static"]["acceptance"] = {
            "rejection_sample_method": "synthetic",
            "simulated": True,
            "synthetic_acceptance_rates": None,
            "synthetic_acceptance_length": 2.5,
        }
        expect = "static.acceptance.simulated"
    elif where == "speculative_config":
        t.meta["static"]["speculative_config"] = {
            "method": "eagle3",
            "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": 2.5,
        }
        expect = "static.speculative_config.rejection_sample_method"
    elif where == "command_line":
        t.meta["command_line"] = [
            "vllm",
            "serve",
            "m",
            "--speculative-config",
            '{"method": "eagle3", "rejection_sample_method": "synthetic"}',
        ]
        expect = "command_line (rejection_sample_method)"
    else:
        t.meta["static"]["env"] = {
            "SGLANG_SIMULATE_ACC_LEN": "2.0",
            "SGLANG_SIMULATE_ACC_METHOD": "",
        }
        expect = "static.env.SGLANG_SIMULATE_ACC_LEN"
    result = replay_trace(fp.write(t, work / f"simulated-{where}.zarr"), TRAINING)
    assert result.verdict.code == "acceptance-simulated", dump(result)
    assert expect in result.verdict.evidence["switches"]
    assert all("SIMULATE_ACC_METHOD" not in k for k in result.verdict.evidence["switches"])


def test_switch_off_is_no_finding(work, clean):
    """The same keys with the switch off (vLLM's standard method, an empty variable) are no
    finding: a false alarm here would hide every real one."""
    t = fp.read(clean)
    t.meta["static"]["acceptance"] = {
        "rejection_sample_method": "standard",
        "simulated": False,
        "synthetic_acceptance_rates": None,
        "synthetic_acceptance_length": None,
    }
    t.meta["static"]["env"] = {"SGLANG_SIMULATE_ACC_LEN": "", "SGLANG_SIMULATE_ACC_METHOD": "0"}
    result = replay_trace(fp.write(t, work / "switch-off.zarr"), TRAINING)
    assert result.verdict.code == "no-wiring-fault", dump(result)
    assert "acceptance-simulated" not in codes(result)


# -- 5. chunk-boundary-token --------------------------------------------------------------------
@pytest.fixture(scope="module")
def chunked(work, heldout_prompts):
    return record(work / "chunked.zarr", heldout_prompts, chunked_prefill_size=8)


def test_chunked_prefill_replays_clean(chunked):
    with open_trace(chunked) as tr:
        serving = read_serving(tr)
    assert all(r.prefill_chunks == [(0, 8), (8, 16), (16, 24)] for r in serving.requests)
    assert all(r.seams == [7, 15] for r in serving.requests)
    result = replay_trace(chunked, TRAINING)
    assert result.verdict.code == "no-wiring-fault", dump(result)
    assert result.metrics["chunk_seams"] == {"rows": 8, "wrong": 0}


def test_chunk_boundary_token_names_the_seam_rows(work, chunked, drafter):
    """The seam row of each non-final chunk is fed the target's prediction instead of the
    next chunk's first prompt token (sglang PR #26329)."""
    target = ReferenceTarget(TARGET)
    t = fp.read(chunked)
    expected = set()
    for i in HELDOUT:
        rid = f"heldout:{i}"
        key = request_key(rid)
        rows = fp.request_rows(t, "draft_extend", key)
        prompt = next(
            np.asarray(r.axes["tok"]["prompt_ids"]) for r in t.of("requests") if r.keys == [key]
        )
        pred = target.forward(torch.as_tensor(prompt).long()).logits.argmax(-1)
        for e, a, b in rows[:2]:  # the two non-final chunks' draft extends
            seam = a + (b - a) - 1
            pos = int(e.axes["tok"]["positions"][seam])
            e.axes["tok"]["input_ids"][seam] = int(pred[pos])
            if int(pred[pos]) != int(prompt[pos + 1]):
                expected.add((rid, pos))
        fp.redraft(t, key, drafter)
    assert len(expected) >= 3  # the tiny target mispredicts 5 of the 8 seams
    result = replay_trace(fp.write(t, work / "chunk-seam.zarr"), TRAINING)
    assert result.verdict.code == "chunk-boundary-token", dump(result)
    assert "token-shift" not in codes(result)
    ev = result.verdict.evidence
    assert {(s["request"], s["position"]) for s in ev["seam_rows"]} == expected
    assert all(s["fed_is_target_prediction"] for s in ev["seam_rows"])
    assert all(s["chunk"][1] == s["position"] + 1 for s in ev["seam_rows"])
    assert ev["seams"] == 8 and ev["other_rows_token_agreement"] == 1.0
    assert "#26800" in result.verdict.fix


# -- 6. batch-coupling --------------------------------------------------------------------------
def _batched(clean: Path) -> fp.Trace:
    """heldout:41's prefill (target and draft extend) and first verify ride in heldout:40's
    batch."""
    t = fp.read(clean)
    a, b = request_key("heldout:40"), request_key("heldout:41")
    for table in ("target", "draft_extend", "verify"):
        first = next(e for e in t.of(table) if e.keys == [a])
        second = next(e for e in t.of(table) if e.keys == [b])
        merged = fp.merge_steps(first, second)
        t.events[t.events.index(first)] = merged
        t.events.remove(second)
    return t


def test_batched_trace_replays_clean(work, clean):
    trace = fp.write(_batched(clean), work / "batched.zarr")
    with open_trace(trace) as tr:
        serving = read_serving(tr)
    assert max(len(k) for k in serving.target_batches) == 2
    result = replay_trace(trace, TRAINING)
    assert result.verdict.code == "no-wiring-fault", dump(result)
    by_size = result.metrics["accept_len_by_verify_batch_size"]
    assert by_size["2"]["verify_rows"] == 2 and by_size["1"]["verify_rows"] >= 4


@pytest.mark.parametrize("what", ["aux", "tokens"])
def test_batch_coupling_names_the_owner(work, clean, drafter, what):
    t = _batched(clean)
    a, b = request_key("heldout:40"), request_key("heldout:41")
    table = "target" if what == "aux" else "draft_extend"
    step = next(e for e in t.of(table) if set(e.keys) == {a, b})
    (_, a0, a1), (_, b0, b1) = step.blocks()
    n = min(a1 - a0, b1 - b0)
    tok = step.axes["tok"]
    if what == "aux":  # heldout:41 gets heldout:40's rows: in the capture and in the drafter
        tok["aux_hidden"][b0 : b0 + n] = tok["aux_hidden"][a0 : a0 + n]
        d = next(e for e in t.of("draft_extend") if set(e.keys) == {a, b})
        (_, da0, _), (_, db0, db1) = d.blocks()
        d.axes["tok"]["hidden_in"][db0 : db0 + n] = d.axes["tok"]["hidden_in"][da0 : da0 + n]
    else:  # heldout:41's draft rows are fed heldout:40's tokens
        tok["input_ids"][b0 : b0 + n] = tok["input_ids"][a0 : a0 + n]
    fp.redraft(t, b, drafter)
    result = replay_trace(fp.write(t, work / f"coupled-{what}.zarr"), TRAINING)
    assert result.verdict.code == "batch-coupling", dump(result)
    ev = result.verdict.evidence
    if what == "aux":
        got = ev["aux_rows"][0]
        assert (got["request"], got["rows_of"]) == ("heldout:41", "heldout:40")
        # Position 0 holds the same BOS token in both: the same state there is legitimate.
        assert got["positions"] == list(range(1, 24)) and got["rows"] == 23
        assert got["batch"] == ["heldout:40", "heldout:41"]
        assert "hidden-corrupt" not in codes(result)
    else:
        got = ev["draft_inputs"][0]
        assert (got["request"], got["tokens_of"]) == ("heldout:41", "heldout:40")
        assert got["rows"] == 24 and got["own_token_agreement"] < 0.5
    assert "heldout:41" in result.verdict.summary and "heldout:40" in result.verdict.summary


# -- 10. no-wiring-fault judges the drafter by the number that matters for greedy serving -----
def test_no_wiring_fault_says_which_accuracy_judged_the_drafter(clean):
    result = replay_trace(clean, TRAINING)
    assert result.verdict.code == "no-wiring-fault", dump(result)
    judged = result.verdict.evidence["judged_by"]
    assert judged["metric"] == "acc0_training_full_vocab"
    assert judged["value"] == round(result.metrics["acc0_training_full_vocab"], 4)
    assert judged["healthy_position0_acceptance"] == [0.55, 0.75]
    summary = result.verdict.summary
    assert "against the target's own argmax" in summary
    # The tiny drafter is at ~0.9 target-space accuracy: above the healthy range, not weak.
    assert judged["value"] >= 0.55 and "is not weak" in summary


def test_no_wiring_fault_without_target_makes_no_judgement(work, clean):
    """Without the target model there is no target-space accuracy: no "weak" claim from the
    accuracies against the dataset's tokens."""
    t = fp.read(clean)
    del t.meta["static"]["target"]  # the trace no longer names its target
    trace = fp.write(t, work / "no-target.zarr")
    result = replay_trace(trace, TRAINING)
    assert result.verdict.code == "no-wiring-fault", dump(result)
    assert "judged_by" not in result.verdict.evidence
    assert "weak" not in result.verdict.summary
    assert "not measured" in result.verdict.summary
