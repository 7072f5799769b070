"""Serving-engine adapters: one `Engine` per backend (SGLang, vLLM, the CPU reference chain).

The interface lives in `base.py`; adapters load lazily by name so the core never imports an
engine it does not use.
"""

from hstrace.engines.base import (
    ENGINE_NAMES,
    Engine,
    EngineConfig,
    Prompt,
    RecordOptions,
    RecordResult,
    get_engine,
)

__all__ = [
    "ENGINE_NAMES",
    "Engine",
    "EngineConfig",
    "Prompt",
    "RecordOptions",
    "RecordResult",
    "get_engine",
]
