"""The per-step taps, fed by SGLang 0.5.23's real worker methods and data classes on CPU.

The real `EagleDraftWorker._draft_extend_for_prefill` / `_draft_extend_for_decode`,
`EAGLEWorkerV2.verify` and `ModelRunner.forward` run, patched by `hstrace.hooks.sglang_patches`
exactly as in a server, on real `Req`, `ScheduleBatch`, `EagleVerifyInput`, `EagleDraftInput`,
`LogitsProcessorOutput` and `GenerationBatchResult` objects holding CPU tensors. Only the calls
that need CUDA are named fakes (tests/sglang_fakes.py: the KV-pool `ForwardBatch.init_new`, the
draft model's attention forward, the target's verify forward). The rows land in a real trace on
disk and are read back with `open_trace`.
"""

from __future__ import annotations

import functools
from array import array

import pytest

pytest.importorskip("sglang", reason="needs sglang==0.5.23 (scripts/sglang-venv.sh)")
pytestmark = pytest.mark.sglang

from helpers import sglang_fakes  # noqa: E402

sglang_fakes.install()

import torch  # noqa: E402
from helpers import sglang_world  # noqa: E402
from hstrace.hooks import sglang_patches  # noqa: E402
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import (  # noqa: E402
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.speculative import eagle_worker_common, eagle_worker_v2  # noqa: E402
from sglang.srt.speculative.eagle_info import EagleDraftInput, EagleVerifyInput  # noqa: E402

from hstrace.engines.sglang import taps as sglang_taps  # noqa: E402
from hstrace.trace import TraceWriter, create_trace, open_trace, request_key  # noqa: E402

VOCAB, DRAFT_VOCAB, HIDDEN = 64, 32, 8
NUM_STEPS, NDT = 3, 4  # topk = 1: num_draft_tokens = num_steps + 1
PROMPTS = {"req-a": [1, 2, 3, 4, 5], "req-b": [7, 8, 9]}
NEXT_TOKENS = [11, 12]  # the target's sampled token after the prefill, per request
HOT = torch.arange(DRAFT_VOCAB, dtype=torch.int64) * 2  # d2t offsets 0,1,2.. -> target = 2 * draft


@pytest.fixture(scope="module", autouse=True)
def runtime() -> None:
    sglang_world.publish_runtime()


@pytest.fixture()
def world(tmp_path, monkeypatch):
    """A recorder installed on the real classes, writing a real trace; the worker objects."""
    fb_cls, runner_cls, verify_fn = sglang_fakes.fake_cuda_classes(VOCAB, DRAFT_VOCAB, HIDDEN)
    monkeypatch.setattr(eagle_worker_v2, "ForwardBatch", fb_cls)
    monkeypatch.setattr(eagle_worker_common, "ForwardBatch", fb_cls)
    out = tmp_path / "taps.zarr"
    create_trace(out, engine={"name": "sglang", "version": "0.5.23"})
    rec = sglang_patches.install(
        (0, 5, 23),
        {"out": str(out), "streams": list(sglang_taps_streams()), "on_full": "block"},
    )
    rec.writer_factory = lambda rank: TraceWriter(out, rank=rank)
    rec.hot_token_id = HOT  # what the load_weights audit sets from d2t
    rec.spec_topk = 1
    monkeypatch.setattr(sglang_patches, "REC", rec)

    draft = sglang_world.draft_worker(HOT, runner_cls(), num_steps=NUM_STEPS, ndt=NDT)
    worker = sglang_world.target_worker(ndt=NDT)
    yield {
        "rec": rec,
        "out": out,
        "draft": draft,
        "worker": worker,
        "verify_fn": verify_fn,
        "monkeypatch": monkeypatch,
    }
    rec.close()


def sglang_taps_streams() -> tuple[str, ...]:
    return ("target", "draft_extend", "draft_step", "verify", "requests")


def _prefill_batch() -> ScheduleBatch:
    reqs = [Req(rid, "", array("i", ids), SamplingParams()) for rid, ids in PROMPTS.items()]
    ids = torch.tensor([t for p in PROMPTS.values() for t in p], dtype=torch.int64)
    lens = [len(p) for p in PROMPTS.values()]
    return ScheduleBatch(
        reqs=reqs,
        input_ids=ids,
        extend_lens=lens,
        prefix_lens=[0, 0],
        forward_mode=ForwardMode.EXTEND,
        seq_lens=torch.tensor(lens),
        seq_lens_cpu=torch.tensor(lens),
    )


def _verify_input(seq_lens: torch.Tensor, draft_tokens: torch.Tensor) -> EagleVerifyInput:
    return sglang_world.verify_input(seq_lens, draft_tokens, num_steps=NUM_STEPS, ndt=NDT)


def _run_one_round(w) -> dict:
    """Prefill + draft-extend, one draft step, verify, decode draft-extend: one speculative round."""
    torch.manual_seed(3)
    draft, worker = w["draft"], w["worker"]
    batch = _prefill_batch()
    prompt_ids = batch.input_ids
    target_hidden = torch.randn(prompt_ids.numel(), 3 * HIDDEN).to(torch.bfloat16)
    next_ids = torch.tensor(NEXT_TOKENS)
    draft_input = draft._draft_extend_for_prefill(batch, target_hidden, next_ids, None)
    assert isinstance(draft_input, EagleDraftInput)

    # one eager draft step through the real ModelRunner.forward (hidden = the draft's own, H wide)
    bs = len(PROMPTS)
    step_ids = HOT[draft_input.topk_index.reshape(-1)]
    step_fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=bs,
        input_ids=step_ids,
        req_pool_indices=torch.arange(bs),
        seq_lens=batch.seq_lens + 1,
        out_cache_loc=torch.zeros(bs, dtype=torch.int64),
        seq_lens_sum=int(batch.seq_lens.sum()) + bs,
        positions=batch.seq_lens.to(torch.int64),
        spec_info=EagleDraftInput(hidden_states=draft_input.hidden_states),
        capture_hidden_mode=CaptureHiddenMode.LAST,
        rids=list(PROMPTS),
    )
    step_out = draft.draft_runner.forward(step_fb).logits_output

    # verify: req-a's target agrees with its first two drafts, req-b's with none
    seq_lens = torch.tensor([len(p) for p in PROMPTS.values()])
    drafts = torch.tensor([11, 20, 21, 22, 12, 30, 31, 32])
    agree = torch.tensor([20, 21, 40, 41, 50, 51, 52, 53])  # target argmax per verify row
    target_logits = torch.nn.functional.one_hot(agree, VOCAB).float()
    verify_aux = torch.randn(bs * NDT, 3 * HIDDEN).to(torch.bfloat16)
    decode = ScheduleBatch(
        reqs=batch.reqs,
        input_ids=drafts,
        forward_mode=ForwardMode.DECODE,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens,
        spec_info=_verify_input(seq_lens, drafts),
    )
    decode.model_config = type("FakeModelConfig", (), {"vocab_size": VOCAB})()
    w["monkeypatch"].setattr(
        eagle_worker_v2,
        "run_eagle_verify",
        functools.partial(w["verify_fn"], target_logits=target_logits, aux_hidden=verify_aux),
    )
    result = worker.verify(decode)
    draft._draft_extend_for_decode(decode, result)
    return {
        "prompt_ids": prompt_ids,
        "target_hidden": target_hidden,
        "draft_input": draft_input,
        "step_fb": step_fb,
        "step_logits": step_out.next_token_logits,
        "drafts": drafts,
        "verify_aux": verify_aux,
        "seq_lens": seq_lens,
        "result": result,
    }


