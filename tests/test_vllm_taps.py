"""vLLM's taps and audit as pure logic (no vLLM needed): what one engine step becomes in the
trace, vLLM's conventions in the static audit, the bootstrap's engine routing.

The live counterpart (real server, real tensors) is tests/test_vllm_live.py; here the inputs
are built by hand in the exact shapes vLLM 0.32.0 hands over (shared/reference/
vllm-internals.md §2), so every row can be checked by name.
"""

from __future__ import annotations

import time

import pytest
import torch

from hstrace.engines.vllm import audit, taps
from hstrace.engines.vllm.engine import is_vllm_command, parse_spec_metrics
from hstrace.trace import TraceWriter, create_trace, open_trace, request_key

H, K, VD, V = 4, 3, 6, 10
D2T = torch.tensor([0, 1, 1, 3, 4, 4])  # offsets: draft i -> target i + d2t[i]
TARGETS = torch.arange(VD) + D2T  # [0, 2, 3, 6, 8, 9]


def full_vocab(draft_logits: torch.Tensor) -> torch.Tensor:
    """What vLLM's Eagle3 compute_logits returns: draft logits scattered to target ids."""
    out = torch.full((draft_logits.shape[0], V), float("-inf"))
    out[:, TARGETS] = draft_logits
    return out


def test_draft_topk_reads_back_draft_space_from_vllm_full_vocab_logits() -> None:
    g = torch.Generator().manual_seed(0)
    draft = torch.randn(3, VD, generator=g)
    top = taps.draft_topk(full_vocab(draft), D2T, k=4)
    want_vals, want_idx = draft.topk(4, dim=-1)
    assert torch.equal(top["topk_draft_ids"], want_idx)
    assert torch.equal(top["topk_target_ids"], TARGETS[want_idx])
    logp = torch.log_softmax(draft, dim=-1)
    assert torch.allclose(top["topk_logprobs"], logp.gather(-1, want_idx), atol=1e-6)
    assert torch.allclose(top["lse"], torch.logsumexp(draft, dim=-1))
    # no d2t (draft vocab = target vocab): ids are the same in both spaces
    same = taps.draft_topk(draft, None, k=2)
    assert torch.equal(same["topk_draft_ids"], same["topk_target_ids"])


