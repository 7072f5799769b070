"""Cross-check: the reference MTP head vs vLLM 0.32's own `mimo_mtp` module, fp32, <= 1e-5.

vLLM builds and runs the head as it serves it: an in-process `vllm.LLM` on the MTP world's
target with `speculative_config={"method": "mtp", "num_speculative_tokens": 2}` (fp32, eager,
V1 engine in this process). A forward hook on vLLM's `MiMoMultiTokenPredictorLayer` (this
test's own tap, nothing in hstrace) keeps what the layer got and returned: the embeddings,
positions and target hidden states of the draft-extend over the prompt (depth 0) and of the
next depth (one row per request, attending the depth-0 KV cache). The reference
`MTPHead`, loaded from the same checkpoint by `load_mtp_head`, runs on the same inputs:
depth 0 by `forward`, depth 1 by `step` fed vLLM's own depth-0 argmax; outputs and logits
agree to 1e-5 and the argmax everywhere.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.vllm_live import MTP_WORLD, NEEDS_VLLM, server_environ

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

import torch  # noqa: E402

from hstrace.drafter.mtp_checkpoint import load_mtp_head  # noqa: E402
from hstrace.training import open_training  # noqa: E402

WORLD = MTP_WORLD
N_PROMPTS, PROMPT_LEN = 2, 24

CHILD = r"""
import sys, torch
from vllm import LLM, SamplingParams
from vllm.model_executor.models import mimo_mtp

calls = []
def tap(mod, args, kwargs, out):
    names = ("inputs_embeds", "positions", "previous_hidden_states")
    got = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    calls.append({k: v.detach().clone() for k, v in got.items()} | {"out": out.detach().clone()})
orig_init = mimo_mtp.MiMoMultiTokenPredictorLayer.__init__
def init(self, *a, **k):
    orig_init(self, *a, **k)
    self.register_forward_hook(tap, with_kwargs=True)
mimo_mtp.MiMoMultiTokenPredictorLayer.__init__ = init

prompts = [list(map(int, p.split(","))) for p in sys.argv[3:]]
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256,
          speculative_config={"method": "mtp", "num_speculative_tokens": 2}, seed=0)
for p in prompts:  # one request at a time: each draft-extend holds one prompt
    llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=2, temperature=0.0))
torch.save(calls, sys.argv[2])
"""


@pytest.fixture(scope="module")
def vllm_calls(tmp_path_factory):
    td = open_training(WORLD / "training")
    prompts = [td[i].input_ids[:PROMPT_LEN].tolist() for i in range(N_PROMPTS)]
    out = tmp_path_factory.mktemp("mtp") / "calls.pt"
    env = server_environ(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    args = [sys.executable, "-c", CHILD, str(WORLD / "target"), str(out)]
    args += [",".join(map(str, p)) for p in prompts]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    calls = torch.load(out, weights_only=True)
    return prompts, calls


@pytest.fixture(scope="module")
def head():
    h, report = load_mtp_head(WORLD / "target")
    assert report.missing == [] and report.unmapped == []
    return h


def _depth0_calls(prompts, calls):
    """The index of each prompt's draft-extend call: positions 0..len-1, in request order
    (vLLM's warm-up calls have other positions)."""
    found: list[int] = []
    for p in prompts:
        want = torch.arange(len(p))
        found.append(
            next(
                i
                for i, c in enumerate(calls)
                if i not in found
                and c["positions"].shape == want.shape
                and torch.equal(c["positions"].cpu(), want)
            )
        )
    return found


def test_depth0_matches_vllms_mimo_mtp_forward(vllm_calls, head):
    prompts, calls = vllm_calls
    for p, i in zip(prompts, _depth0_calls(prompts, calls), strict=True):
        c = calls[i]
        ids = torch.tensor(p[1:] + [0])  # the last row's token is the sampled one: use vLLM's
        embeds = c["inputs_embeds"].float()
        # vLLM's embedding rows are the target's embedding of token t+1 (all but the last row,
        # whose token vLLM sampled): check the pairing, then run on vLLM's own embeddings
        assert torch.equal(embeds[:-1], head.embed_tokens.weight[ids[:-1]])
        ids[-1] = int((head.embed_tokens.weight == embeds[-1]).all(-1).nonzero()[0])
        with torch.no_grad():
            ref = head(ids, c["previous_hidden_states"].float(), c["positions"])
        vllm_out = c["out"].float()
        # mimo_mtp returns final_layernorm(u): the reference's fed-on state (feed_normed)
        torch.testing.assert_close(ref.hidden, vllm_out, atol=1e-5, rtol=1e-5)
        logits = head.lm_head(vllm_out)
        torch.testing.assert_close(ref.logits, logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(ref.logits.argmax(-1), logits.argmax(-1))


def test_vllm_feeds_the_pre_norm_state_the_world_was_trained_on(vllm_calls):
    """The hidden source, seen live: what vLLM hands mimo_mtp for the prompt rows is the
    target's last-layer state before the final norm, the state the training dump holds (bf16
    there, fp32 here), and not the final-normed one."""
    from transformers import Qwen2ForCausalLM

    target = Qwen2ForCausalLM.from_pretrained(WORLD / "target", dtype=torch.float32).eval()
    prompts, calls = vllm_calls
    td = open_training(WORLD / "training")
    for n, (p, i) in enumerate(zip(prompts, _depth0_calls(prompts, calls), strict=True)):
        fed = calls[i]["previous_hidden_states"].float()
        trained = td[n].last[: len(p)].float()
        torch.testing.assert_close(fed, trained, atol=5e-2, rtol=2e-2)
        post = target.model.norm(fed)
        assert (post - trained).abs().max() > 10 * (fed - trained).abs().max()


def test_depth1_matches_vllms_chained_call(vllm_calls, head):
    """vLLM's depth 1 runs MTP layer 0 again on one row per request (position len), fed the
    depth-0 output of the last row and the depth-0 argmax; the reference's `step`."""
    prompts, calls = vllm_calls
    for p, i in zip(prompts, _depth0_calls(prompts, calls), strict=True):
        c0 = calls[i]
        n = len(p)
        c1 = calls[i + 1]
        assert c1["positions"].tolist() == [n]
        ids = torch.tensor(p[1:] + [0])
        ids[-1] = int(
            (head.embed_tokens.weight == c0["inputs_embeds"][-1].float()).all(-1).nonzero()[0]
        )
        with torch.no_grad():
            out0 = head(ids, c0["previous_hidden_states"].float(), c0["positions"])
            draft0 = out0.logits.argmax(-1)
            assert torch.equal(c1["inputs_embeds"].float()[0], head.embed_tokens.weight[draft0[-1]])
            torch.testing.assert_close(
                c1["previous_hidden_states"].float()[0], out0.hidden[-1], atol=1e-5, rtol=1e-5
            )
            out1 = head.step(draft0, out0.hidden, out0.cache)
        torch.testing.assert_close(out1.hidden[-1], c1["out"].float()[0], atol=1e-5, rtol=1e-5)
        assert int(out1.logits[-1].argmax()) == int(head.lm_head(c1["out"].float()[0]).argmax())
