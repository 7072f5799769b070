"""`hstrace check` on MTP heads in the layouts vLLM 0.32 serves besides MiMo: DeepSeek-V3 and
GLM-4.5 NextN layers inside the target (`model.layers.{num_hidden_layers + k}.*`), Qwen3-Next's
`mtp.*`, and a standalone NextN checkpoint (SGLang's `export_deepseek_nextn.py` layout).

Each checkpoint is written here: small random tensors (fixed seed) under the key names and
config fields of that family, saved with safetensors the way the family's checkpoints are. The
faults are the ones a converter makes (a bias kept, a scale left next to a weight the config
does not quantize, a layer numbered from 1, the layer exported on its own). Every assertion
names keys: which key fills which MTP parameter, and what vLLM's loader does with each
(`hstrace.engines.vllm.mtp_load`, read from vLLM's deepseek_mtp.py / glm4_moe_mtp.py /
qwen3_next_mtp.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers.cli import run_main
from safetensors.torch import save_file

from hstrace.drafter.mtp_checkpoint import load_mtp_head, read_mtp_checkpoint
from hstrace.engines.vllm.mtp_load import (
    BIAS_IGNORED,
    FILTERED,
    LOADED,
    REPLACED,
    SCALE_IGNORED,
    TARGET_HEAD,
    resolve_model_type,
)
from hstrace.errors import CheckpointError

H, V, INTER, HEADS, KV, HD = 16, 64, 32, 2, 1, 8
N_LAYERS = 2  # target decoder layers; the MTP layer of DeepSeek / GLM is model.layers.2


def _t(*shape: int, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)


def write(tmp: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    return tmp


def check(path: Path) -> tuple[int, dict]:
    proc = run_main("check", str(path), "--json")
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def evidence(doc: dict) -> dict:
    return {k: v for f in doc["findings"] for k, v in f["evidence"].items()}


def target_keys(g: torch.Generator, n_layers: int = N_LAYERS) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": _t(V, H, g=g), "lm_head.weight": _t(V, H, g=g)}
    out["model.norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    for i in range(n_layers):  # the target's own layers: never the head's
        out[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        out[f"model.layers.{i}.mlp.down_proj.weight"] = _t(H, INTER, g=g)
    return out


def nextn(prefix: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}enorm.weight": torch.ones(H, dtype=torch.bfloat16),
        f"{prefix}hnorm.weight": torch.ones(H, dtype=torch.bfloat16),
        f"{prefix}eh_proj.weight": _t(H, 2 * H, g=g),
        f"{prefix}shared_head.norm.weight": torch.ones(H, dtype=torch.bfloat16),
        f"{prefix}input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        f"{prefix}post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
    }


def dense_mlp(prefix: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}mlp.gate_proj.weight": _t(INTER, H, g=g),
        f"{prefix}mlp.up_proj.weight": _t(INTER, H, g=g),
        f"{prefix}mlp.down_proj.weight": _t(H, INTER, g=g),
    }


# ---- GLM-4.5 style: a GQA block inside the target -----------------------------------------


GLM_CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "hidden_size": H,
    "vocab_size": V,
    "intermediate_size": INTER,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV,
    "head_dim": HD,
    "num_hidden_layers": N_LAYERS,
    "num_nextn_predict_layers": 1,
    "attention_bias": True,
    "n_routed_experts": None,
    "first_k_dense_replace": 0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def glm_keys(g: torch.Generator) -> dict[str, torch.Tensor]:
    p = f"model.layers.{N_LAYERS}."
    out = {**target_keys(g), **nextn(p, g), **dense_mlp(p, g)}
    out[f"{p}self_attn.q_proj.weight"] = _t(HEADS * HD, H, g=g)
    out[f"{p}self_attn.k_proj.weight"] = _t(KV * HD, H, g=g)
    out[f"{p}self_attn.v_proj.weight"] = _t(KV * HD, H, g=g)
    out[f"{p}self_attn.o_proj.weight"] = _t(H, HEADS * HD, g=g)
    for x, n in (("q", HEADS), ("k", KV), ("v", KV)):
        out[f"{p}self_attn.{x}_proj.bias"] = _t(n * HD, g=g)
    return out


def test_glm_layout_inside_the_target_maps_every_key_and_loads_clean(tmp_path):
    g = torch.Generator().manual_seed(0)
    path = write(tmp_path / "glm", GLM_CONFIG, glm_keys(g))
    rc, doc = check(path)
    assert rc == 0 and doc["findings"] == [], doc["findings"]
    assert doc["vllm_model_type"] == "glm4_moe_mtp"
    rep = doc["load_report"]
    assert rep["layout"] == "deepseek" and rep["layer_prefixes"] == ["model.layers.2."]
    assert rep["n_predict"] == 1 and rep["head_computed"] is True
    assert rep["key_map"]["model.layers.2.eh_proj.weight"] == "layers.0.eh_proj.weight"
    assert rep["key_map"]["model.layers.2.enorm.weight"] == "layers.0.enorm.weight"
    assert rep["key_map"]["model.layers.2.shared_head.norm.weight"] == "layers.0.final_norm.weight"
    assert (
        rep["key_map"]["model.layers.2.self_attn.k_proj.bias"] == "layers.0.self_attn.k_proj.bias"
    )
    assert (rep["embed_source"], rep["head_source"]) == (
        "model.embed_tokens.weight",
        "lm_head.weight",
    )
    fates = doc["vllm_key_fates"]
    # glm4_moe_mtp loads the target's lm_head into shared_head.head, and every NextN key
    assert fates["lm_head.weight"] == LOADED
    assert fates["model.layers.2.eh_proj.weight"] == LOADED
    assert "model.layers.0.mlp.down_proj.weight" not in fates  # the target's own layer
    head, _ = load_mtp_head(path)
    assert head.cfg.concat_order == "embed_first"
    assert torch.equal(
        head.layers[0].eh_proj.weight,
        glm_keys(torch.Generator().manual_seed(0))["model.layers.2.eh_proj.weight"].float(),
    )


def test_glm_scale_next_to_an_unquantized_weight_is_skipped_silently(tmp_path):
    """An FP8 export of the MTP layer whose config declares no quantization: glm4_moe_mtp
    skips `.weight_scale` keys it has no parameter for, and loads the FP8 values unscaled."""
    g = torch.Generator().manual_seed(1)
    keys = glm_keys(g)
    w = keys["model.layers.2.self_attn.o_proj.weight"].float()
    scale = w.abs().max() / 448.0
    keys["model.layers.2.self_attn.o_proj.weight"] = (w / scale).to(torch.float8_e4m3fn)
    keys["model.layers.2.self_attn.o_proj.weight_scale"] = scale.reshape(1).float()
    rc, doc = check(write(tmp_path / "glm", GLM_CONFIG, keys))
    assert rc == 1
    skipped = next(f for f in doc["findings"] if "skipped_keys" in f["evidence"])
    assert skipped["code"] == "weights-dropped"
    assert skipped["evidence"]["skipped_keys"] == ["model.layers.2.self_attn.o_proj.weight_scale"]
    assert skipped["evidence"]["vllm_model_type"] == "glm4_moe_mtp"
    assert doc["vllm_key_fates"]["model.layers.2.self_attn.o_proj.weight_scale"] == SCALE_IGNORED
    assert doc["load_report"]["scales"] == ["model.layers.2.self_attn.o_proj.weight_scale"]


# ---- DeepSeek-V3: MLA attention and an MoE block inside the target -------------------------

DS_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": H,
    "vocab_size": V,
    "intermediate_size": INTER,
    "moe_intermediate_size": INTER,
    "num_experts_per_tok": 1,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "num_hidden_layers": N_LAYERS,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 8,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 4,
    "v_head_dim": 4,
    "n_routed_experts": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "topk_method": "noaux_tc",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def ds_layer(p: str, g: torch.Generator, own_copies: bool = True) -> dict[str, torch.Tensor]:
    out = nextn(p, g)
    a = f"{p}self_attn."
    out[f"{a}q_a_proj.weight"] = _t(8, H, g=g)
    out[f"{a}q_a_layernorm.weight"] = torch.ones(8, dtype=torch.bfloat16)
    out[f"{a}q_b_proj.weight"] = _t(HEADS * 8, 8, g=g)
    out[f"{a}kv_a_proj_with_mqa.weight"] = _t(8 + 4, H, g=g)
    out[f"{a}kv_a_layernorm.weight"] = torch.ones(8, dtype=torch.bfloat16)
    out[f"{a}kv_b_proj.weight"] = _t(HEADS * 8, 8, g=g)
    out[f"{a}o_proj.weight"] = _t(H, HEADS * 4, g=g)
    out[f"{p}mlp.gate.weight"] = _t(2, H, g=g)
    out[f"{p}mlp.gate.e_score_correction_bias"] = torch.zeros(2)
    for e in range(2):
        out.update({k.replace("mlp.", f"mlp.experts.{e}."): v for k, v in dense_mlp(p, g).items()})
    out.update({k.replace("mlp.", "mlp.shared_experts."): v for k, v in dense_mlp(p, g).items()})
    if own_copies:  # DeepSeek-V3 saves the embedding and head again under the MTP layer
        out[f"{p}embed_tokens.weight"] = _t(V, H, g=g)
        out[f"{p}shared_head.head.weight"] = _t(V, H, g=g)
    return out


def test_deepseek_v3_mla_moe_layer_every_key_named(tmp_path):
    g = torch.Generator().manual_seed(2)
    keys = {**target_keys(g), **ds_layer("model.layers.2.", g)}
    keys["model.layers.2.self_attn.rotary_emb.inv_freq"] = torch.ones(2)
    path = write(tmp_path / "ds", DS_CONFIG, keys)
    rc, doc = check(path)
    assert doc["vllm_model_type"] == "deepseek_mtp"
    fates = doc["vllm_key_fates"]
    for rel in (
        "eh_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
        "mlp.gate.weight",
        "mlp.experts.1.down_proj.weight",
        "mlp.shared_experts.up_proj.weight",
        "mlp.gate.e_score_correction_bias",
    ):
        assert fates["model.layers.2." + rel] == LOADED, rel
    # the layer's own embedding / head are loaded, then the proposer shares the target's;
    # the target's lm_head is never read by deepseek_mtp
    assert fates["model.layers.2.shared_head.head.weight"] == REPLACED
    assert fates["model.layers.2.embed_tokens.weight"] == REPLACED
    assert fates["lm_head.weight"] == TARGET_HEAD
    assert fates["model.layers.2.self_attn.rotary_emb.inv_freq"].startswith("skipped")
    assert doc["vllm_parameters_not_filled"] == []
    rep = doc["load_report"]
    assert rep["head_source"] == "model.layers.2.shared_head.head.weight"
    assert rep["embed_source"] == "model.layers.2.embed_tokens.weight"
    assert rep["key_map"]["model.layers.2.self_attn.q_a_proj.weight"] == (
        "layers.0.self_attn.q_a_proj.weight"
    )
    # DeepSeek-V3's own block (MLA + MoE) is the reference's: every parameter is filled
    assert rep["head_computed"] is True and rep["missing"] == []
    # own copies that differ from the target's: vLLM serves the target's, training used these
    assert rc == 1 and [f["code"] for f in doc["findings"]] == ["embed-head-source"]
    assert doc["findings"][0]["evidence"]["own_copies"] == [
        "model.layers.2.embed_tokens.weight",
        "model.layers.2.shared_head.head.weight",
    ]
    head, loaded = load_mtp_head(path)  # replay computes it: MLA + grouped-top-k MoE
    assert head.cfg.mla is not None and head.cfg.moe is not None
    assert "layers.0.self_attn.kv_a_proj_with_mqa.weight" in loaded.loaded
    assert "layers.0.mlp.experts.1.down_proj.weight" in loaded.loaded


def test_deepseek_layout_with_a_dense_gqa_block_stops_vllms_loader(tmp_path):
    """A converter that wrote a Llama-style block in the DeepSeek layout: deepseek_mtp's block
    is MLA, so `k_proj` / `v_proj` have no parameter (a KeyError) and `kv_a_proj_with_mqa`
    is filled by nothing."""
    g = torch.Generator().manual_seed(3)
    p = "model.layers.2."
    keys = {**target_keys(g), **nextn(p, g), **dense_mlp(p, g)}
    for x in "qkvo":
        keys[f"{p}self_attn.{x}_proj.weight"] = _t(H, H, g=g)
    keys[f"{p}shared_head.head.weight"] = keys["lm_head.weight"].clone()
    cfg = dict(DS_CONFIG, q_lora_rank=None, n_routed_experts=None)
    rc, doc = check(write(tmp_path / "ds", cfg, keys))
    assert rc == 1
    stop = next(f for f in doc["findings"] if "unknown_keys" in f["evidence"])
    assert stop["evidence"]["unknown_keys"] == [
        f"{p}self_attn.k_proj.weight",
        f"{p}self_attn.v_proj.weight",
    ]
    assert f"{p}self_attn.kv_a_proj_with_mqa.weight" in stop["evidence"]["parameters_not_filled"]
    assert "deepseek_mtp" in stop["summary"]


# ---- Qwen3-Next: `mtp.*` ---------------------------------------------------------------

QWEN3_NEXT_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": H,
    "vocab_size": V,
    "intermediate_size": INTER,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV,
    "head_dim": HD,
    "num_hidden_layers": N_LAYERS,
    "num_nextn_predict_layers": 1,
    "num_experts": 2,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": INTER,
    "rms_norm_eps": 1e-6,
}


def qwen3_next_keys(g: torch.Generator, layer: int = 0) -> dict[str, torch.Tensor]:
    out = target_keys(g)
    out["mtp.fc.weight"] = _t(H, 2 * H, g=g)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{n}.weight"] = torch.zeros(H, dtype=torch.bfloat16)  # (1 + w) norms
    p = f"mtp.layers.{layer}."
    for n in ("input_layernorm", "post_attention_layernorm"):
        out[f"{p}{n}.weight"] = torch.zeros(H, dtype=torch.bfloat16)
    out[f"{p}self_attn.q_proj.weight"] = _t(2 * HEADS * HD, H, g=g)  # query and its gate
    out[f"{p}self_attn.k_proj.weight"] = _t(KV * HD, H, g=g)
    out[f"{p}self_attn.v_proj.weight"] = _t(KV * HD, H, g=g)
    out[f"{p}self_attn.o_proj.weight"] = _t(H, HEADS * HD, g=g)
    out[f"{p}self_attn.q_norm.weight"] = torch.zeros(HD, dtype=torch.bfloat16)
    out[f"{p}self_attn.k_norm.weight"] = torch.zeros(HD, dtype=torch.bfloat16)
    out[f"{p}mlp.gate.weight"] = _t(2, H, g=g)
    for e in range(2):
        out.update({k.replace("mlp.", f"mlp.experts.{e}."): v for k, v in dense_mlp(p, g).items()})
    out.update({k.replace("mlp.", "mlp.shared_expert."): v for k, v in dense_mlp(p, g).items()})
    out[f"{p}mlp.shared_expert_gate.weight"] = _t(1, H, g=g)
    return out


def test_qwen3_next_mtp_keys_map_and_load_clean(tmp_path):
    path = write(
        tmp_path / "q3n", QWEN3_NEXT_CONFIG, qwen3_next_keys(torch.Generator().manual_seed(4))
    )
    rc, doc = check(path)
    assert rc == 0 and doc["findings"] == [], doc["findings"]
    assert doc["vllm_model_type"] == "qwen3_next_mtp"
    rep = doc["load_report"]
    assert rep["layout"] == "qwen3_next" and rep["layer_prefixes"] == ["mtp.layers.0."]
    km = rep["key_map"]
    assert km["mtp.fc.weight"] == "layers.0.eh_proj.weight"
    assert km["mtp.pre_fc_norm_embedding.weight"] == "layers.0.enorm.weight"
    assert km["mtp.pre_fc_norm_hidden.weight"] == "layers.0.hnorm.weight"
    assert km["mtp.norm.weight"] == "layers.0.final_norm.weight"
    assert km["mtp.layers.0.self_attn.q_norm.weight"] == "layers.0.self_attn.q_norm.weight"
    fates = doc["vllm_key_fates"]
    assert {fates[k] for k in km} == {LOADED}
    assert fates["lm_head.weight"] == LOADED and fates["model.embed_tokens.weight"] == LOADED
    assert rep["head_computed"] is False and "Qwen3-Next" in rep["notes"][-1]


def test_qwen3_next_layer_numbered_from_one_stops_the_load(tmp_path):
    """`mtp.layers.1.*` with num_nextn_predict_layers 1 (a converter counting from 1): the
    ModuleList has layer 0 only, so vLLM stops; layer 0's parameters are filled by nothing."""
    keys = qwen3_next_keys(torch.Generator().manual_seed(5), layer=1)
    rc, doc = check(write(tmp_path / "q3n", QWEN3_NEXT_CONFIG, keys))
    assert rc == 1
    stop = next(f for f in doc["findings"] if "unknown_keys" in f["evidence"])
    assert "mtp.layers.1.self_attn.q_proj.weight" in stop["evidence"]["unknown_keys"]
    assert "mtp.layers.0.self_attn.q_proj.weight" in stop["evidence"]["parameters_not_filled"]