def mixed_step() -> taps.Step:
    """One vLLM step: request A's 5-token prefill chunk (new, 2 tokens from the prefix cache,
    so positions 2..6) batched with request B's verify of 3 drafts (bonus + 3 at 10..13)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor([11, 12, 13, 14, 15, 20, 21, 22, 23])
    pos = torch.tensor([2, 3, 4, 5, 6, 10, 11, 12, 13])
    aux = torch.randn(9, K * H, generator=g)
    step = taps.Step(
        req_ids=["A", "B"],
        num_draft_tokens=[0, 3],
        new_requests=[taps.NewRequest("A", [9, 9, 11, 12, 13, 14, 15], n_cached=2)],
        draft_token_ids=torch.tensor([21, 22, 23]),
        sampled=[[16, -1, -1, -1], [21, 22, 30, -1]],  # B: 2 drafts accepted, bonus 30
        target_ids=ids,
        target_positions=pos,
        target_aux=aux,
        query_start=[0, 5, 9],
        sample_rows=[4, 7],  # A's last row; B's row after its accepted drafts
    )
    first_ids = torch.cat([ids[1:], ids[-1:]]).clone()
    first_ids[torch.tensor([4, 7])] = torch.tensor([16, 30])
    step.calls.append(
        taps.DraftCall(
            first_ids,
            pos.clone(),
            None,
            taps.draft_topk(full_vocab(torch.randn(2, VD, generator=g)), D2T),
        )
    )
    for k in (1, 2):
        step.calls.append(
            taps.DraftCall(
                torch.tensor([3, 6]),
                torch.tensor([6 + k, 12 + k]),
                torch.randn(2, H, generator=g),
                taps.draft_topk(full_vocab(torch.randn(2, VD, generator=g)), D2T),
            )
        )
    return step


def test_a_mixed_step_splits_into_prefill_and_verify_at_true_positions() -> None:
    step = mixed_step()
    writes = taps.step_rows(step, [2, 5, 4])
    names = [w.table for w in writes]
    assert names == [
        "requests",
        "target",
        "target",
        "verify",
        "draft_extend",
        "draft_step",
        "draft_step",
    ]
    req, prefill, verify_t, verify = writes[:4]
    assert req.req["n_cached"].tolist() == [2] and req.req["n_prompt"].tolist() == [7]
    assert prefill.step == {"mode": 0} and verify_t.step == {"mode": 1}
    assert prefill.req["req_key"].tolist() == [request_key("A")]
    assert prefill.tok["positions"].tolist() == [2, 3, 4, 5, 6]  # suffix-only, true positions
    assert torch.equal(prefill.tok["aux_hidden"], step.target_aux[:5])
    assert verify_t.tok["input_ids"].tolist() == [20, 21, 22, 23]  # bonus, d1..d3
    assert torch.equal(verify_t.tok["aux_hidden"], step.target_aux[5:])
    attrs = prefill.column_attrs["tok/aux_hidden"]
    assert attrs == {
        "layer_ids": [2, 4, 5],
        "layer_id_convention": "hf_hidden_states_index",
        "slot_width": H,
    }
    assert verify.req["accept_len"].tolist() == [2] and verify.req["bonus_id"].tolist() == [30]
    assert verify.other["proposed"]["ids"].tolist() == [21, 22, 23]
    assert verify.other["accepted"]["ids"].tolist() == [21, 22]


def test_draft_rows_keep_the_pre_fc_aux_and_topk_only_where_vllm_sampled() -> None:
    step = mixed_step()
    ext, s1, s2 = taps.draft_rows(step, [5, 4])
    assert ext.req["n_tok"].tolist() == [5, 4]
    assert ext.tok["input_ids"].tolist() == [12, 13, 14, 15, 16, 21, 22, 30, 23]
    assert torch.equal(ext.tok["hidden_in"], step.target_aux)  # before fc, as the drafter got it
    ids = ext.tok["topk_draft_ids"]
    assert (ids[[4, 7], 0] >= 0).all()
    others = [r for r in range(9) if r not in (4, 7)]
    assert (ids[others] == -1).all() and torch.isinf(ext.tok["topk_logprobs"][others]).all()
    # k = 8 columns; a draft vocabulary of 6 fills 6, the rest stay -1
    assert torch.equal(ids[[4, 7], :VD], step.calls[0].topk["topk_draft_ids"])
    assert (ids[:, VD:] == -1).all()
    assert s1.step == {"step_index": 1} and s2.step == {"step_index": 2}
    assert torch.equal(s2.tok["hidden_in"], step.calls[2].hidden_in)
    assert s1.tok["positions"].tolist() == [7, 13]


def test_a_step_without_a_padded_batch_is_refused_not_misread() -> None:
    step = mixed_step()
    step.query_start = [0, 5, 8]  # the proposer got more rows than were scheduled
    with pytest.raises(ValueError, match="disable_padded_drafter_batch"):
        taps.target_rows(step, [2, 4, 5])


def test_emitted_step_reads_back_through_the_trace(tmp_path) -> None:
    """The hooks' emit path (one tap per table group) writes a trace the reader accepts."""
    from hstrace.hooks import vllm_patches as vp

    out = tmp_path / "t.zarr"
    create_trace(out, engine={"name": "vllm", "version": "0.32.0"}, command_line=[], static={})
    streams = ["target", "draft_extend", "draft_step", "verify", "requests"]
    rec = vp.VLLMRecorder({"out": str(out), "streams": streams}, (0, 32, 0))
    rec.writer_factory = lambda rank: TraceWriter(out, rank=rank, process=False)
    rec.capture_layers = [2, 4, 5]
    vp._emit_step(rec, mixed_step())
    rec.close()
    with open_trace(out) as tr:
        rank = tr.rank(0)
        assert rank.clean_close and not rank.errors
        target = rank.table("target")
        assert target.column("step", "mode").tolist() == [0, 1]
        assert rank.table("requests").column("req", "n_cached").tolist() == [2]
        assert rank.table("verify").column("req", "accept_len").tolist() == [2]
        assert rank.table("draft_step").column("step", "step_index").tolist() == [1, 2]


