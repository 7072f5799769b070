"""Translate each library's drafter config into a `DrafterConfig`, recording where every flag came
from (written in the config, or the library's default), and back again for saving.

Dialects:
  speculators  nested config (`speculators_model_type: eagle3`, `transformer_layer_config`),
               keys `layers.0.*`, embeddings saved, d2t/t2d only when Vd < V.
  specforge    flat `LlamaForCausalLMEagle3` config (`draft_vocab_size`, `eagle_config`,
               `fc_norm`, `norm_output` = norm before lm_head), keys `midlayer.*`, no embeddings.
  eagle        SafeAILab EAGLE-3: flat config, `pytorch_model.bin`, keys `midlayer.*`; training
               used RoPE base 10000 whatever the config says.
"""

from __future__ import annotations

from typing import Any

from hstrace.drafter.config import DrafterConfig
from hstrace.errors import CheckpointError
from hstrace.training.conventions import BEFORE_LAYER, OUTPUT_OF_LAYER

DIALECTS = ("speculators", "specforge", "eagle")

# Each dialect's own layer-id convention for `aux_layer_ids` (training-formats.md §1): what the
# ids in its config.json count, before HF `hidden_states` indexing (`training.conventions`).
DIALECT_CONVENTION = {
    "speculators": BEFORE_LAYER,
    "specforge": OUTPUT_OF_LAYER,
    "eagle": BEFORE_LAYER,
}

# flag -> (value, source); source is "config:<key>" or "default:<library> ..."
Flags = dict[str, tuple[Any, str]]


# What each config value may be, checked before anything reads it (`check_config_values`):
# `int("64")` and `int(64.5)` would read a string or a fraction as a size, `float("nan")` an eps.
_WHOLE_POSITIVE = (
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "head_dim",
    "max_position_embeddings",
    "num_hidden_layers",
    "draft_vocab_size",
    "target_hidden_size",
    "num_aux_hidden_states",
    "sliding_window",
)
_WHOLE = ("max_window_layers",)
_REAL_POSITIVE = ("rms_norm_eps", "rope_theta")
_FLAGS = (
    "attention_bias",
    "norm_before_fc",
    "fc_norm",
    "norm_before_residual",
    "norm_output",
    "tie_word_embeddings",
    "use_sliding_window",
)
_LAYER_IDS = "eagle_aux_hidden_state_layer_ids"
# A layer id past this is no transformer's (the largest have a few hundred layers).
MAX_LAYER_ID = 4096


def _value_error(where: str, key: str, value: Any, want: str) -> CheckpointError:
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return CheckpointError(f"{where}: {key} is {type(value).__name__} {text}, not {want}")


def check_config_values(cfg: dict[str, Any], where: str, prefix: str = "") -> None:
    """Every known field of one config level (flat, `transformer_layer_config`, `eagle_config`,
    `rope_parameters`) is of its type where present: whole sizes > 0 (not a bool, string or
    fraction), finite positive reals, true/false flags, whole layer ids in [0, MAX_LAYER_ID)."""
    import math

    for key, value in cfg.items():
        if value is None:
            continue
        name = prefix + key
        if key in _WHOLE_POSITIVE or key in _WHOLE:
            low = 1 if key in _WHOLE_POSITIVE else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise _value_error(where, name, value, f"a whole number >= {low}")
        elif key in _REAL_POSITIVE:
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise _value_error(where, name, value, "a finite number > 0")
        elif key in _FLAGS:
            if not isinstance(value, bool):
                raise _value_error(where, name, value, "true or false")
        elif key == _LAYER_IDS:
            if not isinstance(value, list) or not value:
                raise _value_error(where, name, value, "a list of layer ids")
            for i, item in enumerate(value):
                if (
                    isinstance(item, bool)
                    or not isinstance(item, int)
                    or not 0 <= item < MAX_LAYER_ID
                ):
                    raise _value_error(
                        where, f"{name}[{i}]", item, f"a layer id in [0, {MAX_LAYER_ID})"
                    )
        elif key in ("transformer_layer_config", "eagle_config", "rope_parameters"):
            if not isinstance(value, dict):
                raise _value_error(where, name, value, "a JSON object")
            check_config_values(value, where, f"{name}.")


def _get(
    cfg: dict[str, Any],
    key: str,
    default: Any,
    library: str,
    flags: Flags,
    name: str,
    prefix: str = "",
) -> Any:
    if key in cfg and cfg[key] is not None:
        flags[name] = (cfg[key], f"config:{prefix}{key}")
        return cfg[key]
    flags[name] = (default, f"default:{library}")
    return default


