"""Shared fixtures. Being here also puts tests/ on sys.path (pytest's rootdir conftest), so
`helpers.*` imports from any test module, in tests/ or below it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def saturated_encoders(monkeypatch) -> None:
    """Every encoding thread busy with a chunk waiting, as on a host where the codec is the
    writer's bound: the only state in which a writer that is behind stores chunks raw
    (rowlog.Encoder.encoders_busy). Tests of the raw path ask for it rather than hope a
    burst outruns the encoders."""
    from hstrace.trace.write import rowlog

    monkeypatch.setattr(rowlog.Encoder, "encoders_busy", lambda self: True)


@pytest.fixture(scope="session")
def demo_trace(tmp_path_factory) -> Any:
    """`demo_trace(**kwargs)` -> a trace written by `helpers.demo_trace.write_demo_trace`, once
    per session for each set of arguments (read-only: copy it before changing it)."""
    from helpers.demo_trace import write_demo_trace

    made: dict[tuple, Path] = {}

    def make(**kwargs: Any) -> Path:
        key = tuple(sorted(kwargs.items()))
        if key not in made:
            made[key] = write_demo_trace(tmp_path_factory.mktemp("demo") / "demo.zarr", **kwargs)
        return made[key]

    return make


# `pytester`: tests/conformance/test_stores.py runs a producer's StoreConformance subclass
# the way an out-of-tree project would.
pytest_plugins = ["pytester"]
