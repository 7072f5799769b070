"""The engine adapter interface: what `hstrace record` needs from a serving backend.

Small on purpose (like an HTTP client's transports): an adapter knows how to check that it can
hook its engine, and how to run a list of prompts through it while recording a trace. The CLI
builds an `EngineConfig` from its flags, asks `get_engine(name, config)` for the adapter, calls
`check_supported()` before anything is started, then `record(prompts, out, options)`. The
adapter is the launcher half of an engine package; what hstrace knows about the engine itself is
its `EngineSpec` (`hstrace.engines.spec`), and `hstrace.engines.registry` lists both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

# Trace tables an engine may record (docs/internal-api.md), plus `logits`: full draft logits,
# large, only on request (and, in SGLang, only in eager mode).
STREAMS: tuple[str, ...] = ("target", "draft_extend", "draft_step", "verify", "requests", "logits")
DEFAULT_STREAMS: frozenset[str] = frozenset(STREAMS) - {"logits"}


# The sampling parameters a prompt may carry (`record --prompts FILE.jsonl`, "sampling";
# `record --sampling`), with the JSON type each takes (`list`: of token ids); the clients send
# them under each engine's own names. `min_tokens` with `stop_token_ids`: vLLM's min-tokens
# processor masks those tokens in the verify's rows until the request has that many.
SAMPLING_PARAMS: dict[str, type | tuple[type, ...]] = {
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": int,
    "min_p": (int, float),
    "repetition_penalty": (int, float),
    "frequency_penalty": (int, float),
    "presence_penalty": (int, float),
    "seed": int,
    "max_tokens": int,
    "min_tokens": int,
    "stop_token_ids": list,
}

SamplingValue = float | int | tuple[int, ...]


def sampling_value(name: str, value: object) -> SamplingValue:
    """`value` as the known sampling parameter `name` takes it (a list of token ids kept as a
    tuple: a `Prompt` is frozen). ValueError, its text the end of a sentence naming `name`
    ("must be an integer, got 1.5"), for a value of another type; bools are not numbers."""
    kind = SAMPLING_PARAMS[name]
    if kind is list:
        if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
        ):
            raise ValueError(f"must be a list of non-negative integers, got {value!r}")
        return tuple(value)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class Prompt:
    """One request. Exactly one of `input_ids` (sent as-is, no tokenizer in between: used for
    training samples so serving and training can be compared token for token), `text`, or
    `messages` (chat turns `(role, content)`, sent to the engine's chat API, which applies the
    model's chat template). `sampling`: the request's sampling parameters (`SAMPLING_PARAMS`;
    absent ones: greedy, `RecordOptions.max_new_tokens`)."""

    input_ids: tuple[int, ...] | None = None
    text: str | None = None
    # The caller's name for it (training sample index, JSONL line); kept in the trace.
    source_id: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    sampling: tuple[tuple[str, SamplingValue], ...] = ()

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.input_ids, self.text, self.messages)]
        if sum(given) != 1:
            raise ValueError("a Prompt has exactly one of input_ids, text or messages")
        unknown = {k for k, _ in self.sampling} - set(SAMPLING_PARAMS)
        if unknown:
            raise ValueError(f"unknown sampling parameters {sorted(unknown)}")

    def sampling_for(self, max_new_tokens: int) -> dict[str, float | int | list[int]]:
        """What the client sends: greedy and `max_new_tokens` unless the prompt says
        otherwise, then the prompt's own parameters (token ids as a JSON list)."""
        own = {k: list(v) if isinstance(v, tuple) else v for k, v in self.sampling}
        return {"temperature": 0.0, "max_tokens": max_new_tokens, **own}


@dataclass(frozen=True)
class RecordOptions:
    max_new_tokens: int = 32
    streams: frozenset[str] = DEFAULT_STREAMS
    # What the trace writer does when its staging buffer is full: stall serving, or drop steps.
    on_full: Literal["block", "drop"] = "block"
    # Seconds to wait for the server to become healthy (model load included).
    startup_timeout_s: float = 900.0
    show_progress: bool = True
    # Prompts in flight at once (server engines batch them: sglang, vllm); 1 = one after the
    # other.
    concurrency: int = 1
    # Record one request in K (the 1st, the K+1-th, ... the engine schedules); the hooks only
    # check the others (vLLM V1 runner).
    sample_every: int = 1

    def __post_init__(self) -> None:
        unknown = set(self.streams) - set(STREAMS)
        if unknown:
            raise ValueError(f"unknown streams {sorted(unknown)}; known: {', '.join(STREAMS)}")
        if self.on_full not in ("block", "drop"):
            raise ValueError(f"on_full must be block or drop, not {self.on_full!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an adapter may need to start its engine; each adapter validates its part.

    sglang: `server_cmd` (the user's launch command, run as-is with hooks injected).
    reference: `target` (HF model dir) and `drafter` (EAGLE-3 checkpoint dir), `device`.
    """

    server_cmd: str | None = None
    target: Path | None = None
    drafter: Path | None = None
    device: str = "cpu"
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RecordResult:
    out: Path
    engine: str
    engine_version: str
    prompts_sent: int
    prompts_completed: int
    # True when the engine ran to the end and the trace was closed cleanly.
    ok: bool
    # When not ok: the reason, ending with the engine's last error lines where there are any.
    error: str | None = None
    # The engine's own per-request statistics (SGLang: meta_info spec_* fields), as a cross-check.
    request_metrics: list[dict[str, Any]] = field(default_factory=list)
    # Wall seconds of the prompt-sending phase only (no startup): bench/ compares tokens/s.
    send_wall_s: float | None = None
    # `record --serve`: why the recording stopped (requests finished, time, a signal)
    stopped_by: str | None = None
    # a served engine: its whole stdout + stderr (kept after the run, for the user to read)
    server_log: Path | None = None


class Engine(ABC):
    name: ClassVar[str]

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def check_supported(self) -> str:
        """Return the engine version if hstrace can hook it; raise `EngineError` (one line)
        otherwise. Called before anything is started."""

    @abstractmethod
    def record(self, prompts: Sequence[Prompt], out: Path, options: RecordOptions) -> RecordResult:
        """Run `prompts` through the engine and record a trace at `out` (created here). Must
        leave a readable trace even when the engine dies, and report that in the result."""
