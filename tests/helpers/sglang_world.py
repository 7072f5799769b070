"""Tiny target + EAGLE-3 drafter checkpoints for the SGLang CPU tests (fixed seeds), and builders
of SGLang's real runtime objects shared by those tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, VOCAB, DRAFT_VOCAB, LAYERS = 64, 512, 256, 4


def build_target(directory: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(directory)
    return directory


def build_drafter(
    directory: Path, prefix: str = "midlayer", layer_ids_top_level: bool = False
) -> Path:
    """EAGLE-3 drafter in SGLang/SpecForge key layout; `prefix` names the decoder layer keys."""
    g = torch.Generator().manual_seed(1)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    tensors = {
        "fc.weight": w(HIDDEN, 3 * HIDDEN),
        f"{prefix}.hidden_norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        f"{prefix}.input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        f"{prefix}.self_attn.q_proj.weight": w(HIDDEN, 2 * HIDDEN),
        f"{prefix}.self_attn.k_proj.weight": w(32, 2 * HIDDEN),
        f"{prefix}.self_attn.v_proj.weight": w(32, 2 * HIDDEN),
        f"{prefix}.self_attn.o_proj.weight": w(HIDDEN, HIDDEN),
        f"{prefix}.mlp.gate_proj.weight": w(128, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": w(128, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": w(HIDDEN, 128),
        "norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        "lm_head.weight": w(DRAFT_VOCAB, HIDDEN),
        "d2t": torch.arange(DRAFT_VOCAB, dtype=torch.int64),  # offsets: target id = 2 * draft id
        "t2d": torch.zeros(VOCAB, dtype=torch.bool),
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    ids = [0, 1, 2]
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": HIDDEN,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    if layer_ids_top_level:
        cfg["eagle_aux_hidden_state_layer_ids"] = ids
    else:
        cfg["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": ids,
            "use_aux_hidden_state": True,
        }
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    return directory


# ---- SGLang 0.5.23's REAL runtime objects (import sglang lazily: callers install the fakes
# for CUDA-only imports first) -----------------------------------------------------------------


def publish_runtime() -> None:
    """The process-wide runtime context a scheduler publishes before workers run."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    runtime_context.reset_context()
    runtime_context.publish(
        ServerArgs(model_path="dummy"), role="test", ranks=runtime_context.SpawnRanks(world_rank=0)
    )


