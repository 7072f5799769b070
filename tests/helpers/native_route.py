"""The producer's two routes for a repeated host step (hstrace/trace/process_sink.py): the
native one-call step (hstrace/trace/_native.c, where it is built) and the pure-Python one.
Tests run the same steps through each."""

from __future__ import annotations

import pytest

from hstrace.trace import process_sink

ROUTES = ["native", "python"]


def use_route(monkeypatch: pytest.MonkeyPatch, route: str) -> None:
    """Writers made from here on take `route` (skips the test where the native one is not built
    or has no descriptor queue to publish to)."""
    if route == "native":
        if process_sink._native is None or not process_sink.DESCRIPTORS:
            pytest.skip("the native step is not built here (or no descriptor queue: not x86)")
        monkeypatch.setattr(process_sink, "NATIVE", True)
    else:
        monkeypatch.setattr(process_sink, "NATIVE", False)
