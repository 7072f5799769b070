"""vLLM 0.33's Model Runner V2: which runner `hstrace record` asks for, the one line it says,
and the trace's static audit (`hstrace.engines.vllm.runner`; the launcher runs a stand-in
server script that writes the environment it got, no vLLM)."""

from __future__ import annotations

import json
import sys

import pytest
from helpers.engines import fake_release_on_path

from hstrace.engines.base import EngineConfig, Prompt, RecordOptions
from hstrace.engines.vllm.engine import VLLMEngine
from hstrace.engines.vllm.runner import ENV, V1_VS_V2, decide_runner
from hstrace.errors import EngineError
from hstrace.replay.run import engine_runner as runner_evidence
from hstrace.trace import open_trace


def test_033_defaults_to_v1_and_says_so() -> None:
    choice = decide_runner((0, 33, 0), {})
    assert choice.runner == "v1" and choice.env == {ENV: "0"}
    assert choice.message is not None and "\n" not in choice.message
    assert f"{ENV}=0" in choice.message and "--runner v2" in choice.message
    assert choice.audit["set_by"] == "hstrace" and choice.audit["default"] == "v2"
    assert choice.audit["v1_vs_v2"] == list(V1_VS_V2)
    # the user's V2 switch is overridden, and the line says what it was
    forced = decide_runner((0, 33, 0), {ENV: "1"})
    assert forced.env == {ENV: "0"} and "(was 1)" in (forced.message or "")
    assert forced.audit["user_env"] == "1"


def test_the_users_own_v1_switch_is_kept_silently() -> None:
    for value in ("0", "false", "False"):
        choice = decide_runner((0, 33, 0), {ENV: value})
        assert choice.runner == "v1" and choice.env == {} and choice.message is None
        assert choice.audit["set_by"] == f"environment {ENV}={value}"


def test_runner_v2_is_asked_for_explicitly_and_checked() -> None:
    choice = decide_runner((0, 33, 0), {}, "v2")
    assert choice.runner == "v2" and choice.env == {ENV: "1"} and choice.message is None
    assert choice.audit["set_by"] == "--runner v2"
    with pytest.raises(EngineError, match=f"contradicts {ENV}=0"):
        decide_runner((0, 33, 0), {ENV: "0"}, "v2")
    with pytest.raises(EngineError, match=r"needs vLLM 0\.33\.0\+ \(this is 0\.32\.0\)"):
        decide_runner((0, 32, 0), {}, "v2")
    with pytest.raises(EngineError, match="must be one of v1, v2"):
        decide_runner((0, 33, 0), {}, "v3")


def test_032_has_only_v1_and_nothing_is_set() -> None:
    choice = decide_runner((0, 32, 0), {ENV: "1"})
    assert choice.runner == "v1" and choice.env == {} and choice.message is None
    assert choice.audit == {"runner": "v1", "set_by": "vllm", "default": "v1"}


def test_runner_evidence_names_the_runner() -> None:
    assert runner_evidence({}) is None
    assert runner_evidence({"vllm_runner": {"runner": "v9"}}) is None
    v1 = decide_runner((0, 33, 0), {}).audit
    assert runner_evidence({"vllm_runner": v1}) == "vLLM ran the V1 model runner (set by hstrace)"
    v2 = decide_runner((0, 33, 0), {}, "v2").audit
    assert runner_evidence({"vllm_runner": v2}) == "vLLM ran Model Runner V2 (set by --runner v2)"


_SERVER = """import json, os, sys
open(sys.argv[1], "w").write(json.dumps({"env": os.environ.get("VLLM_USE_V2_MODEL_RUNNER")}))
sys.exit(3)
"""


@pytest.mark.parametrize(("runner", "env_seen", "said"), [(None, "0", True), ("v2", "1", False)])
def test_record_starts_the_server_with_the_runner_and_records_it(
    tmp_path, monkeypatch, capsys, runner, env_seen, said
) -> None:
    fake_release_on_path(tmp_path, monkeypatch, "vllm", "0.33.0")
    monkeypatch.delenv(ENV, raising=False)
    script, seen = tmp_path / "server.py", tmp_path / "seen.json"
    script.write_text(_SERVER)
    extra = {"runner": runner} if runner else {}
    cmd = f"{sys.executable} {script} {seen} vllm.entrypoints.openai.api_server --port 18991"
    engine = VLLMEngine(EngineConfig(server_cmd=cmd, extra=extra))
    assert engine.check_supported() == "0.33.0"
    result = engine.record(
        [Prompt(input_ids=(1, 2), source_id="p")],
        tmp_path / "t.zarr",
        RecordOptions(startup_timeout_s=60, show_progress=False),
    )
    assert not result.ok and "server exited" in (result.error or "")  # the stand-in exits
    assert json.loads(seen.read_text()) == {"env": env_seen}
    err = capsys.readouterr().err
    assert (f"starting the server with {ENV}=0" in err) is said
    static = open_trace(tmp_path / "t.zarr").meta["static"]
    assert static["vllm_runner"]["runner"] == ("v2" if runner else "v1")
    assert static["vllm_runner"]["env"] == {ENV: env_seen}


def test_replay_names_the_runner_the_trace_records(tmp_path) -> None:
    from helpers.cli import EXAMPLES, TRAINING, run_main
    from helpers.demo_trace import copy_trace

    audit = decide_runner((0, 33, 0), {}).audit
    trace = copy_trace(
        EXAMPLES / "clean.zarr", tmp_path / "t.zarr", engine="vllm", static={"vllm_runner": audit}
    )
    run = run_main("replay", str(trace), "--against", str(TRAINING), "--json")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["inputs"]["engine_runner"] == "vLLM ran the V1 model runner (set by hstrace)"
    text = run_main("replay", str(trace), "--against", str(TRAINING))
    assert "engine: vLLM ran the V1 model runner (set by hstrace)" in text.stdout
    # a trace without the audit (0.32, SGLang) says nothing about a runner
    plain = run_main("replay", str(EXAMPLES / "clean.zarr"), "--against", str(TRAINING), "--json")
    assert "engine_runner" not in json.loads(plain.stdout)["inputs"]
