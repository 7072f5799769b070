"""hstrace: find where EAGLE-3 serving and training part ways.

The core (trace store, reference drafter, training readers, replay, diagnosis) imports without
SGLang or vLLM; the engine hooks are the `hstrace[sglang]` / `hstrace[vllm]` extras.

The public API is the handful of names below; everything else is internal and may move.
They load lazily, so `import hstrace` stays cheap (no torch import until one is used).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from hstrace._version import __version__

# public name -> module that defines it
_PUBLIC = {
    "open_trace": "hstrace.trace",
    "TraceWriter": "hstrace.trace",
    # `hstrace.replay` is the replay room (a package); the function that replays a trace and
    # diagnoses it is `replay_trace`.
    "replay_trace": "hstrace.pipelines",
    "load_drafter": "hstrace.drafter",
    "open_training": "hstrace.training",
    "Finding": "hstrace.findings",
}
__all__ = [
    "Finding",
    "TraceWriter",
    "__version__",
    "load_drafter",
    "open_trace",
    "open_training",
    "replay_trace",
]

if TYPE_CHECKING:
    from hstrace.drafter import load_drafter
    from hstrace.findings import Finding
    from hstrace.pipelines import replay_trace
    from hstrace.trace import TraceWriter, open_trace
    from hstrace.training import open_training


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'hstrace' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
