"""Dialect round trips: save in each dialect, load back (auto-detected), identical logits; the
load report; bad checkpoints -> CheckpointError with one line."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.drafters import tiny_model
from safetensors.torch import load_file, save_file

from hstrace.drafter import Eagle3Drafter, load_drafter, save_drafter
from hstrace.drafter.checkpoint import INPUT_NORM_SOURCE
from hstrace.errors import CheckpointError


def _logits(m: Eagle3Drafter) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    ids, aux = (
        torch.randint(0, 97, (7,), generator=g),
        torch.randn(7, 3 * m.cfg.aux_width, generator=g),
    )
    return [o.logits for o in m.ttt(ids, aux, steps=3)]


@pytest.mark.parametrize(
    "dialect,flags",
    [
        (
            "speculators",
            dict(
                norm_before_residual=True,
                norm_before_fc=True,
                feed_normed=True,
                aux_layer_ids=[2, 16, 29],
            ),
        ),
        ("speculators", dict(fc_norm=True, qk_norm=True, sliding_window=4, num_hidden_layers=2)),
        ("speculators", dict(target_hidden_size=24, rope_theta=500000.0)),
        ("specforge", dict(fc_norm=True, logits_use_norm=False, aux_layer_ids=[1, 15, 28])),
        ("specforge", dict(target_hidden_size=24)),
        ("eagle", dict()),
    ],
)
def test_round_trip_gives_identical_logits(tmp_path, dialect, flags):
    m = tiny_model(**flags)
    save_drafter(m, tmp_path / "ck", dialect=dialect)
    embed = None if dialect == "speculators" else m.embed_tokens.weight.detach()
    m2, rep = load_drafter(tmp_path / "ck", target_embed=embed)
    assert rep.dialect == dialect and rep.dialect_source == "detected"
    assert rep.unmapped == [] and rep.missing == []
    for a, b in zip(_logits(m), _logits(m2), strict=True):
        assert torch.equal(a, b)
    assert m2.cfg.norm_before_residual == m.cfg.norm_before_residual
    assert (
        m2.cfg.feed_normed == m.cfg.feed_normed and m2.cfg.logits_use_norm == m.cfg.logits_use_norm
    )


def test_key_layouts_and_flag_sources(tmp_path):
    m = tiny_model(norm_before_fc=True)
    save_drafter(m, tmp_path / "s", dialect="speculators", dtype=torch.bfloat16)
    keys = set(load_file(str(tmp_path / "s" / "model.safetensors")))
    assert {
        "layers.0.self_attn.q_proj.weight",
        "embed_tokens.weight",
        "input_norm.weight",
        "d2t",
        "t2d",
    } <= keys
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and "transformer_layer_config" in cfg
    _, rep = load_drafter(tmp_path / "s")
    assert rep.key_dtypes["fc.weight"] == "bfloat16" and rep.key_dtypes["d2t"] == "int64"
    assert rep.flags["norm_before_fc"] == (True, "config:norm_before_fc")

    save_drafter(tiny_model(), tmp_path / "f", dialect="specforge")
    keys = set(load_file(str(tmp_path / "f" / "model.safetensors")))
    assert "midlayer.self_attn.q_proj.weight" in keys and "embed_tokens.weight" not in keys
    _, rep = load_drafter(tmp_path / "f")
    assert rep.key_map["midlayer.self_attn.q_proj.weight"] == "layers.0.self_attn.q_proj.weight"
    assert rep.missing == ["embed_tokens.weight"]
    assert rep.flags["logits_use_norm"] == (True, "default:specforge")
    assert rep.flags["norm_before_residual"][1].startswith("default:specforge")


def test_speculators_missing_flag_reports_library_default(tmp_path):
    save_drafter(tiny_model(), tmp_path / "s", dialect="speculators")
    p = tmp_path / "s" / "config.json"
    cfg = json.loads(p.read_text())
    del cfg["norm_before_residual"]
    p.write_text(json.dumps(cfg))
    m, rep = load_drafter(tmp_path / "s")
    assert m.cfg.norm_before_residual is False
    assert rep.flags["norm_before_residual"][1].startswith("default:speculators class default")


def test_absent_norm_before_fc_is_read_from_input_norm_weight(tmp_path):
    """A drafter built with norm_before_fc whose config lost the key: its input_norm.weight
    says it has the norm, and the reference runs it so (same logits as with the key)."""
    m = tiny_model(norm_before_fc=True)
    save_drafter(m, tmp_path / "s", dialect="speculators")
    p = tmp_path / "s" / "config.json"
    cfg = json.loads(p.read_text())
    assert cfg.pop("norm_before_fc") is True
    p.write_text(json.dumps(cfg))
    m2, rep = load_drafter(tmp_path / "s")
    assert m2.cfg.norm_before_fc is True and rep.unmapped == []
    assert rep.key_map["input_norm.weight"] == "input_norm.weight"
    assert rep.flags["norm_before_fc"] == (True, INPUT_NORM_SOURCE)
    assert rep.notes == []  # (notes are fc-width disagreements: the flag's source says it)
    for a, b in zip(_logits(m), _logits(m2), strict=True):
        assert torch.equal(a, b)
    # said explicitly, the config wins: False keeps input_norm.weight unmapped
    cfg["norm_before_fc"] = False
    p.write_text(json.dumps(cfg))
    m3, rep3 = load_drafter(tmp_path / "s")
    assert m3.cfg.norm_before_fc is False and rep3.unmapped == ["input_norm.weight"]


def test_eagle_ignores_config_rope_theta(tmp_path):
    save_drafter(tiny_model(), tmp_path / "e", dialect="eagle")
    p = tmp_path / "e" / "config.json"
    cfg = json.loads(p.read_text())
    cfg["rope_theta"] = 500000.0
    p.write_text(json.dumps(cfg))
    m, rep = load_drafter(tmp_path / "e")
    assert m.cfg.rope_theta == 10000.0 and m.cfg.extra["config_rope_theta"] == 500000.0
    assert rep.weight_file == "pytorch_model.bin"


def test_unmapped_key_is_reported_and_weights_fall_back(tmp_path):
    save_drafter(tiny_model(), tmp_path / "s", dialect="speculators")
    f = tmp_path / "s" / "model.safetensors"
    sd = load_file(str(f))
    sd = {
        k.replace("layers.0.", "transformer.0.") if k.startswith("layers.0.") else k: v
        for k, v in sd.items()
    }
    save_file(sd, str(f))
    _, rep = load_drafter(tmp_path / "s")
    assert "transformer.0.self_attn.q_proj.weight" in rep.unmapped
    assert "layers.0.self_attn.q_proj.weight" in rep.missing


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_bad_checkpoints_raise_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError) as e:
        load_drafter(tmp_path / "nope")
    assert "nope" in _one_line(e)

    save_drafter(tiny_model(), tmp_path / "s", dialect="speculators")
    (tmp_path / "s" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError) as e:
        load_drafter(tmp_path / "s")
    assert "config.json" in _one_line(e)

    save_drafter(tiny_model(), tmp_path / "t", dialect="speculators")
    (tmp_path / "t" / "model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(CheckpointError) as e:
        load_drafter(tmp_path / "t")
    assert "model.safetensors" in _one_line(e)

    save_drafter(tiny_model(), tmp_path / "w", dialect="speculators")
    p = tmp_path / "w" / "config.json"
    cfg = json.loads(p.read_text())
    cfg["transformer_layer_config"]["intermediate_size"] = 50
    p.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        load_drafter(tmp_path / "w")
    assert "mlp" in _one_line(e) and "has shape" in _one_line(e)

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    save_file({"a": torch.zeros(1)}, str(tmp_path / "x" / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_drafter(tmp_path / "x")
    assert "not an EAGLE-3" in _one_line(e)


def test_pickled_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    save_drafter(tiny_model(), tmp_path / "e", dialect="eagle")
    torch.save({"fc.weight": Evil()}, tmp_path / "e" / "pytorch_model.bin")
    with pytest.raises(CheckpointError):
        load_drafter(tmp_path / "e")


def test_lossy_dialect_refused(tmp_path):
    with pytest.raises(CheckpointError, match="norm_before_residual"):
        save_drafter(tiny_model(norm_before_residual=True), tmp_path / "f", dialect="specforge")
