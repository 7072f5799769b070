"""The static audit of a vLLM EAGLE-3 deployment, as pure functions over plain data.

The hooks (hstrace.hooks.vllm_patches) gather the raw facts inside the worker process; the
functions here turn them into the trace's `static` record. Nothing here imports vLLM. The
load_weights audit is shared with SGLang (hstrace.engines.load_audit); `LOAD` says what vLLM's
loader does differently.

vLLM's conventions (0.32.0, V1 runner; shared/reference/vllm-internals.md §2):
- aux layer id k = the input of decoder layer k = HF `hidden_states[k]` (no +1; SGLang adds 1);
- ids come from the draft config's top-level `eagle_aux_hidden_state_layer_ids`, else
  `eagle_config["eagle_aux_hidden_state_layer_ids"]`, else the default `(2, N//2, N-3)`;
  they are sorted and de-duplicated, so slots follow layer order, not the config's order;
- a speculators-format config without `norm_before_residual` is served with True
  (`update_eagle3`); a SpecForge-format one is read as False (`getattr(..., False)`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hstrace.engines.load_audit import LoadAuditSpec

CAPTURE_CONVENTION = "before_layer: id k = input of decoder layer k = HF hidden_states[k]"
# What vLLM's `Eagle3LlamaForCausalLM.load_weights` does differently: it skips t2d and loads d2t
# into `draft_id_to_target_id` through a parameter loader (then it counts as consumed); the
# embedding comes from the target when the checkpoint has none.
LOAD = LoadAuditSpec(
    engine="vLLM",
    default_loader="vllm.model_executor.model_loader.weight_utils:default_weight_loader",
    special_keys=(
        ("t2d", "skipped by vLLM (t2d is not used)"),
        ("d2t", "draft_id_to_target_id (read as offsets)"),
    ),
    fix=(
        "rename the checkpoint keys to what vLLM's Eagle3LlamaForCausalLM.load_weights "
        "maps (speculators layers.0.*, SpecForge midlayer.*, fc.*, norm.*, lm_head.*, "
        "d2t); it prefixes every other key with model. and skips what matches nothing"
    ),
)
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
# What vLLM reads when a flag is absent, per config format (update_eagle3 / model getattr).
VLLM_DEFAULTS: dict[str, dict[str, bool]] = {
    "speculators": {
        "norm_before_residual": True,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
    },
    "flat": {
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
    },
}


def config_format(on_disk: Mapping[str, Any]) -> str:
    """`speculators` (vLLM converts it with update_eagle3) or `flat` (SpecForge / EAGLE)."""
    return (
        "speculators"
        if "speculators_config" in on_disk or "speculators_model_type" in on_disk
        else "flat"
    )


def aux_layer_source(hf_config: Mapping[str, Any], num_target_layers: int | None) -> dict[str, Any]:
    """Where vLLM reads the aux layer ids (the served draft config, after format conversion),
    mirroring `GPUModelRunner._get_eagle3_aux_layers_from_config`."""
    top = hf_config.get("eagle_aux_hidden_state_layer_ids")
    eagle_config = hf_config.get("eagle_config")
    nested = (
        eagle_config.get("eagle_aux_hidden_state_layer_ids")
        if isinstance(eagle_config, Mapping)
        else None
    )
    if top:
        source, read = "top-level eagle_aux_hidden_state_layer_ids", list(top)
    elif nested:
        source, read = "eagle_config.eagle_aux_hidden_state_layer_ids", list(nested)
    else:
        source, read = "default (2, N//2, N-3)", None
    default = [2, num_target_layers // 2, num_target_layers - 3] if num_target_layers else None
    effective = read if read is not None else default
    return {
        "configured": read,
        "source": source,
        "read_by_vllm": effective,
        "default_ids": default,
        "sorted_ids": sorted(set(effective)) if effective else None,
        "sorted_differs_from_config": bool(effective) and list(effective) != sorted(set(effective)),
        "capture_convention": CAPTURE_CONVENTION,
        # what the same physical layers would be written as for SGLang (it adds 1)
        "sglang_equivalent_ids": [k - 1 for k in sorted(set(effective))] if effective else None,
    }


def norm_flags(on_disk: Mapping[str, Any], served: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each norm flag as vLLM serves it, and where that value came from."""
    fmt = config_format(on_disk)
    nested = on_disk.get("eagle_config") if isinstance(on_disk.get("eagle_config"), Mapping) else {}
    out: dict[str, dict[str, Any]] = {}
    for flag in NORM_FLAGS:
        if flag in on_disk:
            source = f"config:{flag}"
        elif flag in (nested or {}):
            source = f"config:eagle_config.{flag}"
        else:
            reader = "update_eagle3" if fmt == "speculators" else "model default"
            source = f"default:vllm ({reader}, absent from config.json)"
        value = served.get(flag, VLLM_DEFAULTS[fmt][flag])
        out[flag] = {"value": bool(value), "source": source}
    return out