def test_one_speculative_round_writes_every_table(world) -> None:
    got = _run_one_round(world)
    rec, runner = world["rec"], world["draft"].draft_runner
    assert rec.disabled == set(), rec.disabled
    rec.close()
    rank = open_trace(world["out"]).rank(0)
    assert rank.errors == []
    assert rank.tables == ["draft_extend", "draft_step", "requests", "target", "verify"]
    keys = [request_key(r) for r in PROMPTS]

    requests = rank.table("requests").step(0)
    assert requests["req"]["req_key"].tolist() == keys
    assert requests["tok"]["prompt_ids"].tolist() == [t for p in PROMPTS.values() for t in p]
    assert bytes(requests["rid"]["bytes"].tolist()) == b"req-areq-b"

    target = rank.table("target")
    assert target.num_steps == 2
    prefill = target.step(0)
    assert prefill["step"]["mode"].tolist() == [0]
    # the target's own prompt ids, not the shifted ids the worker leaves on the batch
    assert prefill["tok"]["input_ids"].tolist() == got["prompt_ids"].tolist()
    assert prefill["tok"]["positions"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert torch.equal(prefill["tok"]["aux_hidden"], got["target_hidden"])

    extend = rank.table("draft_extend")
    assert extend.num_steps == 2
    e0 = extend.step(0)["tok"]
    # exactly what the draft model received in the real _draft_extend_for_prefill
    assert e0["input_ids"].tolist() == runner.calls[0]["input_ids"].tolist()
    assert e0["input_ids"].tolist() == [2, 3, 4, 5, 11, 8, 9, 12]
    assert torch.equal(e0["hidden_in"].float(), runner.calls[0]["hidden_in"])
    last = [4, 7]
    want_draft = got["draft_input"].topk_index.reshape(-1).tolist()
    assert e0["topk_draft_ids"][last, 0].tolist() == want_draft
    assert e0["topk_target_ids"][last, 0].tolist() == [2 * d for d in want_draft]
    want_lp = torch.log(got["draft_input"].topk_p.reshape(-1).float())
    assert torch.allclose(torch.as_tensor(e0["topk_logprobs"][last, 0]), want_lp)
    others = [i for i in range(8) if i not in last]
    assert (e0["topk_draft_ids"][others] == -1).all()

    step = rank.table("draft_step").step(0)
    assert step["step"]["step_index"].tolist() == [1]  # k = 1: step 0 is the draft extend
    assert step["tok"]["input_ids"].tolist() == got["step_fb"].input_ids.tolist()
    assert step["tok"]["hidden_in"].shape[-1] == HIDDEN  # the draft's own hidden, not 3*H
    want = torch.log_softmax(got["step_logits"].float(), -1).argmax(-1)
    assert step["tok"]["topk_draft_ids"][:, 0].tolist() == want.tolist()
    assert step["tok"]["topk_target_ids"][:, 0].tolist() == (2 * want).tolist()

    verify_target = target.step(1)
    assert verify_target["step"]["mode"].tolist() == [1]
    assert verify_target["tok"]["input_ids"].tolist() == got["drafts"].tolist()
    assert verify_target["tok"]["positions"].tolist() == [5, 6, 7, 8, 3, 4, 5, 6]
    assert torch.equal(verify_target["tok"]["aux_hidden"], got["verify_aux"])

    verify = rank.table("verify").step(0)
    assert verify["req"]["accept_len"].tolist() == [2, 0]  # bonus excluded
    assert verify["req"]["bonus_id"].tolist() == [40, 50]
    assert verify["proposed"]["ids"].tolist() == [20, 21, 22, 30, 31, 32]
    assert verify["accepted"]["ids"].tolist() == [20, 21]

    e1 = extend.step(1)["tok"]
    predict = got["result"].next_token_ids
    assert e1["input_ids"].tolist() == predict.tolist() == runner.calls[2]["input_ids"].tolist()
    assert e1["positions"].tolist() == [5, 6, 7, 8, 3, 4, 5, 6]
    assert torch.equal(e1["hidden_in"], got["verify_aux"])
    kept = [2, 4]  # b * ndt + accept_lens[b] - 1
    nxt = got["result"].next_draft_input.topk_index.reshape(-1).tolist()
    assert e1["topk_draft_ids"][kept, 0].tolist() == nxt
    assert e1["topk_target_ids"][kept, 0].tolist() == [2 * d for d in nxt]
    # topk == 1 after a verify: SGLang takes the argmax and never computes a probability
    assert torch.isnan(torch.as_tensor(e1["topk_logprobs"][kept])).all()


def test_a_raising_tap_is_disabled_recorded_and_serving_goes_on(world, monkeypatch) -> None:
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("tap bug")

    monkeypatch.setattr(sglang_taps, "verify_rows", broken)
    got = _run_one_round(world)
    # the wrapped verify still returned SGLang's own result, and serving went on to draft-extend
    assert got["result"].accept_lens.tolist() == [3, 1]
    assert got["result"].next_draft_input.topk_index is not None
    rec = world["rec"]
    assert rec.disabled == {"verify"}
    worker = world["worker"]
    again = worker.verify(
        ScheduleBatch(
            reqs=_prefill_batch().reqs,
            input_ids=got["drafts"],
            forward_mode=ForwardMode.DECODE,
            seq_lens=got["seq_lens"],
            spec_info=_verify_input(got["seq_lens"], got["drafts"]),
        )
    )
    assert again.accept_lens.tolist() == [3, 1]
    assert calls == [1]  # disabled: not called again
    rec.close()
    rank = open_trace(world["out"]).rank(0)
    assert [e["tap"] for e in rank.errors] == ["verify"], rank.errors
    assert "tap bug" in rank.errors[0]["message"]
    assert rank.table("verify") is None
    assert rank.table("draft_extend").num_steps == 2  # the other taps kept recording


def test_requests_rows_hold_sglangs_resolved_sampling_params() -> None:
    """The `requests` row's sampling columns read off SGLang's own `SamplingParams` as its
    `__post_init__` resolved them: temperature 0 becomes SGLang's greedy (1.0 with top_k 1),
    -1 top_k the whole vocabulary; the seed and max_new_tokens under the trace's names."""
    from types import SimpleNamespace

    greedy = SamplingParams(temperature=0.0, max_new_tokens=9, presence_penalty=0.3)
    sampled = SamplingParams(
        temperature=0.8, top_p=0.9, top_k=-1, min_p=0.05, repetition_penalty=1.1, sampling_seed=7
    )
    reqs = [
        SimpleNamespace(rid="g", origin_input_ids=[1, 2], sampling_params=greedy),
        SimpleNamespace(rid="s", origin_input_ids=[3], sampling_params=sampled),
    ]
    w = sglang_taps.requests_rows(SimpleNamespace(reqs=reqs, prefix_lens=[0, 0]), set())
    assert w is not None
    assert w.req["temperature"].tolist() == [1.0, 0.8] and w.req["top_k"].tolist()[0] == 1
    assert w.req["top_k"].tolist()[1] == sampled.top_k > 1  # SGLang's "all"
    assert w.req["max_tokens"].tolist() == [9, sampled.max_new_tokens]
    assert w.req["seed"].tolist() == [-1, 7]
    assert w.req["presence_penalty"].tolist() == [0.3, 0.0]
    assert w.req["min_p"].tolist() == [0.0, 0.05] and w.req["top_p"].tolist() == [1.0, 0.9]
    assert w.req["repetition_penalty"].tolist() == [1.0, 1.1]
