"""The trace store: schema v1, the producer-side writer, and the lazy committed-prefix reader.

Imports are lazy so that the writer process (which needs no torch) and `hstrace --help` stay
light; `from hstrace.trace import TraceWriter` works as usual.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "SCHEMA_VERSION": "hstrace.trace.schema",
    "V1_TABLES": "hstrace.trace.schema",
    "request_key": "hstrace.trace.schema",
    "create_trace": "hstrace.trace.root",
    "TraceWriter": "hstrace.trace.writer",
    "Sink": "hstrace.trace.sink",
    "RecorderSink": "hstrace.trace.sink",
    "MemorySink": "hstrace.trace.sink",
    "ProcessSink": "hstrace.trace.process_sink",
    "open_trace": "hstrace.trace.reader",
    "Trace": "hstrace.trace.reader",
    "RankView": "hstrace.trace.reader",
    "TableView": "hstrace.trace.reader",
    "summarize": "hstrace.trace.summary",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hstrace.trace' has no attribute {name!r}")