def test_a_held_step_counts_the_bytes_of_the_tensors_it_keeps() -> None:
    """What `hstrace arm --hold-mb` counts for a step handed over: its own tensors (the aux
    concat above all), the drafter calls' inputs and any logits kept for the top-k."""
    from hstrace.hooks import vllm_patches as vp

    from hstrace.engines.tapmath import Snap

    step = mixed_step()
    target = sum(t.nbytes for t in (step.target_ids, step.target_positions, step.target_aux))
    calls = sum(
        t.nbytes
        for c in step.calls
        for t in (c.input_ids, c.positions, c.hidden_in)
        if t is not None
    )
    assert vp.held_nbytes(step) == target + step.draft_token_ids.nbytes + calls
    step.calls[0].logits = torch.zeros(2, VD)  # kept for the tap thread's top-k
    assert vp.held_nbytes(step) == target + step.draft_token_ids.nbytes + calls + 2 * VD * 4
    assert step.target_aux.nbytes == 9 * K * H * 4 > 0

    def verify(between=None):  # the verify's work, as `_verify_tap` hands it over
        raise AssertionError("not run: only counted")

    verify.holds = (Snap(bytearray(96), torch.float32, (24,)), torch.zeros(3, VD), None)
    step.verify_probs = verify
    assert vp.held_nbytes(step) == (
        target + step.draft_token_ids.nbytes + calls + 2 * VD * 4 + 96 + 3 * VD * 4
    )


def test_a_raising_tap_is_disabled_and_recorded_the_others_go_on(tmp_path, monkeypatch) -> None:
    from hstrace.hooks import vllm_patches as vp

    out = tmp_path / "t.zarr"
    create_trace(out, engine={"name": "vllm", "version": "0.32.0"}, command_line=[], static={})
    rec = vp.VLLMRecorder(
        {"out": str(out), "streams": ["target", "draft_extend", "draft_step", "verify"]}, (0, 32, 0)
    )
    rec.writer_factory = lambda rank: TraceWriter(out, rank=rank, process=False)

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(taps, "verify_rows", broken)
    vp._emit_step(rec, mixed_step())
    vp._emit_step(rec, mixed_step())  # disabled now: not called again, no second error
    rec.close()
    with open_trace(out) as tr:
        rank = tr.rank(0)
        assert [e["tap"] for e in rank.errors] == ["verify"] and "boom" in rank.errors[0]["message"]
        assert rank.table("verify") is None
        assert rank.table("target").num_steps == 4 and rank.table("draft_extend").num_steps == 2


# ---- the static audit ----------------------------------------------------------------------


def test_aux_layer_source_follows_vllm_lookup_order() -> None:
    top = audit.aux_layer_source({"eagle_aux_hidden_state_layer_ids": [5, 2, 4]}, 8)
    assert top["source"].startswith("top-level") and top["read_by_vllm"] == [5, 2, 4]
    assert top["sorted_ids"] == [2, 4, 5] and top["sorted_differs_from_config"] is True
    assert top["sglang_equivalent_ids"] == [1, 3, 4]
    nested = audit.aux_layer_source(
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}, 8
    )
    assert nested["source"] == "eagle_config.eagle_aux_hidden_state_layer_ids"
    assert nested["read_by_vllm"] == [1, 3, 4]
    default = audit.aux_layer_source({}, 8)
    assert default["source"].startswith("default") and default["read_by_vllm"] == [2, 4, 5]
    assert "hidden_states[k]" in default["capture_convention"]


def test_norm_flags_name_vllm_defaults_per_config_format() -> None:
    speculators = {"speculators_config": {}, "norm_before_fc": False}
    flags = audit.norm_flags(speculators, {"norm_before_residual": True, "norm_before_fc": False})
    assert flags["norm_before_residual"]["value"] is True
    assert flags["norm_before_residual"]["source"].startswith("default:vllm (update_eagle3")
    assert flags["norm_before_fc"]["source"] == "config:norm_before_fc"
    flat = audit.norm_flags({"architectures": ["LlamaForCausalLMEagle3"]}, {})
    assert flat["norm_before_residual"] == {
        "value": False,
        "source": "default:vllm (model default, absent from config.json)",
    }


def test_d2t_spec_and_simulated_acceptance() -> None:
    d = audit.d2t_summary(D2T.tolist(), VD, V)
    assert d["mapped_head"] == TARGETS.tolist() and d["mapped_distinct"] and d["mapped_in_range"]
    table = audit.d2t_summary([0, 2, 3, 6, 8, 9], VD, V)  # target ids stored: read as offsets
    assert table["mapped_in_range"] is False
    spec = audit.spec_settings(None, 3)
    assert (spec["num_steps"], spec["topk"], spec["num_draft_tokens"]) == (3, 1, 4)
    assert spec["adjusted"] == {}
    assert audit.acceptance_setting("synthetic", [0.9, 0.8, 0.7], None)["simulated"] is True
    assert audit.acceptance_setting(None, None, None) == {
        "rejection_sample_method": "standard",
        "simulated": False,
        "synthetic_acceptance_rates": None,
        "synthetic_acceptance_length": None,
    }