def verify_input(seq_lens, draft_tokens, *, num_steps: int, ndt: int):
    """A topk=1 chain of `ndt` draft tokens per request, as `EagleDraftWorker.draft` builds it."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    bs = len(seq_lens)
    chain = torch.arange(ndt)
    return EagleVerifyInput(
        draft_token=draft_tokens,
        custom_mask=torch.ones(bs * ndt * ndt, dtype=torch.bool),
        positions=(seq_lens[:, None] + chain).reshape(-1),
        retrieve_index=(torch.arange(bs)[:, None] * ndt + chain),
        retrieve_next_token=torch.cat([chain[1:], torch.tensor([-1])]).repeat(bs, 1),
        retrieve_next_sibling=torch.full((bs, ndt), -1),
        retrieve_cum_len=None,
        spec_steps=num_steps,
        topk=1,
        draft_token_num=ndt,
        capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=int(seq_lens.sum()),
        seq_lens_cpu=seq_lens,
    )


def draft_worker(hot_token_id, draft_runner, *, num_steps: int, ndt: int, **extra):
    """`EagleDraftWorker` built without `__init__` (which allocates CUDA pools): the fields its
    topk=1 extend / draft / decode-extend paths read on CPU, plus `extra`."""
    import contextlib

    from sglang.srt.speculative import eagle_worker_v2
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    draft = eagle_worker_v2.EagleDraftWorker.__new__(eagle_worker_v2.EagleDraftWorker)
    draft.__dict__.update(
        topk=1,
        hot_token_id=hot_token_id,
        speculative_algorithm=SpeculativeAlgorithm.EAGLE3,
        seed_dsa_topk_from_draft_extend=False,
        speculative_num_steps=num_steps,
        speculative_num_draft_tokens=ndt,
        device="cpu",
        plan_stream=None,
        plan_stream_ctx=contextlib.nullcontext(),
        cuda_graph_runner_for_draft_extend=None,
        draft_runner=draft_runner,
        **extra,
    )
    return draft


def target_worker(*, ndt: int):
    """`EAGLEWorkerV2` built without `__init__`: the fields `verify` reads on CPU."""
    import contextlib

    from sglang.srt.speculative import eagle_worker_v2

    worker = eagle_worker_v2.EAGLEWorkerV2.__new__(eagle_worker_v2.EAGLEWorkerV2)
    worker.__dict__.update(
        topk=1,
        speculative_num_draft_tokens=ndt,
        device="cpu",
        plan_stream=None,
        plan_stream_ctx=contextlib.nullcontext(),
        req_to_token_pool=None,
        token_to_kv_pool_allocator=None,
        _target_worker=None,
    )
    return worker


# ---- the live server on CPU (HSTRACE_SGLANG_CPU=1: hooks/sglang_cpu_shim.py) ----------------

WORLD = Path(__file__).resolve().parents[2] / "traces" / "tiny-world"
TESTS = Path(__file__).resolve().parents[1]


def fakes_pythonpath() -> str:
    """PYTHONPATH for a server that runs the named test-only fakes in every process
    (tests/sglang_fakes_site/sitecustomize.py imports them from tests/helpers/)."""
    return os.pathsep.join([str(TESTS / "sglang_fakes_site"), str(TESTS)])


# --mem-fraction-static: on CPU SGLang budgets the KV pool from the host's available memory
# and refuses to start if it fell by more than the fraction while the weights loaded (other
# processes on a shared machine); --max-total-tokens keeps the pool itself small.
LIVE_FLAGS = (
    "--device cpu --attention-backend torch_native --dtype bfloat16 --disable-cuda-graph "
    "--mem-fraction-static 0.15 --max-total-tokens 32768 --host 127.0.0.1"
)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def live_server_cmd(drafter: Path, port: int, extra: str = "", target: Path | None = None) -> str:
    """The EAGLE-3 launch command of the live tests (topk 1, 3 steps, 4 draft tokens)."""
    import sys

    return (
        f"{sys.executable} -m sglang.launch_server --model-path {target or WORLD / 'target'} "
        f"{LIVE_FLAGS} --port {port} --speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path {drafter} --speculative-eagle-topk 1 "
        f"--speculative-num-steps 3 --speculative-num-draft-tokens 4 {extra}"
    ).strip()


def live_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, HSTRACE_SGLANG_CPU="1", HF_HUB_OFFLINE="1", **extra)
    env.pop("HSTRACE_RECORD", None)
    return env


def live_record(
    out: Path,
    server_cmd: str,
    prompts: list[list[int]],
    *,
    max_new_tokens: int = 16,
    env: dict[str, str] | None = None,
    concurrency: int = 1,
):
    """`hstrace record --server-cmd ...` against the live CPU server (a subprocess, as a user
    runs it): the hooks load in SGLang's real processes through the plugin entry point."""
    import json
    import subprocess
    import sys

    prompts_file = out.parent / f"{out.stem}.prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    cmd = [sys.executable, "-m", "hstrace", "record", "--server-cmd", server_cmd]
    cmd += ["--out", str(out), "--prompts", str(prompts_file)]
    cmd += ["--max-new-tokens", str(max_new_tokens), "--startup-timeout", "400"]
    cmd += ["--concurrency", str(concurrency)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env or live_env(), timeout=900)


def live_replay(trace: Path, against: Path, drafter: Path) -> dict:
    import json
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "hstrace", "replay", str(trace), "--against", str(against)]
        + ["--drafter", str(drafter), "--target", str(WORLD / "target"), "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode in (0, 1), res.stderr[-3000:]
    report = json.loads(res.stdout)
    report["_exit_code"] = res.returncode  # 0 no fault, 1 a fault
    return report