def test_qwen3_next_fc_bias_is_skipped_silently(tmp_path):
    keys = qwen3_next_keys(torch.Generator().manual_seed(6))
    keys["mtp.fc.bias"] = _t(H, g=torch.Generator().manual_seed(7))
    rc, doc = check(write(tmp_path / "q3n", QWEN3_NEXT_CONFIG, keys))
    assert rc == 1
    ev = evidence(doc)
    assert ev["skipped_keys"] == ["mtp.fc.bias"]
    assert doc["vllm_key_fates"]["mtp.fc.bias"] == BIAS_IGNORED
    assert doc["load_report"]["key_map"]["mtp.fc.bias"] == "layers.0.eh_proj.bias"


# ---- a standalone NextN checkpoint ---------------------------------------------------------


def test_standalone_sglang_nextn_export_is_named_and_vllm_would_not_find_it(tmp_path):
    """SGLang's export_deepseek_nextn.py: the layer renamed to `model.layers.0`, config
    num_hidden_layers 1, no embed_tokens / shared_head.head. vLLM's deepseek_mtp reads
    `model.layers.{1 + k}` for such a config: every key is skipped and the load stops."""
    g = torch.Generator().manual_seed(8)
    cfg = dict(DS_CONFIG, num_hidden_layers=1, architectures=["DeepseekV3ForCausalLMNextN"])
    path = write(tmp_path / "nextn", cfg, ds_layer("model.layers.0.", g, own_copies=False))
    rc, doc = check(path)
    rep = doc["load_report"]
    assert rep["standalone"] is True and rep["layer_prefixes"] == ["model.layers.0."]
    assert rep["shared_from_target"] == ["embed_tokens.weight", "lm_head.weight"]
    assert "standalone" in rep["notes"][0]
    assert rep["key_map"]["model.layers.0.eh_proj.weight"] == "layers.0.eh_proj.weight"
    assert rc == 1
    stop = next(f for f in doc["findings"] if "parameters_not_filled" in f["evidence"])
    assert "model.layers.1.eh_proj.weight" in stop["evidence"]["parameters_not_filled"]
    assert "model.layers.0.eh_proj.weight" in stop["evidence"]["skipped_keys"]
    assert doc["vllm_key_fates"]["model.layers.0.eh_proj.weight"] == FILTERED


