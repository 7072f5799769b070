"""Row building for vLLM 0.33's Model Runner V2 taps (`hstrace.engines.vllm.taps_v2`).

V2 needs Triton and CUDA, so the hand-over is a named stand-in: plain torch CPU tensors and
numpy arrays shaped as 0.33.0's code passes them:
- `InputBatch` (vllm/v1/worker/gpu/input_batch.py): req_ids, num_reqs, query_start_loc_np
  [num_reqs+1], num_tokens, input_ids / positions [num_tokens_after_padding],
  num_draft_tokens_per_req [num_reqs], cu_num_logits_np [num_reqs+1], logits_indices
  [num_logits];
- `aux_hidden_states`: num_layers x [num_tokens_after_padding, hidden], as
  `TargetDependentARSpeculator.propose` receives them
  (vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py);
- `sampled_token_ids` [num_reqs, num_speculative_steps+1] from `new_empty` (only the first
  num_sampled[i] written) and `num_sampled` [num_reqs] int32, as `RejectionSampler.__call__`
  returns them (vllm/v1/worker/gpu/spec_decode/rejection_sampler.py, `rejection_sample` in
  rejection_sampler_utils.py; `get_num_sampled_and_rejected` in gpu/input_batch.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hstrace.engines.rows import request_keys
from hstrace.engines.vllm import taps, taps_v2

H, K_LAYERS, SPEC = 4, 3, 3
GARBAGE = 777  # what `new_empty` may leave past num_sampled


def _batch() -> SimpleNamespace:
    """Request "a" verifies 3 drafts (4 query tokens: last accepted + drafts 41, 42, 43, all
    4 rows sampled); request "b" is a 5-token prefill chunk (1 logits row). 9 tokens padded
    to 12 (CUDA-graph padding)."""
    ids = torch.tensor([7, 41, 42, 43, 1, 2, 3, 4, 5, 0, 0, 0], dtype=torch.int32)
    pos = torch.tensor([10, 11, 12, 13, 0, 1, 2, 3, 4, 0, 0, 0], dtype=torch.int64)
    return SimpleNamespace(
        req_ids=["a", "b"],
        num_reqs=2,
        num_tokens=9,
        num_tokens_after_padding=12,
        query_start_loc_np=np.array([0, 4, 9], dtype=np.int32),
        input_ids=ids,
        positions=pos,
        num_draft_tokens_per_req=np.array([3, 0], dtype=np.int32),
        cu_num_logits_np=np.array([0, 4, 5], dtype=np.int32),
        logits_indices=torch.tensor([0, 1, 2, 3, 8], dtype=torch.int64),
    )


def _aux() -> list[torch.Tensor]:
    # layer l, token t, channel c = 100*l + t + c/10: every value names its origin
    t = torch.arange(12, dtype=torch.float32)[:, None]
    c = torch.arange(H, dtype=torch.float32)[None, :] / 10
    return [100 * layer + t + c for layer in range(K_LAYERS)]


def test_target_rows_split_verify_and_prefill_with_the_aux_concat() -> None:
    step = taps_v2.target_step(_batch(), _aux())
    writes = taps.target_rows(step, capture_layers=[2, 5, 8])
    assert [(w.table, w.step["mode"]) for w in writes] == [("target", 0), ("target", 1)]
    prefill, verify = writes
    assert prefill.req["req_key"].tolist() == request_keys(["b"]).tolist()
    assert prefill.req["n_tok"].tolist() == [5]
    assert prefill.tok["input_ids"].tolist() == [1, 2, 3, 4, 5]
    assert prefill.tok["positions"].tolist() == [0, 1, 2, 3, 4]
    assert verify.req["req_key"].tolist() == request_keys(["a"]).tolist()
    assert verify.tok["input_ids"].tolist() == [7, 41, 42, 43]
    assert verify.tok["positions"].tolist() == [10, 11, 12, 13]
    aux = prefill.tok["aux_hidden"]
    assert aux.shape == (5, K_LAYERS * H)  # padding rows dropped, layers side by side
    # token 4 of the batch (b's first), layer 1's block: 100 + 4 + c/10
    assert aux[0, H : 2 * H].tolist() == pytest.approx([104.0, 104.1, 104.2, 104.3])
    assert aux[4, 2 * H].item() == pytest.approx(208.0)
    assert prefill.column_attrs is not None and "tok/aux_hidden" in prefill.column_attrs


def test_verify_rows_cut_at_num_sampled_and_read_drafts_at_logits_rows() -> None:
    batch = _batch()
    sampled = torch.full((2, SPEC + 1), GARBAGE, dtype=torch.int64)
    sampled[0, :3] = torch.tensor([41, 42, 99])  # 2 drafts accepted, then the target's 99
    sampled[1, :1] = torch.tensor([6])  # b's first token after its prefill
    num_sampled = torch.tensor([3, 1], dtype=torch.int32)
    w = taps_v2.verify_rows(batch, sampled, num_sampled)
    assert w is not None and w.table == "verify"
    assert w.req["req_key"].tolist() == request_keys(["a"]).tolist()  # b verified nothing
    assert w.req["accept_len"].tolist() == [2]
    assert w.req["bonus_id"].tolist() == [99]
    assert w.req["n_proposed"].tolist() == [3]
    assert w.other["proposed"]["ids"].tolist() == [41, 42, 43]
    assert w.other["accepted"]["ids"].tolist() == [41, 42]
    assert GARBAGE not in w.other["accepted"]["ids"].tolist()


def test_a_chunk_prefilling_request_is_no_verify() -> None:
    batch = _batch()
    sampled = torch.full((2, SPEC + 1), GARBAGE, dtype=torch.int64)
    num_sampled = torch.tensor([0, 0], dtype=torch.int32)  # get_num_sampled_and_rejected: 0
    assert taps_v2.verify_rows(batch, sampled, num_sampled) is None


def test_malformed_hand_overs_are_refused() -> None:
    batch = _batch()
    batch.num_tokens = 8
    with pytest.raises(ValueError, match="ends at 9, input_batch has 8 tokens"):
        taps_v2.target_step(batch, _aux())
    with pytest.raises(ValueError, match="no aux hidden states"):
        taps_v2.target_step(_batch(), [])


def test_the_v2_wrappers_write_a_trace_the_reader_accepts(tmp_path) -> None:
    """The hooks' V2 wrappers (hooks/vllm_patches.py) around stand-in functions with 0.33.0's
    signatures: add_requests -> requests, propose -> target rows (draft rows need the drafter's
    eager forward, absent here), the rejection sampler -> verify; read back from the trace."""
    from hstrace.hooks import vllm_patches as vp

    from hstrace.trace import TraceWriter, create_trace, open_trace

    out = tmp_path / "t.zarr"
    create_trace(out, engine={"name": "vllm", "version": "0.33.0"}, command_line=[], static={})
    streams = ["target", "draft_extend", "draft_step", "verify", "requests"]
    rec = vp.VLLMRecorder({"out": str(out), "streams": streams}, (0, 33, 0))
    rec.writer_factory = lambda rank: TraceWriter(out, rank=rank, process=False)
    rec.capture_layers = [2, 5, 8]
    vp.REC = rec
    seen: list[str] = []

    def add_requests(self, scheduler_output):
        seen.append("add_requests")

    def propose(
        self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
        num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
        dp_sync_state=None, dummy_run=False, skip_attn_for_dummy_run=False, mm_inputs=None,
        is_profile=False, num_speculative_tokens=None,
    ):  # fmt: skip
        seen.append("propose")
        return torch.zeros(2, SPEC, dtype=torch.int64)

    def rejection_call(self, logits, input_batch, draft_logits=None, invalid_drafts=None):
        sampled = torch.full((2, SPEC + 1), GARBAGE, dtype=torch.int64)
        sampled[0, :3] = torch.tensor([41, 42, 99])
        sampled[1, :1] = torch.tensor([6])
        return SimpleNamespace(
            sampled_token_ids=sampled, num_sampled=torch.tensor([3, 1], dtype=torch.int32)
        )

    new = SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id="b", prompt_token_ids=[1, 2, 3, 4, 5, 6], num_computed_tokens=0)
        ]
    )
    speculator = SimpleNamespace(method="eagle3")
    batch = _batch()
    try:
        vp.wrap_v2_add_requests(add_requests)(object(), new)
        vp.wrap_v2_rejection_sampler(rejection_call)(object(), torch.zeros(5, 16), batch)
        args = (None, None, torch.zeros(12, H), _aux(), *(torch.zeros(2),) * 6)
        vp.wrap_v2_propose(propose)(speculator, batch, *args)
        vp.wrap_v2_propose(propose)(speculator, batch, *args, dummy_run=True)  # not recorded
    finally:
        vp.REC = None
    rec.close()
    assert seen == ["add_requests", "propose", "propose"]
    with open_trace(out) as tr:
        rank = tr.rank(0)
        assert rank.clean_close and not rank.errors, rank.errors
        assert rank.table("requests").column("req", "n_cached").tolist() == [0]
        assert rank.table("verify").column("req", "accept_len").tolist() == [2]
        target = rank.table("target")
        assert target.column("step", "mode").tolist() == [0, 1]  # one propose call, no dummy
        assert rank.table("draft_extend") is None


def test_an_mtp_speculator_is_recorded_from_last_hidden_states() -> None:
    """`MTPSpeculator` (V2) gets no aux states: `propose` feeds it `last_hidden_states`
    [num_tokens_after_padding, hidden], the target's output (stand-in shaped as 0.33.0's)."""
    batch = _batch()
    last = _aux()[2]  # one [12, H] tensor whose values name their token row
    step = taps_v2.target_step(batch, [], last)
    assert step.target_aux.shape == (9, H)  # padding rows dropped
    assert torch.equal(step.target_aux, last[:9]) and step.target_aux is not last
    last[0, 0] = -1.0  # the runner reuses its buffer: the step holds a copy
    assert step.target_aux[0, 0] == 200.0
    writes = taps.target_rows(step, [4], "mtp_target_output")
    attrs = writes[0].column_attrs["tok/aux_hidden"]
    assert attrs["layer_ids"] == [4] and attrs["layer_id_convention"] == "mtp_target_output"
    assert attrs["slot_width"] == H
    with pytest.raises(ValueError, match="no aux hidden states"):
        taps_v2.target_step(batch, [])


def test_a_v2_runners_process_refuses_the_benchs_work_levels() -> None:
    """The bench's `work` levels below a recording are V1's (`wrap_propose_draft_token_ids`):
    once a V2 runner has loaded in a process its recorder refuses them by name, so a bench
    session never records rows while saying it dropped them."""
    from hstrace.hooks import vllm_patches as vp

    from hstrace.engines.protocol import WORK_LEVELS

    rec = vp.VLLMRecorder({"dormant": True, "streams": []}, (0, 33, 0))
    assert rec.WORK_LEVELS == tuple(WORK_LEVELS)  # V1's process: every level
    vp.REC = rec
    try:
        vp.wrap_v2_load_model(lambda self: None)(SimpleNamespace())
    finally:
        vp.REC = None
    with pytest.raises(ValueError, match=r"work 'collect': this engine's hooks take rows$"):
        rec.arm({"out": "unused", "streams": [], "work": "collect"})
    assert not rec.armed
