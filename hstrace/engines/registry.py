"""The one registry of engines: name -> the `EngineSpec` of its package, loaded lazily (the
core imports without SGLang, vLLM or transformers; a spec imports no engine).

Adding an engine is one line here and one package (docs/architecture.md, "Adding an engine").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from hstrace.errors import EngineError

if TYPE_CHECKING:
    from hstrace.engines.base import Engine, EngineConfig
    from hstrace.engines.spec import EngineSpec

# name -> "package:SPEC"
ENGINES: dict[str, str] = {
    "sglang": "hstrace.engines.sglang:SPEC",
    "vllm": "hstrace.engines.vllm:SPEC",
    "reference": "hstrace.engines.reference:SPEC",
}


def names() -> tuple[str, ...]:
    return tuple(ENGINES)


def _load(path: str) -> object:
    module_name, attr = path.split(":")
    return getattr(importlib.import_module(module_name), attr)


def engine_spec(name: str) -> EngineSpec:
    """The spec of engine `name`; an `EngineError` (one line) for a name the registry lacks."""
    if name not in ENGINES:
        raise EngineError(f"unknown engine {name!r}; choose one of: {', '.join(ENGINES)}")
    return _load(ENGINES[name])  # type: ignore[return-value]


def specs() -> list[EngineSpec]:
    return [engine_spec(n) for n in ENGINES]


def judged() -> list[EngineSpec]:
    """The serving engines `hstrace check` judges drafters for (registry order)."""
    return [s for s in specs() if s.judged]


def hooked() -> list[EngineSpec]:
    """The engines with hooks (a patch table and a patches module)."""
    return [s for s in specs() if s.support is not None and s.patches is not None]


def get_engine(name: str, config: EngineConfig) -> Engine:
    """The adapter (`Engine`) of engine `name`, built with `config`."""
    spec = engine_spec(name)
    module_name, class_name = spec.adapter.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise EngineError(f"engine {name!r} is not available in this build") from exc
        raise
    engine_cls: type[Engine] = getattr(module, class_name)
    return engine_cls(config)


def engine_for_command(server_cmd: str) -> str:
    """The engine a server command runs: the first engine with hooks that recognises it, else
    the first engine with hooks (SGLang: its launch commands vary the most)."""
    import shlex

    try:
        argv = shlex.split(server_cmd)
    except ValueError:
        argv = []
    served = hooked()
    for spec in served:
        if spec.serves(argv):
            return spec.name
    return served[0].name


def prefix_cache_off(name: str | None = None) -> str:
    """How to serve once with the prefix cache off: for engine `name` when it has such a flag,
    else for every engine that has one ("serve once with FLAG (Label) or ...")."""
    if name in ENGINES:
        spec = engine_spec(name)
        if spec.prefix_cache_off:
            return f"serve once with {spec.prefix_cache_off}{spec.prefix_cache_off_note}"
    return " or ".join(
        f"serve once with {s.prefix_cache_off}{s.prefix_cache_off_note} ({s.label})"
        for s in specs()
        if s.prefix_cache_off
    )


def prefix_cache_flags() -> str:
    """Each engine's prefix-cache-off flag, "SGLang --disable-radix-cache / vLLM ..."."""
    return " / ".join(f"{s.label} {s.prefix_cache_off}" for s in specs() if s.prefix_cache_off)


def aux_ids_fixes(hf_ids: list[int]) -> str:
    """What to write for each serving engine so that it captures HF hidden_states `hf_ids`."""
    return "; ".join(s.aux_ids_fix(hf_ids) for s in judged())