def test_model_types_follow_vllms_override():
    """`SpeculativeConfig.hf_config_override`: by model_type for DeepSeek / Qwen3-Next, by
    architecture for MiMo and GLM-4.5; a config vLLM serves with no MTP loader: None."""
    assert resolve_model_type({"model_type": "deepseek_v3"}) == "deepseek_mtp"
    assert resolve_model_type({"model_type": "deepseek_mtp"}) == "deepseek_mtp"
    assert resolve_model_type({"architectures": ["Glm4MoeForCausalLM"]}) == "glm4_moe_mtp"
    assert resolve_model_type({"architectures": ["MiMoForCausalLM"]}) == "mimo_mtp"
    assert resolve_model_type({"model_type": "qwen3_next"}) == "qwen3_next_mtp"
    assert (
        resolve_model_type({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}) is None
    )


def test_read_reports_a_head_without_computing_it(tmp_path):
    path = write(
        tmp_path / "q3n", QWEN3_NEXT_CONFIG, qwen3_next_keys(torch.Generator().manual_seed(9))
    )
    head, rep = read_mtp_checkpoint(path)
    assert head is None and rep.missing == [] and "layers.0.eh_proj.weight" in rep.loaded


# ---- a config the reference cannot build a head from: one line, never a traceback ----------


