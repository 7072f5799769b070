"""The trace store, in two layers.

The format layer (this package's modules): what a reader needs. `schema.py` (names, axes,
versions), `reader.py` (`open_trace`: the lazy committed-prefix reader) over `guard.py` (the
store guard) and `validate.py` (metadata and id checks), `chunkread.py` (the reader's fast
path for hstrace's own chunk layout), `liveshard.py` (where things lie in a shard still being
written), `rows.py` / `stepcache.py` (chunked and windowed reads), `safezip.py` (zip safety),
`summary.py` (what `hstrace show` prints) and `acceptance_by_position.py` (acceptance by draft
position, both conventions).

The fast writer (`hstrace.trace.write`): `TraceWriter`, the sinks, the writer process and its
ring, the chunk and shard writer, `create_trace`. The Blosc codecs both layers share:
`hstrace.trace.codecs`. The format layer never imports the writer.

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
    "open_trace": "hstrace.trace.reader",
    "Trace": "hstrace.trace.reader",
    "RankView": "hstrace.trace.reader",
    "TableView": "hstrace.trace.reader",
    "summarize": "hstrace.trace.summary",
    # the writer (hstrace.trace.write), exported here as it always was
    "create_trace": "hstrace.trace.write.root",
    "TraceWriter": "hstrace.trace.write.writer",
    "Sink": "hstrace.trace.write.sink",
    "RecorderSink": "hstrace.trace.write.sink",
    "MemorySink": "hstrace.trace.write.sink",
    "ProcessSink": "hstrace.trace.write.process_sink",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hstrace.trace' has no attribute {name!r}")