def d2t_summary(d2t: Sequence[int] | None, draft_vocab: int, target_vocab: int) -> dict[str, Any]:
    """vLLM reads d2t as offsets: target id = i + d2t[i] (`compute_logits`)."""
    if d2t is None:
        return {"present": False, "draft_vocab": draft_vocab, "target_vocab": target_vocab}
    values = list(d2t)
    mapped = [i + v for i, v in enumerate(values)]
    return {
        "present": True,
        "read_as": "offsets (target = i + d2t[i])",
        "size": len(values),
        "head": values[:16],
        "mapped_head": mapped[:16],
        "is_zero": not any(values),
        "mapped_in_range": all(0 <= t < target_vocab for t in mapped),
        "mapped_distinct": len(set(mapped)) == len(mapped),
        "draft_vocab": draft_vocab,
        "target_vocab": target_vocab,
    }


def spec_settings(configured: int | None, effective: int) -> dict[str, Any]:
    """The contract's `spec` shape: num_steps = drafter forwards per step, topk 1 (vLLM EAGLE-3
    drafts a chain), num_draft_tokens = K + 1 (the verify width, bonus slot included, as
    SGLang counts it)."""
    eff = {"num_steps": effective, "topk": 1, "num_draft_tokens": effective + 1}
    raw = dict(eff)
    if configured is not None:
        raw = {"num_steps": configured, "topk": 1, "num_draft_tokens": configured + 1}
    adjusted = {n: {"user": raw[n], "effective": eff[n]} for n in eff if raw[n] != eff[n]}
    return {**eff, "raw": raw, "effective": eff, "adjusted": adjusted}


def acceptance_setting(
    method: str | None, rates: Sequence[float] | None, length: float | None
) -> dict[str, Any]:
    """`rejection_sample_method: synthetic` accepts drafts at a set rate whatever the drafter
    proposes: every acceptance number of such a run is simulated."""
    return {
        "rejection_sample_method": method or "standard",
        "simulated": method == "synthetic",
        "synthetic_acceptance_rates": list(rates) if rates is not None else None,
        "synthetic_acceptance_length": length,
    }


def configured_speculative_tokens(on_disk: Mapping[str, Any]) -> int | None:
    """What a speculators config asks for (`proposal_methods[0].speculative_tokens`)."""
    methods = (on_disk.get("speculators_config") or {}).get("proposal_methods") or []
    if methods and isinstance(methods[0], Mapping):
        value = methods[0].get("speculative_tokens")
        return int(value) if isinstance(value, int) else None
    return None


def capture_record(layer_ids: Sequence[int], source: Mapping[str, Any]) -> dict[str, Any]:
    """The contract's `capture` item: `layers_to_capture` as HF hidden_states indices."""
    ids = sorted(set(int(i) for i in layer_ids))
    return {
        "layers_to_capture": ids,
        "capture_order": ids,
        "num_captures": len(ids),
        "layer_ids_source": source.get("source"),
        "capture_convention": CAPTURE_CONVENTION,
    }


def vocab_shard(layer: Any) -> dict[str, Any] | None:
    """Which rows of a vocab-parallel layer (vLLM's `VocabParallelEmbedding` / `ParallelLMHead`,
    read by attribute, nothing imported) this rank holds: `[vocab_start, vocab_end)` of the
    vocabulary, the rank and group size, the padded size and the local weight's shape. None
    for a layer that is not vocab-parallel."""
    idx = getattr(layer, "shard_indices", None)
    if idx is None:
        return None
    weight = getattr(layer, "weight", None)
    return {
        "tp_rank": int(getattr(layer, "tp_rank", 0)),
        "tp_size": int(getattr(layer, "tp_size", 1)),
        "vocab_start": int(idx.org_vocab_start_index),
        "vocab_end": int(idx.org_vocab_end_index),
        "num_embeddings": int(getattr(layer, "org_vocab_size", 0) or 0),
        "num_embeddings_padded": int(getattr(layer, "num_embeddings_padded", 0) or 0),
        "local_weight_shape": list(weight.shape) if weight is not None else None,
    }