def test_engine_detection_and_prometheus_counters() -> None:
    assert is_vllm_command("python -m vllm.entrypoints.openai.api_server --model m")
    assert is_vllm_command("vllm serve m")
    assert not is_vllm_command("python -m sglang.launch_server --model-path m")
    text = (
        "# HELP x\n"
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 26.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 4.0\n'
        'vllm:spec_decode_num_drafts_created{engine="0"} 1.7e9\n'
    )
    got = parse_spec_metrics(text)
    assert got == {
        "vllm:spec_decode_num_drafts_total": 26.0,
        "vllm:spec_decode_num_accepted_tokens_per_pos_total": {"1": 4.0},
    }


def test_verify_rule_inputs_per_drafted_token_and_their_absence() -> None:
    """`verify_probs` on the sampler's rows (here hand-written logits for a batch of a prefill
    request A and a verifying request B with drafts 21, 22, 23): p of each draft after the
    transforms, q = 1 for a one-hot draft, the raw and processed logits, the history counts."""
    vocab = 32
    raw = torch.zeros(3, vocab)
    raw[:, 21], raw[:, 22], raw[:, 23] = 2.0, 1.0, 0.5
    proc = raw / 0.5  # what an engine at temperature 0.5 hands its rule
    prompt = torch.full((2, 4), vocab)
    prompt[1, :2] = torch.tensor([22, 5])
    probs = taps.verify_probs(
        torch.tensor([21, 22, 23]),
        [0, 3],
        raw,
        raw[torch.arange(3), torch.tensor([21, 22, 23])],
        proc,
        None,
        {"temperature": torch.tensor([0.5, 0.5]), "top_p": None},
        taps.RULE_ONE_HOT,
        prompt_ids=prompt,
        output_ids=[[], [21, 21, 7]],
    )
    assert probs.num_draft_tokens == [0, 3]
    assert probs.select([0]).tok["p_target"].numel() == 0  # A verified nothing
    b = probs.select([1])
    assert b.req["rule"].tolist() == [taps.RULE_ONE_HOT] and b.req["temperature"].tolist() == [0.5]
    assert torch.isnan(b.req["top_p"]).all()  # not in force
    want = proc.softmax(-1)[torch.arange(3), torch.tensor([21, 22, 23])]
    assert b.tok["p_target"].tolist() == pytest.approx(want.tolist())
    assert b.tok["q_draft"].tolist() == [1.0, 1.0, 1.0]
    assert b.tok["logit_raw"].tolist() == [2.0, 1.0, 0.5]
    assert b.tok["logit_pen"].tolist() == [2.0, 1.0, 0.5]
    assert b.tok["logit_proc"].tolist() == [4.0, 2.0, 1.0]
    assert b.tok["target_argmax"].tolist() == [21, 21, 21]
    assert b.tok["seen_prompt"].tolist() == [0, 1, 0] and b.tok["n_out"].tolist() == [2, 0, 0]
    step = mixed_step()
    step.verify_probs = probs
    verify = taps.verify_rows(step, [1])
    assert verify.req["rule"].tolist() == [taps.RULE_ONE_HOT]
    assert verify.other["proposed"]["n_out"].tolist() == [2, 0, 0]
    # no sampler tap (disabled, or another runner): the columns are there, NaN / -1
    step.verify_probs = None
    verify = taps.verify_rows(step, [1])
    assert verify.req["rule"].tolist() == [-1]
    assert torch.isnan(verify.other["proposed"]["p_target"]).all()


