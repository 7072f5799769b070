"""The drafter's load_weights audit inside a serving process: the engine's `load_weights(self,
weights)` wrapped (`wrap_load_weights`), each parameter's `weight_loader` watched, the
checkpoint iterator tapped. The result is a `hstrace.engines.load_audit.WeightsAudit` (pure:
which key filled which parameter) with the engine's `LoadAuditSpec` deciding the facts
(`hstrace.findings.from_fact` names their codes).

Patching machinery, so it lives with the hooks; imports no engine.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable
from typing import Any

from hstrace.engines.load_audit import LoadAuditSpec, WeightsAudit, weights_facts
from hstrace.findings import from_fact

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
            if self.spec.is_target_key(key):  # the target's own layer, not the head's
                self.wa.target_keys.append(key)
                yield key, tensor
                continue
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
