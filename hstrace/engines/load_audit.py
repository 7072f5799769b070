"""The drafter's load_weights audit, one implementation for every engine.

Inside a serving process the engine's `load_weights(self, weights)` is wrapped
(`hstrace.hooks.load_weights.wrap_load_weights`, server-side): each parameter's
`weight_loader` is watched, the checkpoint iterator is tapped, and the result is a
`WeightsAudit` — which checkpoint key filled which parameter, which keys nothing consumed,
which parameters nothing filled. What differs per engine is data
(`LoadAuditSpec`): where its default loader lives, which parameters it fills from the target,
which keys it treats specially (d2t, t2d), and the fix text of the finding. Also here: the
checkpoint facts both engines record (config.json, file hashes). Imports no engine.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Draft parameters that never come from an EAGLE-3 checkpoint in SGLang or vLLM (when the
# checkpoint has none): the embedding is shared from the target.
SHARED_FROM_TARGET = ("model.embed_tokens.weight",)


@dataclass
class WeightsAudit:
    """Which checkpoint keys the engine consumed and which parameters it filled, observed live."""

    checkpoint_keys: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> shape, dtype
    consumed_by: dict[str, list[str]] = field(default_factory=dict)  # key -> params it filled
    special_keys: dict[str, str] = field(default_factory=dict)  # key -> what the engine does
    parameters: list[str] = field(default_factory=list)
    loaded_parameters: set[str] = field(default_factory=set)
    expected_unloaded: tuple[str, ...] = SHARED_FROM_TARGET
    # keys of the target's own layers, passed over by a head that loads from the full target
    # checkpoint (an MTP head): not the head's, never "dropped"
    target_keys: list[str] = field(default_factory=list)

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
            "target_keys_passed_over": len(self.target_keys),
        }


@dataclass(frozen=True)
class LoadAuditSpec:
    """What one engine's load_weights does differently; the bookkeeping is the same."""

    engine: str  # its name in the finding's summary
    default_loader: str  # "module:function": the loader a parameter without one gets
    # (substring of a key, what the engine does with it), first match wins: keys the engine
    # takes without a parameter loader (SGLang: d2t -> hot_token_id) or skips (t2d)
    special_keys: tuple[tuple[str, str], ...]
    fix: str  # the finding's fix: the key names this engine maps
    expected_unloaded: tuple[str, ...] = SHARED_FROM_TARGET
    # regex of the target's own keys in a full checkpoint the head is loaded from (MTP)
    target_key_pattern: str | None = None

    def is_target_key(self, key: str) -> bool:
        return (
            self.target_key_pattern is not None
            and re.match(self.target_key_pattern, key) is not None
        )

    def special(self, key: str) -> str | None:
        return next((what for part, what in self.special_keys if part in key), None)

    def audit(self, parameters: Iterable[str]) -> WeightsAudit:
        return WeightsAudit(parameters=list(parameters), expected_unloaded=self.expected_unloaded)


def weights_facts(wa: WeightsAudit, spec: LoadAuditSpec) -> list[dict[str, Any]]:
    """The load's audit fact "weights-not-loaded" (`hstrace.findings.from_fact` names its code),
    or none."""
    dropped, unloaded = wa.dropped_keys(), wa.unloaded_parameters()
    if not dropped and not unloaded:
        return []
    loadable = [p for p in wa.parameters if p not in wa.expected_unloaded]
    every = bool(loadable) and not any(p in wa.loaded_parameters for p in loadable)
    summary = (
        f"{spec.engine} loaded none of the drafter's parameters from the checkpoint "
        f"({len(dropped)} keys dropped)"
        if every
        else f"{spec.engine} dropped {len(dropped)} checkpoint keys; {len(unloaded)} drafter "
        "parameters were never loaded"
    )
    return [
        {
            "fact": "weights-not-loaded",
            "summary": summary,
            "evidence": {
                "dropped_keys": dropped[:50],
                "unloaded_parameters": unloaded[:50],
                "dropped_prefixes": sorted({k.split(".")[0] for k in dropped}),
            },
            "fix": spec.fix,
        }
    ]


# ---- checkpoint facts both engines record ---------------------------------------------------


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
    """The drafter's config.json as on disk, {} when unreadable (the served config is the
    fallback)."""
    try:
        return json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
