"""The second world's third-party producer (traces/second-world/producer.py), imported once by
path for the tests that record with it (second world, target drift, norm_output replay)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

WORLD = Path(__file__).resolve().parents[2] / "traces" / "second-world"
_NAME = "second_world_producer"


def producer() -> ModuleType:
    """The producer module; registered in sys.modules (its dataclasses look themselves up)."""
    if _NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(_NAME, WORLD / "producer.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = mod
        spec.loader.exec_module(mod)
    return sys.modules[_NAME]
