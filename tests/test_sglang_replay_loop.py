"""Record -> replay on CPU: SGLang 0.5.23's real worker code writes the trace, `hstrace replay`
reads it.

The real `EagleDraftWorker._draft_extend_for_prefill` / `draft_forward` /
`_draft_extend_for_decode`, `EAGLEWorkerV2.verify`, `ModelRunner.forward` and
`LlamaForCausalLM.set_eagle3_layers_to_capture` run, patched by `hstrace.hooks.sglang_patches`
as in a server, on the tiny world's tensors: the target's CUDA forward is the HF forward of
`traces/tiny-world/target` (aux captured at SGLang's `layers_to_capture`), the draft model's
attention forward is the reference drafter (`tests/sglang_fakes.py`, named fakes). The prompts
are training samples' token ids, so the trace is what SGLang would have recorded for them.
Replay must find nothing on the clean trace, and the layer shift on the misread one.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from array import array
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang", reason="needs sglang==0.5.23 (scripts/sglang-venv.sh)")
pytestmark = [pytest.mark.sglang, pytest.mark.slow]

sys.path.insert(0, str(Path(__file__).parent))
import sglang_fakes  # noqa: E402

sglang_fakes.install()

import sglang_world  # noqa: E402
import torch  # noqa: E402
from hstrace.hooks import sglang_patches  # noqa: E402
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import (  # noqa: E402
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.models.llama import LlamaForCausalLM  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.speculative import eagle_worker_common, eagle_worker_v2  # noqa: E402
from sglang.srt.speculative.eagle_info import EagleVerifyInput  # noqa: E402

from hstrace.drafter import load_drafter  # noqa: E402
from hstrace.trace import TraceWriter, create_trace, open_trace  # noqa: E402
from hstrace.training import open_training  # noqa: E402

WORLD = Path(__file__).resolve().parents[1] / "traces" / "tiny-world"
TARGET, TRAINING = WORLD / "target", WORLD / "training-specforge"
NUM_STEPS, NDT = 3, 4  # topk = 1: num_draft_tokens = num_steps + 1
SAMPLES, PROMPT_LEN, ROUNDS = (40, 41, 42), 24, 4
STREAMS = ["target", "draft_extend", "draft_step", "verify", "requests"]


@pytest.fixture(scope="module", autouse=True)
def runtime() -> None:
    sglang_world.publish_runtime()


def _layers_to_capture(layer_ids: list[int]) -> list[int]:
    """SGLang's own reading of the drafter's aux ids (the real, patched method)."""
    stub = SimpleNamespace(
        pp_group=SimpleNamespace(is_last_rank=True), config=None, model=SimpleNamespace()
    )
    LlamaForCausalLM.set_eagle3_layers_to_capture(stub, layer_ids)
    return list(stub.model.layers_to_capture)


def _workers(drafter, hot):
    draft = sglang_world.draft_worker(
        hot,
        sglang_fakes.fake_cuda_reference_draft_runner(drafter),
        num_steps=NUM_STEPS,
        ndt=NDT,
        index_share_for_mtp_iteration=False,
        draft_attn_backend=SimpleNamespace(attn_backends=[None] * NUM_STEPS),
        _topk1_parents_prealloc=torch.zeros(64, 0, dtype=torch.long),
        _topk1_score_indices_prealloc=torch.arange(NUM_STEPS).repeat(64, 1),
    )
    worker = sglang_world.target_worker(ndt=NDT)
    return draft, worker


def _verify_input(seq_lens: torch.Tensor, draft_tokens: torch.Tensor) -> EagleVerifyInput:
    return sglang_world.verify_input(seq_lens, draft_tokens, num_steps=NUM_STEPS, ndt=NDT)


def record_sglang(out: Path, drafter_dir: Path, monkeypatch) -> dict:
    """Serve the training samples' prompts through SGLang's worker code; the taps write `out`."""
    fb_cls, _runner_cls, verify_fn = sglang_fakes.fake_cuda_classes(8, 8, 8)
    monkeypatch.setattr(eagle_worker_v2, "ForwardBatch", fb_cls)
    monkeypatch.setattr(eagle_worker_common, "ForwardBatch", fb_cls)
    create_trace(out, engine={"name": "sglang", "version": "0.5.23"})
    rec = sglang_patches.install(
        (0, 5, 23), {"out": str(out), "streams": STREAMS, "on_full": "block"}
    )
    rec.writer_factory = lambda rank: TraceWriter(out, rank=rank, process=False)
    monkeypatch.setattr(sglang_patches, "REC", rec)
    cfg = json.loads((drafter_dir / "config.json").read_text())
    ids = (
        cfg.get("eagle_aux_hidden_state_layer_ids")
        or cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    )
    layers = _layers_to_capture(ids)
    target = sglang_fakes.FakeCudaTargetForward(TARGET, layers)
    drafter, _ = load_drafter(drafter_dir, target_embed=target.embed)  # SGLang's set_embed
    drafter.eval()
    hot = drafter.d2t + torch.arange(drafter.cfg.draft_vocab_size)  # load_weights: d2t + arange
    rec.hot_token_id, rec.spec_topk = hot, 1
    draft, worker = _workers(drafter, hot)

    td = open_training(TRAINING)
    prompts = {f"train:{i}": td[i].input_ids[:PROMPT_LEN].tolist() for i in SAMPLES}
    rids = list(prompts)
    bs = len(rids)
    reqs = [Req(rid, "", array("i", p), SamplingParams()) for rid, p in prompts.items()]
    seqs = {rid: list(p) for rid, p in prompts.items()}  # committed tokens per request

    # prefill: the target over each prompt, then the draft extend
    aux, nxt = [], []
    for rid in rids:
        logits, a = target(seqs[rid])
        aux.append(a)
        nxt.append(int(logits[-1].argmax()))
    lens = [len(seqs[r]) for r in rids]
    batch = ScheduleBatch(
        reqs=reqs,
        input_ids=torch.tensor([t for r in rids for t in seqs[r]]),
        extend_lens=lens,
        prefix_lens=[0] * bs,
        forward_mode=ForwardMode.EXTEND,
        seq_lens=torch.tensor(lens),
        seq_lens_cpu=torch.tensor(lens),
    )
    draft_input = draft._draft_extend_for_prefill(batch, torch.cat(aux), torch.tensor(nxt), None)
    for rid, t in zip(rids, nxt, strict=True):
        seqs[rid].append(t)
    seq_lens = torch.tensor(lens)  # tokens whose KV is cached (the last token is the bonus)

    accept = []
    for _ in range(ROUNDS):
        step_fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=torch.zeros(bs, dtype=torch.long),
            req_pool_indices=torch.arange(bs),
            seq_lens=seq_lens.clone(),
            out_cache_loc=torch.zeros(bs * NUM_STEPS, dtype=torch.int64),
            seq_lens_sum=int(seq_lens.sum()),
            positions=seq_lens.clone().to(torch.int64),
            spec_info=draft_input,
            capture_hidden_mode=CaptureHiddenMode.LAST,
            rids=rids,
        )
        _parents, _idx, chain, _probs = draft.draft_forward(step_fb)  # target-space drafts
        drafts = torch.cat(
            [torch.cat([torch.tensor([seqs[r][-1]]), chain[b]]) for b, r in enumerate(rids)]
        )
        v_logits, v_aux = [], []
        for b, rid in enumerate(rids):
            logits, a = target(seqs[rid] + chain[b].tolist())
            start = int(seq_lens[b])
            v_logits.append(logits[start : start + NDT])
            v_aux.append(a[start : start + NDT])
        decode = ScheduleBatch(
            reqs=reqs,
            input_ids=drafts,
            forward_mode=ForwardMode.DECODE,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens,
            spec_info=_verify_input(seq_lens, drafts),
        )
        decode.model_config = type("FakeModelConfig", (), {"vocab_size": drafter.cfg.vocab_size})()
        monkeypatch.setattr(
            eagle_worker_v2,
            "run_eagle_verify",
            functools.partial(
                verify_fn, target_logits=torch.cat(v_logits), aux_hidden=torch.cat(v_aux)
            ),
        )
        result = worker.verify(decode)
        draft._draft_extend_for_decode(decode, result)
        predict = result.next_token_ids.long().reshape(bs, NDT)
        for b, rid in enumerate(rids):
            n = int(result.accept_lens[b])  # includes the bonus token
            seqs[rid].extend(predict[b, :n].tolist())
            accept.append(n - 1)
        seq_lens = seq_lens + result.accept_lens.long()
        draft_input = result.next_draft_input
    assert rec.disabled == set(), rec.disabled
    rec.close()
    return {"layers": layers, "seqs": seqs, "accept": accept, "runner": draft.draft_runner}


# This loop found four replay-side bugs, fixed in hstrace/replay and hstrace/diagnose (issue 5):
# draft_extend rows without a top-k (id -1) reached `gathered_logprobs`; `diagnose/vocab.py`
# scored them as mismatches (a false `d2t-direct-table`); a SpecForge drafter (no embedding
# saved) was replayed with a random embedding instead of the target's; NaN log-probs (topk == 1
# after a verify) made `within_noise` false. Both tests below guard against their return.


def _replay(trace: Path, drafter_dir: Path) -> dict:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hstrace",
            "replay",
            str(trace),
            "--against",
            str(TRAINING),
            "--drafter",
            str(drafter_dir),
            "--target",
            str(TARGET),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode in (0, 1), result.stderr[-2000:]
    return json.loads(result.stdout)


def test_clean_sglang_trace_replays_to_no_wiring_fault(tmp_path, monkeypatch) -> None:
    drafter_dir = WORLD / "drafter-specforge"
    out = tmp_path / "sglang.zarr"
    got = record_sglang(out, drafter_dir, monkeypatch)
    assert got["layers"] == [2, 4, 5]  # ids [1, 3, 4] read as "output of layer k"
    assert sum(got["accept"]) > 0  # the drafter is trained: some drafts are accepted
    with open_trace(out) as tr:
        rank = tr.rank(0)
        assert rank.errors == []
        assert tr.meta["static"]["capture"]["layers_to_capture"] == [2, 4, 5]
        assert rank.table("verify").num_steps == ROUNDS
        accept = rank.table("verify").column("req", "accept_len")
        assert [int(a) for a in accept] == got["accept"]  # bonus excluded
        target = rank.table("target")
        assert target.column_attrs("tok", "aux_hidden")["layer_ids"] == [2, 4, 5]
        assert target.column_attrs("tok", "aux_hidden")["slot_width"] == 64
        # the draft extend pairs aux row t with token t+1 and the target's own capture
        prefill, extend = target.step(0)["tok"], rank.table("draft_extend").step(0)["tok"]
        seq = got["seqs"]["train:40"]
        n = PROMPT_LEN
        assert extend["input_ids"][:n].tolist() == seq[1 : n + 1]
        assert extend["positions"][:n].tolist() == list(range(n))
        assert torch.equal(extend["hidden_in"][:n], prefill["aux_hidden"][:n])
        steps = rank.table("draft_step")
        assert sorted({int(k) for k in steps.column("step", "step_index")}) == [1, 2]
    report = _replay(out, drafter_dir)
    assert report["verdict"]["code"] == "no-wiring-fault", json.dumps(report, indent=1)[:4000]


def test_layers_shifted_by_one_replay_to_aux_layer_shift(tmp_path, monkeypatch) -> None:
    # The speculators drafter writes its ids "before layer k" ([2, 4, 5]); SGLang adds 1.
    drafter_dir = WORLD / "drafter-speculators"
    out = tmp_path / "shifted.zarr"
    got = record_sglang(out, drafter_dir, monkeypatch)
    assert got["layers"] == [3, 5, 6]
    report = _replay(out, drafter_dir)
    assert report["verdict"]["code"] == "aux-layer-shift", json.dumps(report, indent=1)[:4000]