def tp_record(rank: int, size: int, embed: Any, head: Any) -> dict[str, Any]:
    """The static audit's `tp` item of one rank: its place in the tensor-parallel group and
    which shard of the drafter's embedding and head it holds (`vocab_shard`)."""
    return {
        "rank": rank,
        "size": size,
        "embed_tokens": vocab_shard(embed) if embed is not None else None,
        "lm_head": vocab_shard(head) if head is not None else None,
    }


# ---- MTP heads (`method: mtp`) ---------------------------------------------------------------

MTP_CAPTURE_CONVENTION = (
    "mtp: the target model's forward output, as vLLM hands it to the head "
    "(MiMoForCausalLM: hidden + residual before model.norm; the norm is applied in compute_logits)"
)
# vLLM's `MiMoMTP.load_weights` gets the whole target checkpoint and keeps only keys containing
# `mtp_layers`, `embed_tokens` or `lm_head` (renamed by its WeightsMapper); every other key is
# passed over without a word. The target's decoder layers and final norm are the target's own;
# any other key the head did not consume is a dropped MTP weight.
MTP_LOAD = LoadAuditSpec(
    engine="vLLM",
    default_loader="vllm.model_executor.model_loader.weight_utils:default_weight_loader",
    special_keys=(),
    fix=(
        "store the MTP layers as model.mtp_layers.{k}.* (token_layernorm, hidden_layernorm, "
        "input_proj, self_attn.*, mlp.*, input_layernorm, post_attention_layernorm, "
        "final_layernorm): vLLM's MiMoMTP.load_weights keeps only keys containing mtp_layers, "
        "embed_tokens or lm_head and skips every other key silently"
    ),
    expected_unloaded=(),
    target_key_pattern=r"^model\.(layers\.\d+\.|norm\.)",
)
SCALE_SUFFIXES = ("scale", "scale_inv", "input_scale", "weight_scale", "k_scale", "v_scale")


def mtp_record(
    *,
    method: str,
    model_type: str | None,
    architectures: list[str],
    n_predict: int | None,
    num_speculative_tokens: int,
    draft_class: str,
    target_class: str,
    target_layers: int,
    parameters: list[str],
    embed_shared: bool,
    head_shared: bool,
) -> dict[str, Any]:
    """The static facts of an MTP deployment: what vLLM resolved, how many heads it has vs how
    many drafts it chains (a head index past `n_predict` reuses head 0: vLLM's proposer never
    passes `spec_step_idx`), which parameters are quantization scales, shared embedding/head."""
    reuse = n_predict is not None and num_speculative_tokens > 1
    return {
        "method": method,
        "model_type": model_type,
        "architectures": architectures,
        "n_predict": n_predict,
        "num_speculative_tokens": num_speculative_tokens,
        "depths_reuse_head_0": reuse,
        "draft_class": draft_class,
        "target_class": target_class,
        "target_layers": target_layers,
        "head_layer_ids": sorted(
            {int(p.split(".")[2]) for p in parameters if p.startswith("model.mtp_layers.")}
        ),
        "scale_parameters": [p for p in parameters if p.rsplit(".", 1)[-1] in SCALE_SUFFIXES],
        "embed_shared_with_target": embed_shared,
        "lm_head_shared_with_target": head_shared,
        "hidden_source": MTP_CAPTURE_CONVENTION,
    }


INDEX_FILE = "model.safetensors.index.json"


def safetensors_keys(path: Path) -> list[str]:
    """The tensor names in a safetensors file, from its JSON header only (no tensor read)."""
    with path.open("rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if not 0 < n < 1 << 27:
            return []
        header = json.loads(fh.read(n))
    return sorted(k for k in header if k != "__metadata__")


def unread_weight_files(directory: Path) -> dict[str, list[str]]:
    """Safetensors files of a checkpoint that vLLM never opens, with their keys: when
    `model.safetensors.index.json` exists, vLLM loads only the files its `weight_map` names
    (`filter_duplicate_safetensors_files`) and says nothing of the others (an MTP layer saved
    to its own file and not added to the index is never loaded; vLLM 0.32 then refuses to start,
    "Following weights were not initialized from checkpoint", so this names the cause)."""
    index = directory / INDEX_FILE
    if not index.is_file():
        return {}
    try:
        listed = set(json.loads(index.read_text()).get("weight_map", {}).values())
    except (OSError, ValueError, AttributeError):
        return {}
    return {
        p.name: safetensors_keys(p)
        for p in sorted(directory.glob("*.safetensors"))
        if p.name not in listed
    }
