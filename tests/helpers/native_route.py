"""The producer's two routes for a repeated host step (hstrace/trace/write/process_sink.py):
the native one-call step (hstrace/trace/write/_native.c, where it is built) and the pure-Python
one. Tests run the same steps through each."""

from __future__ import annotations

import pytest

from hstrace.trace.write import process_sink

ROUTES = ["native", "python"]


def use_route(monkeypatch: pytest.MonkeyPatch, route: str) -> None:
    """Writers made from here on take `route` (skips the test where the native one is not built
    or has no descriptor queue to publish to). The route is HSTRACE_NATIVE, which a ProcessSink
    reads when it is built."""
    if route == "native":
        if process_sink.native_extension() is None or not process_sink.DESCRIPTORS:
            pytest.skip("the native step is not built here (or no descriptor queue: not x86)")
        monkeypatch.setenv("HSTRACE_NATIVE", "1")
        assert process_sink.native_route() is not None
    else:
        monkeypatch.setenv("HSTRACE_NATIVE", "0")
        assert process_sink.native_route() is None
