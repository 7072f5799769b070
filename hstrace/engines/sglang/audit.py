"""The static audit of an SGLang EAGLE-3 deployment, as pure functions over plain data.

The hooks (hstrace.hooks.sglang_patches) gather the raw facts inside the scheduler process; the
functions here turn them into the `static` record of the trace and into findings. Nothing here
imports SGLang.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hstrace.engines.load_audit import LoadAuditSpec

# What SGLang's `LlamaForCausalLMEagle3.load_weights` does differently (the audit itself:
# hstrace.engines.load_audit). The embedding is shared from the target (set_embed) — and the
# lm_head too when the draft config has no draft_vocab_size.
LOAD = LoadAuditSpec(
    engine="SGLang",
    default_loader="sglang.srt.model_loader.weight_utils:default_weight_loader",
    special_keys=(("d2t", "hot_token_id"), ("t2d", "ignored by SGLang")),
    fix=(
        "rename the checkpoint keys to SGLang's EAGLE-3 names (fc.*, layers.0.* or midlayer.*, "
        "norm.*, lm_head.*, d2t) — unknown prefixes are dropped silently and the parameters "
        "keep uninitialised memory"
    ),
)


def aux_layer_source(draft_config: Mapping[str, Any]) -> dict[str, Any]:
    """Where the aux layer ids are configured, and whether SGLang will read them.

    SGLang's target reads only `eagle_config.eagle_aux_hidden_state_layer_ids`; a top-level key of
    the same name is ignored by the capture (the target then captures its default layers).
    """
    eagle_config = draft_config.get("eagle_config") or {}
    nested = (
        eagle_config.get("eagle_aux_hidden_state_layer_ids")
        if isinstance(eagle_config, Mapping)
        else None
    )
    top = draft_config.get("eagle_aux_hidden_state_layer_ids")
    use_aux = (
        eagle_config.get("use_aux_hidden_state", True)
        if isinstance(eagle_config, Mapping)
        else True
    )
    if nested is not None:
        source, effective = "eagle_config.eagle_aux_hidden_state_layer_ids", list(nested)
    else:
        source, effective = ("top-level (ignored by SGLang)" if top is not None else "absent"), None
    return {
        "configured": list(nested)
        if nested is not None
        else (list(top) if top is not None else None),
        "source": source,
        "read_by_sglang": effective,
        "top_level_ids": list(top) if top is not None else None,
        "use_aux_hidden_state": bool(use_aux),
    }


def aux_layer_facts(
    source: Mapping[str, Any], layers_to_capture: Sequence[int] | None
) -> list[dict[str, Any]]:
    """The audit fact "aux-ids-ignored" (`hstrace.findings.from_fact` names its code), or none."""
    if source["read_by_sglang"] is None and source["top_level_ids"] is not None:
        return [
            {
                "fact": "aux-ids-ignored",
                "summary": "the drafter's aux layer ids sit at the config's top level, which "
                "SGLang ignores; the target captures its default layers",
                "evidence": {
                    "top_level_ids": source["top_level_ids"],
                    "layers_to_capture": list(layers_to_capture or []),
                },
                "fix": 'move the ids into "eagle_config": {"eagle_aux_hidden_state_layer_ids": '
                "[...]} in the draft config.json",
            }
        ]
    return []


# Where SGLang's targets keep the resolved `layers_to_capture`: on the inner decoder (`self.model`,
# most targets), on the inner language model's decoder or the language model itself (multimodal
# targets that forward the call), or on the object itself.
CAPTURE_HOLDERS = ("model", "language_model.model", "language_model", "")


def captured_layers(target: Any) -> list[int]:
    """The layers a target resolved in `set_eagle3_layers_to_capture` (SGLang's ids, = HF
    hidden_states indices), from the first holder that has any; [] when none has."""
    for path in CAPTURE_HOLDERS:
        obj = target
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part, None)
        ids = getattr(obj, "layers_to_capture", None) if obj is not None else None
        if ids:
            return [int(i) for i in ids]
    return []


def capture_order(layers_to_capture: Sequence[int]) -> list[int]:
    """The order SGLang concatenates captures: layer order (the decoder loop), duplicates once."""
    return sorted(set(layers_to_capture))


def spec_settings(raw: Mapping[str, Any], effective: Mapping[str, Any]) -> dict[str, Any]:
    """Both views of num_steps / topk / num_draft_tokens, and which ones SGLang adjusted."""
    names = ("num_steps", "topk", "num_draft_tokens")
    adjusted = {
        n: {"user": raw.get(n), "effective": effective.get(n)}
        for n in names
        if raw.get(n) is not None and raw.get(n) != effective.get(n)
    }
    return {
        "raw": {n: raw.get(n) for n in names},
        "effective": {n: effective.get(n) for n in names},
        "adjusted": adjusted,
    }


def spec_facts(settings: Mapping[str, Any], label: str = "SGLang") -> list[dict[str, Any]]:
    """The audit fact "spec-adjusted" (`hstrace.findings.from_fact` names its code), or none;
    `label` names the engine that changed them."""
    if not settings["adjusted"]:
        return []
    parts = ", ".join(
        f"{n} {v['user']} -> {v['effective']}" for n, v in settings["adjusted"].items()
    )
    return [
        {
            "fact": "spec-adjusted",
            "summary": f"{label} changed speculative settings: {parts}",
            "evidence": dict(settings["adjusted"]),
        }
    ]


def fc_width(fc_in_features: int, target_hidden_size: int, num_captures: int) -> dict[str, Any]:
    delivered = target_hidden_size * num_captures
    return {
        "fc_in": fc_in_features,
        "target_delivers": delivered,
        "num_captures": num_captures,
        "match": fc_in_features == delivered,
    }


# ---- MTP / NextN heads (`--speculative-algorithm EAGLE` with a MiMo target) --------------------

# SGLang's `MiMoMTP.load_weights` (sglang/srt/models/mimo_mtp.py) gets the whole target
# checkpoint: `model.mtp_layers.{k}.{token_layernorm,hidden_layernorm,input_proj,
# final_layernorm}` map to `model.*`, the rest of `model.mtp_layers.{k}.*` to `model.mtp_block.*`
# (every k onto the one head SGLang builds); embed_tokens and lm_head are loaded, then replaced by
# the target's (`EagleDraftWorker`: `set_embed_and_head`). Every other key is passed over
# without a word; the target's decoder layers and final norm are the target's own.
MTP_LOAD = LoadAuditSpec(
    engine="SGLang",
    default_loader="sglang.srt.model_loader.weight_utils:default_weight_loader",
    special_keys=(),
    fix=(
        "store the MTP layer as model.mtp_layers.0.* (token_layernorm, hidden_layernorm, "
        "input_proj, final_layernorm, and the decoder block's self_attn.*, mlp.*, "
        "input_layernorm, post_attention_layernorm): SGLang's MiMoMTP.load_weights maps only "
        "those names and skips every other key silently"
    ),
    expected_unloaded=(),
    target_key_pattern=r"^model\.(layers\.\d+\.|norm\.)",
)
# What SGLang hands the head at row t (read from sglang 0.5.23): the target's output as its
# LogitsProcessor stores it under CaptureHiddenMode.FULL; `MiMoForCausalLM.forward` passes no
# `hidden_states_before_norm`, so that is the state AFTER the final norm (vLLM hands the MiMo
# head the state before it). Replay decides the state from the numbers, not from this label.
MTP_CAPTURE_CONVENTION = "mtp_target_output"
MTP_CLASSES = ("MiMoMTP",)  # the MTP draft classes hstrace records (sglang/srt/models/)
MTP_HIDDEN_SOURCE = (
    "the target's output as SGLang's LogitsProcessor stores it for EAGLE (CaptureHiddenMode."
    "FULL; MiMoForCausalLM passes no hidden_states_before_norm: after model.norm)"
)


def mtp_record(
    *,
    algorithm: str,
    model_type: str | None,
    architectures: list[str],
    n_predict: int | None,
    num_steps: int,
    draft_class: str,
    target_layers: int,
    parameters: list[str],
) -> dict[str, Any]:
    """The static facts of an SGLang MTP deployment: the algorithm and the resolved draft
    architecture, how many heads the checkpoint declares vs how many draft steps SGLang chains
    (SGLang builds ONE head, `model.mtp_block`, and runs it at every step), the head's
    parameters. The embedding and lm_head are always the target's (`set_embed_and_head`)."""
    return {
        "method": algorithm,
        "model_type": model_type,
        "architectures": architectures,
        "n_predict": n_predict,
        "num_speculative_tokens": num_steps,
        "depths_reuse_head_0": num_steps > 1,
        "draft_class": draft_class,
        "target_layers": target_layers,
        "head_parameters": sorted(parameters),
        "embed_shared_with_target": True,
        "lm_head_shared_with_target": True,
        "hidden_source": MTP_HIDDEN_SOURCE,
    }