def _rope(cfg: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """transformers v5 `rope_parameters` or v4 `rope_theta` + `rope_scaling`."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict):
        theta = rp.get("rope_theta")
        kind = rp.get("rope_type", "default")
        return theta, (None if kind == "default" else dict(rp))
    return cfg.get("rope_theta"), cfg.get("rope_scaling")


def _sizes(tl: dict[str, Any], where: str) -> dict[str, Any]:
    try:
        heads = int(tl["num_attention_heads"])
        return dict(
            hidden_size=int(tl["hidden_size"]),
            vocab_size=int(tl["vocab_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(tl.get("num_key_value_heads") or heads),
            intermediate_size=int(tl["intermediate_size"]),
            head_dim=tl.get("head_dim"),
            rms_norm_eps=float(tl.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(tl.get("max_position_embeddings", 2048)),
            attention_bias=bool(tl.get("attention_bias", False)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: missing or invalid field {exc}") from None


def detect_dialect(config: dict[str, Any], weight_file: str) -> str | None:
    if "speculators_model_type" in config:
        return "speculators"
    archs = config.get("architectures") or []
    if any("Eagle3" in a for a in archs) or "draft_vocab_size" in config:
        return "eagle" if weight_file.endswith(".bin") else "specforge"
    return None


def config_from_speculators(raw: dict[str, Any], where: str) -> tuple[DrafterConfig, Flags]:
    check_config_values(raw, where)
    if raw.get("speculators_model_type") != "eagle3":
        raise CheckpointError(
            f"{where}: speculators_model_type {raw.get('speculators_model_type')!r} is not eagle3"
        )
    tl = raw.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise CheckpointError(f"{where}: speculators config without transformer_layer_config")
    lib, flags = "speculators", {}
    sizes = _sizes(tl, where)
    theta, scaling = _rope(tl)
    flags["rope_theta"] = (
        theta or 10000.0,
        "config:transformer_layer_config.rope" if theta else "default:transformers",
    )
    model_type = tl.get("model_type", "llama")
    if model_type not in ("llama", "qwen3"):
        raise CheckpointError(
            f"{where}: unsupported draft architecture {model_type!r} (llama, qwen3)"
        )
    flags["qk_norm"] = (model_type == "qwen3", "config:transformer_layer_config.model_type")
    n_layers = int(tl.get("num_hidden_layers", 1))
    layer_types, window = tl.get("layer_types"), tl.get("sliding_window")
    if layer_types is None and model_type == "qwen3" and tl.get("use_sliding_window"):
        mwl = int(tl.get("max_window_layers", n_layers))
        layer_types = [
            "sliding_attention" if i >= mwl else "full_attention" for i in range(n_layers)
        ]
    if not layer_types or "sliding_attention" not in layer_types:
        window = None
    flags["sliding_window"] = (
        window,
        "config:transformer_layer_config.layer_types/sliding_window"
        if layer_types
        else "default:full attention",
    )
    ids = _get(raw, "eagle_aux_hidden_state_layer_ids", None, lib, flags, "aux_layer_ids")
    cfg = DrafterConfig(
        **sizes,
        draft_vocab_size=int(
            _get(raw, "draft_vocab_size", 32000, lib + " class default", flags, "draft_vocab_size")
        ),
        target_hidden_size=_get(raw, "target_hidden_size", None, lib, flags, "target_hidden_size"),
        num_aux=len(ids) if ids else 3,
        num_hidden_layers=n_layers,
        rope_theta=float(theta or 10000.0),
        rope_scaling=scaling,
        sliding_window=window,
        layer_types=layer_types if window else None,
        norm_before_fc=bool(_get(raw, "norm_before_fc", False, lib, flags, "norm_before_fc")),
        fc_norm=bool(_get(raw, "fc_norm", False, lib, flags, "fc_norm")),
        # class default False; every drafter trained by speculators' train.py wrote True.
        norm_before_residual=bool(
            _get(
                raw,
                "norm_before_residual",
                False,
                lib + " class default (train.py writes True)",
                flags,
                "norm_before_residual",
            )
        ),
        feed_normed=bool(_get(raw, "norm_output", False, lib, flags, "feed_normed")),
        logits_use_norm=True,
        qk_norm=model_type == "qwen3",
        aux_layer_ids=ids,
        extra={
            "embed_requires_grad": raw.get("embed_requires_grad", False),
            "model_type": model_type,
        },
    )
    flags["logits_use_norm"] = (True, "default:speculators (always norm before lm_head)")
    return cfg, flags


def config_from_flat(raw: dict[str, Any], where: str, dialect: str) -> tuple[DrafterConfig, Flags]:
    """SpecForge and EAGLE: a flat LlamaConfig plus EAGLE-3 fields."""
    check_config_values(raw, where)
    lib, flags = dialect, {}
    sizes = _sizes(raw, where)
    theta, scaling = _rope(raw)
    extra: dict[str, Any] = {
        "config_rope_theta": theta,
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
    }
    if dialect == "eagle":
        # EAGLE-3's trainer builds its rotary embedding with base 10000 whatever the config says.
        flags["rope_theta"] = (10000.0, "default:eagle (training ignores config rope_theta)")
        theta, scaling = 10000.0, None
    else:
        flags["rope_theta"] = (theta or 10000.0, "config:rope" if theta else "default:LlamaConfig")
    eagle_cfg = raw.get("eagle_config") or {}
    ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_cfg, dict) else None
    if ids is not None:
        flags["aux_layer_ids"] = (ids, "config:eagle_config.eagle_aux_hidden_state_layer_ids")
    else:
        ids = _get(raw, "eagle_aux_hidden_state_layer_ids", None, lib, flags, "aux_layer_ids")
    vd = raw.get("draft_vocab_size")
    flags["draft_vocab_size"] = (
        (vd, "config:draft_vocab_size")
        if vd
        else (
            sizes["vocab_size"],
            f"default:{lib} (vocab_size; SGLang then loads the target lm_head)",
        )
    )
    extra["draft_vocab_size_in_config"] = vd is not None
    num_aux = raw.get("num_aux_hidden_states") or (len(ids) if ids else 3)
    nbf = raw.get(
        "norm_before_fc", eagle_cfg.get("norm_before_fc") if isinstance(eagle_cfg, dict) else None
    )
    flags["norm_before_fc"] = (
        (bool(nbf), "config:norm_before_fc")
        if nbf is not None
        else (False, f"default:{lib} (not supported)")
    )
    cfg = DrafterConfig(
        **sizes,
        draft_vocab_size=int(vd or sizes["vocab_size"]),
        target_hidden_size=_get(raw, "target_hidden_size", None, lib, flags, "target_hidden_size"),
        num_aux=int(num_aux),
        num_hidden_layers=int(raw.get("num_hidden_layers", 1)),
        rope_theta=float(theta or 10000.0),
        rope_scaling=scaling,
        norm_before_fc=bool(nbf),
        fc_norm=bool(_get(raw, "fc_norm", False, lib, flags, "fc_norm")),
        norm_before_residual=False,
        feed_normed=False,
        # SpecForge's `norm_output` means "norm before lm_head" (default True).
        logits_use_norm=bool(_get(raw, "norm_output", True, lib, flags, "logits_use_norm")),
        aux_layer_ids=ids,
        extra=extra,
    )
    flags["norm_before_residual"] = (False, f"default:{lib} (not supported)")
    flags["feed_normed"] = (False, f"default:{lib} (always feeds the pre-norm state back)")
    flags["sliding_window"] = (None, f"default:{lib} (full attention)")
    flags["qk_norm"] = (False, f"default:{lib} (Llama layer)")
    return cfg, flags


def _rope_fields(cfg: DrafterConfig) -> dict[str, Any]:
    return {"rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling}


def _layer_fields(cfg: DrafterConfig) -> dict[str, Any]:
    return {
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "intermediate_size": cfg.intermediate_size,
        "head_dim": cfg.hd,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        **_rope_fields(cfg),
    }


def speculators_config(cfg: DrafterConfig, dtype: str) -> dict[str, Any]:
    model_type = "qwen3" if cfg.qk_norm else "llama"
    tl = {
        "model_type": model_type,
        "num_hidden_layers": cfg.num_hidden_layers,
        **_layer_fields(cfg),
    }
    if cfg.sliding_window is not None:
        tl["sliding_window"] = cfg.sliding_window
        tl["layer_types"] = cfg.layer_types or ["sliding_attention"] * cfg.num_hidden_layers
        if model_type == "qwen3":
            tl["use_sliding_window"] = True
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": 3,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": None, "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": tl,
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": cfg.aux_layer_ids,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.feed_normed,
        "embed_requires_grad": False,
        "torch_dtype": dtype,
    }


def flat_config(cfg: DrafterConfig, dtype: str, dialect: str) -> dict[str, Any]:
    lossy = {
        "norm_before_residual": cfg.norm_before_residual,
        "feed_normed (speculators norm_output)": cfg.feed_normed,
        "sliding_window": cfg.sliding_window is not None,
        "qk_norm": cfg.qk_norm,
        "num_hidden_layers > 1": cfg.num_hidden_layers > 1,
    }
    if dialect == "eagle":
        lossy |= {
            "fc_norm": cfg.fc_norm,
            "norm_before_fc": cfg.norm_before_fc,
            "logits without norm": not cfg.logits_use_norm,
        }
        lossy["rope_theta != 10000"] = cfg.rope_theta != 10000.0 or cfg.rope_scaling is not None
    else:
        lossy["norm_before_fc"] = cfg.norm_before_fc
    bad = [k for k, v in lossy.items() if v]
    if bad:
        raise CheckpointError(
            f"the {dialect} dialect cannot express {', '.join(bad)}; save as speculators"
        )
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        **_layer_fields(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "torch_dtype": dtype,
    }
    if dialect == "eagle":  # the hand-written EAGLE-3 config has no rope fields
        out.pop("rope_theta")
        out.pop("rope_scaling")
        return out
    if cfg.target_hidden_size is not None:
        out["target_hidden_size"] = cfg.target_hidden_size
    if cfg.aux_layer_ids is not None:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": cfg.aux_layer_ids}
    elif cfg.num_aux != 3:
        out["num_aux_hidden_states"] = cfg.num_aux
    if cfg.fc_norm:
        out["fc_norm"] = True
    if not cfg.logits_use_norm:  # SpecForge's default (True) is left implicit, as its configs do
        out["norm_output"] = False
    return out