def test_restrict_keeps_exactly_the_sampled_requests_rows() -> None:
    """`record --sample-every K`: a step cut to request B alone writes B's rows of the full
    step, row for row (target verify, verify outcome, draft extend, chain), and nothing of A."""
    step = mixed_step()
    full = taps.step_rows(step, [2, 5, 4])
    cut_step = taps.restrict(step, [1])
    cut_step.new_requests = []  # the hooks admit only kept requests; A was not kept
    cut = taps.step_rows(cut_step, [2, 5, 4])
    assert [w.table for w in cut] == [
        "target",
        "verify",
        "draft_extend",
        "draft_step",
        "draft_step",
    ]
    t_full, t_cut = full[2], cut[0]
    assert t_cut.step == {"mode": 1} and t_cut.req["req_key"].tolist() == [request_key("B")]
    for col in ("input_ids", "positions", "aux_hidden"):
        assert torch.equal(t_cut.tok[col], t_full.tok[col])
    assert cut[1].req["accept_len"].tolist() == [2]
    assert cut[1].other["accepted"]["ids"].tolist() == [21, 22]
    assert cut[1].other["proposed"]["ids"].tolist() == [21, 22, 23]
    ext_full, ext_cut = full[4], cut[2]
    assert ext_cut.req["n_tok"].tolist() == [4]
    for col, v in ext_cut.tok.items():
        # B's rows 5..8 of the batch (NaN lse where vLLM computed no logits)
        assert torch.equal(v.nan_to_num(-7.0), ext_full.tok[col][5:9].nan_to_num(-7.0)), col
    for s_full, s_cut in zip(full[5:], cut[3:], strict=True):
        assert s_cut.req["req_key"].tolist() == [request_key("B")]
        for col, v in s_cut.tok.items():
            assert torch.equal(v.nan_to_num(-7.0), s_full.tok[col][1:2].nan_to_num(-7.0)), col
    # keeping every request is the step itself
    assert taps.restrict(step, [0, 1]) is step


def test_new_request_reads_the_resolved_sampling_params() -> None:
    from types import SimpleNamespace

    sp = SimpleNamespace(
        temperature=0.8,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        frequency_penalty=0.2,
        presence_penalty=0.3,
        seed=None,
        max_tokens=17,
    )
    nr = SimpleNamespace(
        req_id="cmpl-1-0", prompt_token_ids=[1, 2], num_computed_tokens=0, sampling_params=sp
    )
    w = taps.requests_rows([taps.new_request(nr)])
    assert w is not None
    assert w.req["temperature"].dtype == torch.float64 and w.req["temperature"].tolist() == [0.8]
    assert w.req["top_k"].tolist() == [40] and w.req["max_tokens"].tolist() == [17]
    assert w.req["seed"].tolist() == [-1]  # not set
    assert w.req["presence_penalty"].tolist() == [0.3]
    pooled = SimpleNamespace(
        req_id="p", prompt_token_ids=[1], num_computed_tokens=0, sampling_params=None
    )
    w = taps.requests_rows([taps.new_request(pooled)])
    assert w is not None and torch.isnan(w.req["temperature"]).all()


