"""The static audit of an SGLang EAGLE-3 deployment, as pure functions over plain data.

The hooks (hstrace.hooks.sglang_patches) gather the raw facts inside the scheduler process; the
functions here turn them into the `static` record of the trace and into findings. Nothing here
imports SGLang.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hstrace.findings import Finding

# Draft parameters that never come from an EAGLE-3 checkpoint in SGLang: the embedding is shared
# from the target (set_embed) — and the lm_head too when the draft config has no draft_vocab_size.
SHARED_FROM_TARGET = ("model.embed_tokens.weight",)


@dataclass
class WeightsAudit:
    """Which checkpoint keys SGLang consumed and which parameters it filled, observed live."""

    checkpoint_keys: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> shape, dtype
    consumed_by: dict[str, list[str]] = field(default_factory=dict)  # key -> params it filled
    special_keys: dict[str, str] = field(
        default_factory=dict
    )  # d2t -> "hot_token_id", t2d -> "ignored"
    parameters: list[str] = field(default_factory=list)
    loaded_parameters: set[str] = field(default_factory=set)
    expected_unloaded: tuple[str, ...] = SHARED_FROM_TARGET

    def dropped_keys(self) -> list[str]:
        return [
            k
            for k in self.checkpoint_keys
            if not self.consumed_by.get(k) and k not in self.special_keys
        ]

    def unloaded_parameters(self) -> list[str]:
        return [
            p
            for p in self.parameters
            if p not in self.loaded_parameters and p not in self.expected_unloaded
        ]

    def to_static(self) -> dict[str, Any]:
        return {
            "checkpoint_keys": {
                k: {
                    **meta,
                    "consumed_into": self.consumed_by.get(k, []),
                    "special": self.special_keys.get(k),
                }
                for k, meta in self.checkpoint_keys.items()
            },
            "parameters": {p: (p in self.loaded_parameters) for p in self.parameters},
            "dropped_keys": self.dropped_keys(),
            "unloaded_parameters": self.unloaded_parameters(),
            "shared_from_target": [p for p in self.expected_unloaded if p in self.parameters],
        }


def weights_findings(audit: WeightsAudit) -> list[Finding]:
    dropped, unloaded = audit.dropped_keys(), audit.unloaded_parameters()
    if not dropped and not unloaded:
        return []
    loadable = [p for p in audit.parameters if p not in audit.expected_unloaded]
    every = bool(loadable) and not any(p in audit.loaded_parameters for p in loadable)
    summary = (
        f"SGLang loaded none of the drafter's parameters from the checkpoint ({len(dropped)} keys dropped)"
        if every
        else f"{len(dropped)} checkpoint keys dropped, {len(unloaded)} drafter parameters never loaded"
    )
    prefixes = sorted({k.split(".")[0] for k in dropped})
    return [
        Finding(
            "weights-dropped",
            summary,
            evidence={
                "dropped_keys": dropped[:50],
                "unloaded_parameters": unloaded[:50],
                "dropped_prefixes": prefixes,
            },
            fix=(
                "rename the checkpoint keys to SGLang's EAGLE-3 names (fc.*, layers.0.* or midlayer.*, norm.*, "
                "lm_head.*, d2t) — unknown prefixes are dropped silently and the parameters keep uninitialised memory"
            ),
        )
    ]


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


def aux_layer_findings(
    source: Mapping[str, Any], layers_to_capture: Sequence[int] | None
) -> list[Finding]:
    if source["read_by_sglang"] is None and source["top_level_ids"] is not None:
        return [
            Finding(
                "aux-layers-default",
                "the drafter's aux layer ids sit at the config's top level, which SGLang ignores; "
                "the target captures its default layers",
                evidence={
                    "top_level_ids": source["top_level_ids"],
                    "layers_to_capture": list(layers_to_capture or []),
                },
                fix='move the ids into "eagle_config": {"eagle_aux_hidden_state_layer_ids": [...]} in the draft config.json',
            )
        ]
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


def spec_findings(settings: Mapping[str, Any]) -> list[Finding]:
    if not settings["adjusted"]:
        return []
    parts = ", ".join(
        f"{n} {v['user']} -> {v['effective']}" for n, v in settings["adjusted"].items()
    )
    return [
        Finding(
            "spec-params-adjusted",
            f"SGLang changed speculative settings: {parts}",
            evidence=dict(settings["adjusted"]),
            fix="pass the effective values explicitly (with topk=1, num_draft_tokens must be num_steps+1)",
            severity="warning",
        )
    ]


def fc_width(fc_in_features: int, target_hidden_size: int, num_captures: int) -> dict[str, Any]:
    delivered = target_hidden_size * num_captures
    return {
        "fc_in": fc_in_features,
        "target_delivers": delivered,
        "num_captures": num_captures,
        "match": fc_in_features == delivered,
    }


def hash_checkpoint_files(
    directory: Path, patterns: Iterable[str] = ("*.safetensors", "*.bin", "*.pt", "config.json")
) -> dict[str, str]:
    """sha256 of each checkpoint file (so a trace names exactly which weights were served)."""
    hashes: dict[str, str] = {}
    for pattern in patterns:
        for path in sorted(directory.glob(pattern)):
            digest = hashlib.sha256()
            with path.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    digest.update(chunk)
            hashes[path.name] = digest.hexdigest()
    return hashes


def read_config_json(directory: Path) -> dict[str, Any]:
    try:
        return json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
