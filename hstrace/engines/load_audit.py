"""The drafter's load_weights audit, one implementation for every engine.

Inside a serving process the engine's `load_weights(self, weights)` is wrapped
(`wrap_load_weights`): each parameter's `weight_loader` is watched, the checkpoint iterator is
tapped, and the result is a `WeightsAudit` — which checkpoint key filled which parameter, which
keys nothing consumed, which parameters nothing filled. What differs per engine is data
(`LoadAuditSpec`): where its default loader lives, which parameters it fills from the target,
which keys it treats specially (d2t, t2d), and the fix text of the finding. Also here: the
checkpoint facts both engines record (config.json, file hashes). Imports no engine.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hstrace.findings import from_fact

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


# ---- the wrapper --------------------------------------------------------------------------

# (recorder, model, audit, its facts): what else an engine records off the loaded model
AfterLoad = Callable[[Any, Any, WeightsAudit, list[dict[str, Any]]], None]


def wrap_load_weights(
    original: Callable,
    recorder: Callable[[], Any],
    spec: LoadAuditSpec,
    after: AfterLoad | None = None,
) -> Callable:
    """`original` (an engine's `load_weights(self, weights)`) with the audit around it: static
    `weights` and `findings_load` once the load returns, then `after` (in the same tap). A
    failure anywhere in the audit disables the `load_weights` tap and never the load."""

    @functools.wraps(original)
    def load_weights(self, weights):
        rec = recorder()
        if rec is None or "load_weights" in rec.disabled:
            return original(self, weights)
        watch = _Watch(spec, dict(self.named_parameters()))
        rec.run_tap("load_weights", watch.install)
        try:
            result = original(self, watch.tapped(weights))
        finally:
            watch.restore()

        def record() -> None:
            wa = watch.finish()
            facts = weights_facts(wa, spec)
            rec.static(
                {
                    "weights": wa.to_static(),
                    "findings_load": [from_fact(f).to_json() for f in facts],
                }
            )
            if after is not None:
                after(rec, self, wa, facts)

        rec.run_tap("load_weights", record)
        return result

    return load_weights


class _Watch:
    """One load: parameter loaders watched, checkpoint tensors tapped.

    A loader call is attributed to the checkpoint key whose tensor it receives (engines that
    collect the iterator first and load afterwards — vLLM — still attribute right), else to the
    key being iterated; the tensors are held until the load ends so their ids stay unique."""

    def __init__(self, spec: LoadAuditSpec, params: dict[str, Any]) -> None:
        self.spec = spec
        self.params = params
        self.wa = spec.audit(params)
        self.name_of = {id(p): n for n, p in params.items()}
        self.key_of: dict[int, str] = {}
        self.current: str | None = None
        self.held: list[Any] = []
        self.saved: list[tuple[Any, Any]] = []

    def install(self) -> None:
        for param in self.params.values():
            loader = getattr(param, "weight_loader", None) or self._default_loader()
            self.saved.append((param, param.__dict__.get("weight_loader")))
            param.weight_loader = self._watched(param, loader)

    def _default_loader(self) -> Callable:
        """The engine's loader for a parameter without its own (what its load_weights uses)."""
        module, _, attr = self.spec.default_loader.partition(":")
        return getattr(importlib.import_module(module), attr)

    def _watched(self, param: Any, loader: Callable) -> Callable:
        wa, name = self.wa, self.name_of[id(param)]

        @functools.wraps(loader)
        def call(*a, **k):
            wa.loaded_parameters.add(name)
            key = self.key_of.get(id(a[1])) if len(a) > 1 else None
            key = key if key is not None else self.current
            if key is not None:
                wa.consumed_by.setdefault(key, []).append(name)
            return loader(*a, **k)

        return call

    def tapped(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        for key, tensor in weights:
            try:
                self.wa.checkpoint_keys[key] = {
                    "shape": list(tensor.shape),
                    "dtype": str(tensor.dtype).removeprefix("torch."),
                }
                self.key_of[id(tensor)] = key
                self.held.append(tensor)
                special = self.spec.special(key)
                if special is not None:
                    self.wa.special_keys[key] = special
            except Exception:  # an odd tensor is not worth a failed load
                pass
            self.current = key
            yield key, tensor
        self.current = None

    def restore(self) -> None:
        for param, loader in self.saved:
            if loader is None:
                param.__dict__.pop("weight_loader", None)
            else:
                param.weight_loader = loader
        self.held.clear()

    def finish(self) -> WeightsAudit:
        # a special key that went through a parameter loader after all (vLLM's d2t, renamed to
        # draft_id_to_target_id) counts as consumed, not special
        for key in [k for k in self.wa.special_keys if self.wa.consumed_by.get(k)]:
            self.wa.special_keys.pop(key)
        return self.wa


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
