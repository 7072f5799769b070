"""Serving engines: one package per engine (`sglang`, `vllm`, `reference`) behind one interface
(`spec.EngineSpec`, plus the launcher adapter `base.Engine`) and one registry (`registry`).

Adapters and specs load lazily by name so the core never imports an engine it does not use.
"""

from hstrace.engines.base import Engine, EngineConfig, Prompt, RecordOptions, RecordResult
from hstrace.engines.registry import ENGINES, engine_spec, get_engine

__all__ = [
    "ENGINES",
    "Engine",
    "EngineConfig",
    "Prompt",
    "RecordOptions",
    "RecordResult",
    "engine_spec",
    "get_engine",
]