def test_deepseek_null_kv_lora_rank_is_a_checkpoint_error(tmp_path):
    """`"kv_lora_rank": null` (int(None): a TypeError inside the config) is refused in one
    line: `hstrace check` still maps the keys, the replay's loader raises CheckpointError."""
    g = torch.Generator().manual_seed(2)
    keys = {**target_keys(g), **ds_layer("model.layers.2.", g)}
    path = write(tmp_path / "ds", {**DS_CONFIG, "kv_lora_rank": None}, keys)
    head, rep = read_mtp_checkpoint(path)
    assert head is None and rep.head_computed is False
    assert "the DeepSeek block is not in the reference" in rep.notes[-1]
    with pytest.raises(CheckpointError) as err:
        load_mtp_head(path)
    assert "\n" not in str(err.value)
    _, doc = check(path)
    assert doc["load_report"]["head_computed"] is False


def test_glm_config_with_a_field_of_the_wrong_type_is_a_checkpoint_error(tmp_path):
    """The GLM / MiMo path builds the head straight from config.json: a null where a number
    belongs (`"rms_norm_eps": null`, float(None)) is CheckpointError naming the directory."""
    path = write(
        tmp_path / "glm", {**GLM_CONFIG, "rms_norm_eps": None}, glm_keys(torch.Generator())
    )
    with pytest.raises(CheckpointError, match=re.escape(str(path))) as err:
        load_mtp_head(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"n_group": 3}, "n_group 3 equal groups"),
        ({"n_group": 1, "topk_group": 2}, "topk_group 2"),
        ({"scoring_func": "sqrtsoftplus"}, "scoring_func 'sqrtsoftplus'"),
        ({"n_group": 2, "topk_group": 1}, "noaux_tc ranks a group by its two best"),
        ({"num_experts_per_tok": 3}, "num_experts_per_tok 3"),
    ],
)
def test_deepseek_routing_the_router_cannot_run_is_refused(tmp_path, fields, said):
    g = torch.Generator().manual_seed(2)
    keys = {**target_keys(g), **ds_layer("model.layers.2.", g)}
    path = write(tmp_path / "ds", {**DS_CONFIG, **fields}, keys)
    with pytest.raises(CheckpointError, match=said):
        load_mtp_head(path)