def test_the_tap_threads_batched_work_equals_the_per_call_and_per_request_work() -> None:
    """What the tap thread batches gives the rows the plain per-call / per-request work gives:
    one top-k over the step's stacked draft logits split back (each call's `draft_topk`, bit
    for bit); a verify of requests 0 and 2 with a prefill between them (rows by index, not
    one slice), with the rule columns of exactly those requests' drafted tokens."""
    g = torch.Generator().manual_seed(3)
    step = taps.Step(
        req_ids=["a", "p", "c"],
        num_draft_tokens=[2, 0, 2],
        draft_token_ids=torch.tensor([5, 6, 7, 8]),
        sampled=[[5, 9, -1], [4, -1, -1], [3, -1, -1]],
        target_ids=torch.arange(100, 108),
        target_positions=torch.arange(8),
        target_aux=torch.randn(8, K * H, generator=g),
        query_start=[0, 3, 5, 8],
    )
    for rows in (8, 3, 3):  # the first pass reads every target row; the chain one a request
        call = taps.DraftCall(torch.zeros(rows, dtype=torch.int64), torch.zeros(rows), None)
        # three sampled rows each, over a draft vocabulary wider than TOPK (k = 8 kept)
        call.logits, call.d2t = torch.randn(3, 40, generator=g), None
        step.calls.append(call)
    want = [taps.draft_topk(c.logits, None) for c in step.calls]
    taps.finish_topk(step)
    for call, w in zip(step.calls, want, strict=True):
        assert call.logits is None and all(torch.equal(call.topk[n], w[n]) for n in w)
    chain = taps.draft_rows(step, [3, 2, 3])[1]
    assert torch.equal(chain.tok["topk_draft_ids"], want[1]["topk_draft_ids"])

    raw = torch.randn(4, V, generator=g)
    step.verify_probs = taps.verify_probs(
        step.draft_token_ids, [2, 0, 2], raw, raw[:, 0], raw * 2.0, None,
        {"temperature": torch.tensor([0.5, 0.7, 0.0])}, taps.RULE_ONE_HOT,
    )  # fmt: skip
    t_prefill, t_verify = taps.target_rows(step, [2, 4, 5])
    assert t_verify.tok["input_ids"].tolist() == [100, 101, 102, 105, 106, 107]
    assert torch.equal(t_verify.tok["aux_hidden"], step.target_aux[[0, 1, 2, 5, 6, 7]])
    assert t_prefill.tok["input_ids"].tolist() == [103, 104]
    assert t_verify.req["req_key"].tolist() == [request_key("a"), request_key("c")]
    v = taps.verify_rows(step, [0, 2])
    assert v.other["proposed"]["ids"].tolist() == [5, 6, 7, 8]
    assert v.req["rule"].tolist() == [taps.RULE_ONE_HOT, taps.RULE_GREEDY]  # c at T = 0
    assert v.req["temperature"].tolist() == pytest.approx([0.5, 0.0])
    assert v.other["proposed"]["logit_raw"].tolist() == raw.gather(1, torch.tensor(
        [[5], [6], [7], [8]])).reshape(-1).tolist()  # fmt: skip
    # one request of the three (record --sample-every): its rows, cut from the columns
    only_c = taps.verify_rows(taps.restrict(step, [2]), [0])
    assert only_c.req["rule"].tolist() == [taps.RULE_GREEDY]
    assert (
        only_c.other["proposed"]["logit_raw"].tolist()
        == v.other["proposed"]["logit_raw"][2:].tolist()
    )


def test_a_steady_batch_shares_its_request_key_column() -> None:
    from hstrace.engines.rows import request_keys

    first = request_keys(["a", "b"])
    assert first.tolist() == [request_key("a"), request_key("b")]
    again = request_keys(("a", "b"))  # the next decode step: the same batch, the same column
    assert again is first
    other = request_keys(["b", "a"])  # another batch (order counts): its own column
    assert other is not first and other.tolist() == [request_key("b"), request_key("a")]
    assert request_keys(["a", "b"]).tolist() == first.tolist()
    assert request_keys([]).tolist() == []


def test_a_step_whose_execute_model_raises_is_told_ended() -> None:
    """An `execute_model` that raises has ended its step: the end is told (a held session
    waits for a quiet server, `Recorder._quiet_for`, which a step never ended would deny it)
    and the error goes on to vLLM unchanged; dormant, nothing is told."""
    from hstrace.hooks import vllm_patches as vp
    from hstrace.hooks.common import Recorder

    rec = Recorder({"streams": []}, (0, 32, 0))
    rec.cued = True
    told: list[bool] = []
    rec._phase = lambda running: told.append(running)

    class Boom(RuntimeError):
        pass

    seen: list[bool] = []  # whether the step was told started as it ran

    def execute_model(self, scheduler_output):
        seen.append(rec.in_step)
        raise Boom("the forward failed")

    saved, vp.REC = vp.REC, rec
    try:
        run = vp.wrap_execute_model(execute_model)
        with pytest.raises(Boom, match="the forward failed"):
            run(None, None)
        assert seen == [True] and told == [True, False] and not rec.in_step
        time.sleep(0.02)
        assert rec._quiet_for() >= 0.02  # quiet counts from the failed step's end
        rec.cued = False
        with pytest.raises(Boom):
            run(None, None)
        assert seen == [True, False] and told == [True, False]
    finally:
        vp.REC = saved


