"""`hstrace check TARGET_DIR` on targets that carry an MTP head, edited the way users break
them (the MTP world's target copied and its safetensors re-saved with keys renamed, a bias
added, a scale dropped; a DeepSeek-style copy with the layer under `model.layers.{N}`).
Each test asserts the keys and parameters named, through the CLI's --json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from helpers.cli import assert_one_line_error, run_main
from safetensors.torch import load_file, save_file

from hstrace.drafter.mtp import MTP_KEYS
from hstrace.drafter.mtp_checkpoint import load_mtp_head
from hstrace.engines.vllm.mtp_load import FILTERED
from hstrace.findings import REGISTRY
from hstrace.rules.mtp import MTP_RULES

WORLD = Path(__file__).resolve().parents[1] / "traces" / "mtp-world"
L0 = "model.mtp_layers.0."


def edited(tmp_path: Path, edit, config_edit=None) -> Path:
    out = tmp_path / "target"
    shutil.copytree(WORLD / "target", out)
    sd = load_file(out / "model.safetensors")
    edit(sd)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    if config_edit is not None:
        cfg = json.loads((out / "config.json").read_text())
        config_edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def check(path: Path) -> tuple[int, dict]:
    proc = run_main("check", str(path), "--json")
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def by_rule(doc: dict) -> dict[str, dict]:
    return {f["summary"]: f for f in doc["findings"]}


def codes(doc: dict) -> list[str]:
    return [f["code"] for f in doc["findings"]]


def test_rules_use_registered_codes_that_name_the_mtp_table():
    for rule in MTP_RULES:
        assert "rules.mtp" in REGISTRY[rule.code].checks, (rule.name, rule.code)


def test_clean_world_target_is_clean_and_every_key_is_named():
    rc, doc = check(WORLD / "target")
    assert rc == 0 and doc["findings"] == [] and doc["exit_code"] == 0
    rep = doc["load_report"]
    assert rep["layout"] == "mimo" and rep["n_predict"] == 1
    assert rep["embed_source"] == "model.embed_tokens.weight"
    assert rep["head_source"] == "lm_head.weight"
    assert rep["key_map"][L0 + "input_proj.weight"] == "layers.0.eh_proj.weight"
    assert set(doc["vllm_key_fates"].values()) == {"loaded"}
    # the layer's 16 keys, and the target's embedding and head the loader also reads
    assert len(doc["vllm_key_fates"]) == 18
    assert doc["vllm_key_fates"]["lm_head.weight"] == "loaded"
    assert doc["vllm_model_type"] == "mimo_mtp"


def test_renamed_layer_key_vllm_skips_and_the_head_misses(tmp_path):
    """A converter wrote `model.mtp.0.input_proj.weight`: vLLM's mimo_mtp filter drops it
    silently (its name has no `mtp_layers`), and input_proj is then filled by nothing."""
    path = edited(
        tmp_path,
        lambda sd: sd.__setitem__(
            "model.mtp.0.input_proj.weight", sd.pop(L0 + "input_proj.weight")
        ),
    )
    rc, doc = check(path)
    assert rc == 1
    assert codes(doc) and set(codes(doc)) == {"weights-dropped"}
    ev = {k: v for f in doc["findings"] for k, v in f["evidence"].items()}
    assert ev["skipped_keys"] == ["model.mtp.0.input_proj.weight"]
    assert ev["why"]["model.mtp.0.input_proj.weight"] == FILTERED
    assert ev["parameters_not_filled"] == [L0 + "input_proj.weight"]
    assert ev["parameters_not_loaded"] == ["layers.0.eh_proj.weight"]
    assert doc["vllm_key_fates"]["model.mtp.0.input_proj.weight"].startswith("skipped silently")


def test_an_added_bias_is_dropped_silently_by_vllm(tmp_path):
    """An `o_proj.bias` (vLLM's Qwen2 block has none): AutoWeightsLoader ignores unexpected
    biases, so vLLM serves without it; the reference head carries it (training saved it)."""
    path = edited(
        tmp_path,
        lambda sd: sd.__setitem__(
            L0 + "self_attn.o_proj.bias", torch.ones(64, dtype=torch.bfloat16)
        ),
    )
    rc, doc = check(path)
    assert rc == 1
    ev = {k: v for f in doc["findings"] for k, v in f["evidence"].items()}
    assert ev["skipped_keys"] == [L0 + "self_attn.o_proj.bias"]
    assert "bias" in ev["why"][L0 + "self_attn.o_proj.bias"]
    assert "unmapped_keys" not in ev
    assert "parameters_not_filled" not in ev or ev["parameters_not_filled"] == []
    rep = doc["load_report"]
    assert rep["key_map"][L0 + "self_attn.o_proj.bias"] == "layers.0.self_attn.o_proj.bias"
    assert rep["added_biases"] == ["layers.0.self_attn.o_proj.bias"]
    head, _ = load_mtp_head(path)
    assert torch.equal(head.layers[0].self_attn.o_proj.bias, torch.ones(64))


def _fp8(sd, keep_scale: bool):
    w = sd[L0 + "input_proj.weight"].float()
    scale = w.abs().max() / 448.0
    sd[L0 + "input_proj.weight"] = (w / scale).to(torch.float8_e4m3fn)
    if keep_scale:
        sd[L0 + "input_proj.weight_scale_inv"] = scale.reshape(1, 1).float()


def test_fp8_weight_with_its_scale_dropped_is_named(tmp_path):
    path = edited(tmp_path, lambda sd: _fp8(sd, keep_scale=False))
    rc, doc = check(path)
    assert rc == 1
    f = next(f for f in doc["findings"] if "weights_without_scale" in f["evidence"])
    assert f["code"] == "weights-dropped"
    assert f["evidence"]["weights_without_scale"] == [L0 + "input_proj.weight"]
    assert doc["load_report"]["key_dtypes"][L0 + "input_proj.weight"] == "F8_E4M3"


def test_fp8_weight_with_its_scale_is_not_called_missing(tmp_path):
    path = edited(tmp_path, lambda sd: _fp8(sd, keep_scale=True))
    _, doc = check(path)
    assert doc["load_report"]["scales"] == [L0 + "input_proj.weight_scale_inv"]
    assert not any("weights_without_scale" in f["evidence"] for f in doc["findings"])


def _as_deepseek(sd, own_head: torch.Tensor | None = None):
    """The world's MTP layer re-saved DeepSeek-style: `model.layers.4.*` with enorm / hnorm /
    eh_proj / shared_head and own copies of the embedding and head."""
    to_ds = {v: k for k, v in MTP_KEYS["deepseek"].items()}
    from_mimo = MTP_KEYS["mimo"]
    for key in [k for k in sd if k.startswith(L0)]:
        rel = key[len(L0) :]
        rel = to_ds.get(from_mimo.get(rel, ""), rel)
        sd["model.layers.4." + rel] = sd.pop(key)
    sd["model.layers.4.embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    head = sd["lm_head.weight"].clone() if own_head is None else own_head
    sd["model.layers.4.shared_head.head.weight"] = head


def _ds_config(cfg):
    # the world's dense block keeps its q/k/v biases (DeepSeek configs say `attention_bias`)
    cfg.update(architectures=["DeepseekV3ForCausalLM"], attention_bias=True)


def test_deepseek_layout_maps_every_nextn_key(tmp_path):
    path = edited(tmp_path, _as_deepseek, _ds_config)
    head, rep = load_mtp_head(path)
    assert rep.layout == "deepseek" and rep.layer_prefixes == ["model.layers.4."]
    assert rep.key_map["model.layers.4.eh_proj.weight"] == "layers.0.eh_proj.weight"
    assert rep.key_map["model.layers.4.shared_head.norm.weight"] == "layers.0.final_norm.weight"
    assert rep.embed_source == "model.layers.4.embed_tokens.weight"
    assert rep.head_source == "model.layers.4.shared_head.head.weight"
    assert rep.missing == [] and rep.unmapped == []
    # vLLM 0.32 deepseek_mtp recycles shared_head.norm(u) into the next depth
    assert head.cfg.concat_order == "embed_first" and head.cfg.feed_normed
    _, doc = check(path)
    assert doc["findings"] == []  # own copies equal the target's


def test_deepseek_own_head_that_differs_is_embed_head_source(tmp_path):
    other = torch.randn(512, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    path = edited(tmp_path, lambda sd: _as_deepseek(sd, own_head=other), _ds_config)
    rc, doc = check(path)
    assert rc == 1 and codes(doc) == ["embed-head-source"]
    ev = doc["findings"][0]["evidence"]
    assert ev["own_copies"] == ["model.layers.4.shared_head.head.weight"]
    assert ev["head_source"] == "model.layers.4.shared_head.head.weight"


def test_a_target_without_mtp_head_is_refused_in_one_line(tmp_path):
    def no_mtp(cfg):
        cfg.update(architectures=["Qwen2ForCausalLM"], num_nextn_predict_layers=0)

    path = edited(
        tmp_path, lambda sd: [sd.pop(k) for k in [k for k in sd if k.startswith(L0)]], no_mtp
    )
    # not an MTP target, so it is read as a drafter, and refused as one
    assert_one_line_error(run_main("check", str(path)), "not an EAGLE-3 drafter config")
