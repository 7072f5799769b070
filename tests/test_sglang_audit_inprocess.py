"""The static audit hooks, in-process against the real SGLang 0.5.23 on CPU.

A world-size-1 gloo process group stands in for NCCL (shared/reference/sglang-internals.md
§8.3); `FakeVllmCustomOps` covers the one CUDA-less import of the rotary embedding. The real
`LlamaForCausalLMEagle3.load_weights`, `LlamaForCausalLM.set_eagle3_layers_to_capture` and
server-argument resolution run, wrapped by `hstrace.hooks.sglang_patches`; the audit lands in a
real trace on disk (or, for the main-process resolution, in the launcher's status file).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="needs sglang==0.5.23 (scripts/sglang-venv.sh)")
pytestmark = pytest.mark.sglang

from helpers import sglang_fakes  # noqa: E402

sglang_fakes.install()

from helpers.sglang_world import build_drafter, build_target  # noqa: E402
from hstrace.hooks import sglang_patches  # noqa: E402
from safetensors.torch import safe_open  # noqa: E402

from hstrace.trace import TraceWriter, create_trace, open_trace  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dist():
    from sglang.srt import runtime_context
    from sglang.srt.distributed import parallel_state
    from sglang.srt.server_args import ServerArgs

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    runtime_context.reset_context()
    runtime_context.publish(
        ServerArgs(model_path="dummy"), role="test", ranks=runtime_context.SpawnRanks(world_rank=0)
    )
    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    runtime_context.get_parallel().override_permanently(world_group=parallel_state._WORLD)
    parallel_state.initialize_model_parallel(backend="gloo")
    yield


@pytest.fixture()
def recorder(tmp_path, monkeypatch):
    out = tmp_path / "audit.zarr"
    create_trace(out, engine={"name": "sglang", "version": "0.5.23"})
    status = tmp_path / "status.jsonl"
    rec = sglang_patches.install(
        (0, 5, 23), {"out": str(out), "streams": [], "status": str(status)}
    )
    rec.writer_factory = lambda rank: TraceWriter(out, rank=rank)
    monkeypatch.setattr(sglang_patches, "REC", rec)
    yield rec, out, status
    rec.close()


def _load_drafter(directory: Path) -> object:
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    cfg = LlamaConfig.from_pretrained(directory)
    model = LlamaForCausalLMEagle3(cfg)
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        model.load_weights((k, f.get_tensor(k)) for k in f.keys())  # noqa: SIM118
    return model


def _static(rec, out: Path) -> dict:
    rec.close()
    return open_trace(out).meta["static"]


@pytest.mark.parametrize("prefix", ["midlayer", "layers.0"])
def test_load_weights_audit_accepted_prefixes(dist, recorder, tmp_path, prefix) -> None:
    rec, out, _ = recorder
    model = _load_drafter(build_drafter(tmp_path / "drafter", prefix=prefix))
    static = _static(rec, out)
    weights = static["weights"]
    assert weights["dropped_keys"] == []
    assert weights["unloaded_parameters"] == []
    assert weights["shared_from_target"] == ["model.embed_tokens.weight"]
    q = weights["checkpoint_keys"][f"{prefix}.self_attn.q_proj.weight"]
    assert q["consumed_into"] == ["model.layers.0.self_attn.qkv_proj.weight"]
    assert weights["checkpoint_keys"]["d2t"]["special"] == "hot_token_id"
    assert static["findings_load"] == []
    # hot_token_id as SGLang derived it from the d2t offsets, and the audit saw the same
    assert static["hot_token_id"]["head"][:4] == model.hot_token_id[:4].tolist() == [0, 2, 4, 6]
    assert static["fc_width"] == {
        "fc_in": 192,
        "target_delivers": 192,
        "num_captures": 3,
        "match": True,
    }


def test_load_weights_audit_wrong_prefix_is_a_finding(dist, recorder, tmp_path) -> None:
    rec, out, _ = recorder
    model = _load_drafter(build_drafter(tmp_path / "drafter", prefix="transformer.layers.0"))
    static = _static(rec, out)
    weights = static["weights"]
    layer_params = [p for p, _ in model.named_parameters() if p.startswith("model.layers.0.")]
    assert sorted(weights["unloaded_parameters"]) == sorted(layer_params)
    assert all(k.startswith("transformer.layers.0.") for k in weights["dropped_keys"])
    prefixed = [k for k in weights["checkpoint_keys"] if k.startswith("transformer.")]
    assert sorted(weights["dropped_keys"]) == sorted(prefixed) and len(prefixed) == 10
    (finding,) = static["findings_load"]
    assert finding["code"] == "weights-dropped"
    assert finding["evidence"]["dropped_prefixes"] == ["transformer"]


def test_load_weights_every_parameter_unloaded(dist, recorder, tmp_path) -> None:
    """A checkpoint whose every key has a prefix SGLang does not know: nothing loads."""
    from safetensors.torch import load_file, save_file

    rec, out, _ = recorder
    directory = build_drafter(tmp_path / "drafter")
    tensors = load_file(str(directory / "model.safetensors"))
    save_file({f"module.{k}": v for k, v in tensors.items()}, str(directory / "model.safetensors"))
    model = _load_drafter(directory)
    static = _static(rec, out)
    expected = sorted(p for p, _ in model.named_parameters() if p != "model.embed_tokens.weight")
    assert sorted(static["weights"]["unloaded_parameters"]) == expected
    (finding,) = static["findings_load"]
    assert finding["code"] == "weights-dropped"
    assert finding["summary"].startswith("SGLang loaded none of the drafter's parameters")
    # SGLang matches d2t by substring, so the offsets still load under the unknown prefix
    assert static["weights"]["checkpoint_keys"]["module.d2t"]["special"] == "hot_token_id"
    assert model.hot_token_id is not None


@pytest.mark.parametrize(
    ("layer_ids", "resolved"),
    [(None, [2, 2, 1]), ([0, 1, 2], [1, 2, 3]), ([-1, 1, 2], [0, 2, 3])],
)
def test_set_eagle3_layers_to_capture_conventions(
    dist, recorder, tmp_path, layer_ids, resolved
) -> None:
    from sglang.srt.models.llama import LlamaForCausalLM
    from transformers import LlamaConfig

    rec, out, _ = recorder
    target = LlamaForCausalLM(LlamaConfig.from_pretrained(build_target(tmp_path / "target")))
    target.set_eagle3_layers_to_capture(layer_ids)
    assert target.model.layers_to_capture == resolved  # SGLang's own resolution
    capture = _static(rec, out)["capture"]
    assert capture["layer_ids_passed"] == layer_ids
    assert capture["layers_to_capture"] == resolved
    assert capture["capture_order"] == sorted(set(resolved))
    assert capture["num_captures"] == len(set(resolved))  # L=4 default: [2, 2, 1] -> 2 captures


def test_set_eagle3_layers_to_capture_on_a_qwen3_target(dist, recorder, tmp_path) -> None:
    """A Qwen3 target served by SGLang records its capture audit too (issue 23: it recorded
    `layers_to_capture: []` while SGLang captured three layers)."""
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from transformers import Qwen3Config

    rec, out, _ = recorder
    cfg = Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
    )
    target = Qwen3ForCausalLM(cfg)
    assert "__hstrace_wrapped__" in dir(Qwen3ForCausalLM.set_eagle3_layers_to_capture)
    target.set_eagle3_layers_to_capture([1, 3, 4])
    assert target.model.layers_to_capture == [2, 4, 5]  # SGLang's own resolution (+1)
    capture = _static(rec, out)["capture"]
    assert capture["target_class"] == "Qwen3ForCausalLM"
    assert capture["layer_ids_passed"] == [1, 3, 4]
    assert capture["layers_to_capture"] == [2, 4, 5] and capture["num_captures"] == 3
    assert rec.capture_layers == [2, 4, 5]


def test_topk1_num_draft_tokens_adjustment_is_captured(dist, recorder, tmp_path) -> None:
    from sglang.srt.server_args import prepare_server_args

    rec, out, status = recorder
    target = build_target(tmp_path / "target")
    drafter = build_drafter(tmp_path / "drafter")
    args = prepare_server_args(
        [
            "--model-path",
            str(target),
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            str(drafter),
            "--speculative-num-steps",
            "3",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "8",
            "--device",
            "cpu",
        ]
    )
    args.resolve_once()
    lines = [json.loads(x) for x in status.read_text().splitlines()]
    (entry,) = [x for x in lines if "static" in x]
    spec = entry["static"]["spec_resolution"]
    assert spec["raw"] == {"num_steps": 3, "topk": 1, "num_draft_tokens": 8}
    assert spec["effective"] == {"num_steps": 3, "topk": 1, "num_draft_tokens": 4}
    assert spec["adjusted"] == {"num_draft_tokens": {"user": 8, "effective": 4}}
    (finding,) = entry["static"]["findings_spec_resolution"]
    assert finding["code"] == "spec-params-adjusted"
    args.resolve_once()  # already resolved (as in every spawned scheduler): no second record
    assert len([x for x in status.read_text().splitlines() if '"static"' in x]) == 1