def test_a_step_that_returns_from_execute_model_is_told_ended_there() -> None:
    """V1's `execute_model` returns None when `sample_tokens` follows (the step's end), and its
    output itself for a step with no token scheduled (EMPTY_MODEL_RUNNER_OUTPUT, sent after
    requests finish): that step's end is told at once, or the tap thread would wait for it."""
    from hstrace.hooks import vllm_patches as vp
    from hstrace.hooks.common import Recorder

    rec = Recorder({"streams": []}, (0, 32, 0))
    rec.cued = True
    told: list[bool] = []
    rec._phase = lambda running: told.append(running)  # what the writer is told

    seen: list[bool] = []  # whether the step was told started as it ran

    def execute_model(self, scheduler_output):
        seen.append(rec.in_step)
        return scheduler_output

    saved, vp.REC = vp.REC, rec
    try:
        run, sample = vp.wrap_execute_model(execute_model), vp.wrap_sample_tokens(lambda s: "out")
        assert run(None, None) is None and rec.in_step  # sample_tokens follows: still running
        assert sample(None) == "out" and not rec.in_step
        empty = object()
        assert run(None, empty) is empty and not rec.in_step  # ended where it returned
        assert told == [True, False, True, False] and seen == [True, True]
        rec.cued = False  # dormant: one flag check, nothing told
        assert run(None, empty) is empty and told == [True, False, True, False]
        assert seen == [True, True, False]

        def disarmed_meanwhile(self, scheduler_output):
            rec.cued = False  # a disarm while the step ran: it opens the gap itself, and
            return scheduler_output  # the serving thread never queues its drain's steps

        rec.cued = True
        run = vp.wrap_execute_model(disarmed_meanwhile)
        assert run(None, empty) is empty and told == [True, False, True, False, True]
    finally:
        vp.REC = saved


def test_sampled_rows_read_the_same_from_the_runners_tensor_as_from_lists() -> None:
    """The hooks keep the runner's sampled rows as one tensor (`Step.sampled`); the verify
    rows and a `--sample-every` cut read them as the lists they were, row for row."""
    lists = mixed_step()
    tensor = mixed_step()
    tensor.sampled = torch.tensor(lists.sampled)
    want, got = taps.verify_rows(lists, [1]), taps.verify_rows(tensor, [1])
    assert got.req["accept_len"].tolist() == want.req["accept_len"].tolist() == [2]
    assert got.other["accepted"]["ids"].tolist() == [21, 22]
    for col, v in want.req.items():
        assert torch.equal(got.req[col].nan_to_num(-7), v.nan_to_num(-7)), col
    assert taps.restrict(tensor, [1]).sampled == [[21, 22, 30, -1]]


def _kept_objects(*roots: object) -> int:
    """The objects the cyclic collector tracks that `roots` keep alive (types, modules and
    functions left out: shared, not a step's)."""
    import gc
    import types

    seen: set[int] = set()
    todo = list(roots)
    while todo:
        o = todo.pop()
        if id(o) in seen or not gc.is_tracked(o):
            continue
        if isinstance(o, type | types.ModuleType | types.FunctionType):
            continue
        seen.add(id(o))
        todo.extend(gc.get_referents(o))
    return len(seen)


def test_a_held_steps_collection_keeps_as_many_objects_at_any_batch_size() -> None:
    """What the serving thread keeps of a step until its rows are built (`_begin_step`'s
    collection: a held session keeps it until the server is quiet, and the cyclic collector
    walks each object it keeps): the runner's sampled rows are one copy, not a list a
    request, so a batch of 32 keeps no more objects than a batch of 2; vLLM's later writes
    to its own tensor do not reach the copy."""
    from types import SimpleNamespace

    from hstrace.hooks import vllm_patches as vp

    kept = {}
    for batch in (2, 32):
        rec = vp.VLLMRecorder({"streams": []}, (0, 32, 0))
        runner = SimpleNamespace(
            input_batch=SimpleNamespace(req_ids=[f"r{i}" for i in range(batch)], num_reqs=batch)
        )
        sampled = torch.arange(batch * 4).reshape(batch, 4)
        bound = {
            "scheduler_output": SimpleNamespace(scheduled_new_reqs=[], finished_req_ids=[]),
            "spec_decode_metadata": SimpleNamespace(
                num_draft_tokens=[3] * batch, draft_token_ids=torch.arange(3 * batch)
            ),
            "sampled_token_ids": sampled,
        }
        step = vp._begin_step(rec, runner, bound)
        sampled.fill_(-7)  # the runner's buffer, written again
        assert taps.sampled_rows(step) == torch.arange(batch * 4).reshape(batch, 4).tolist()
        assert step.num_draft_tokens == [3] * batch and not step.new_requests
        kept[batch] = _kept_objects(step)
    assert kept[2] == kept[32], kept
    # vLLM's list-of-lists form (a drafter run after bookkeeping) is copied as lists
    rows = [[1, 2], [3, -1]]
    copied = vp._sampled_copy(rows)
    rows[0][0] = 9
    assert copied == [[1, 2], [3, -1]]
