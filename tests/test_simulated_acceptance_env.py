"""A simulated-acceptance switch set in the launcher's environment (not on the command line)
reaches the trace's static audit, where replay's acceptance-simulated check finds it."""

from __future__ import annotations

from hstrace.diagnose.measurement import simulation_switches
from hstrace.engines import EngineConfig, get_engine

CMD = "python -m sglang.launch_server --model-path /m --speculative-algorithm EAGLE3"


def _static(monkeypatch, **env: str) -> dict:
    for key in ("SGLANG_SIMULATE_ACC_LEN", "SGLANG_SIMULATE_ACC_METHOD"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    engine = get_engine("sglang", EngineConfig(server_cmd=CMD))
    return engine._launch_static("0.5.23")


def test_an_env_switch_is_recorded_and_found(monkeypatch):
    static = _static(monkeypatch, SGLANG_SIMULATE_ACC_LEN="3.2")
    assert static["env"] == {"SGLANG_SIMULATE_ACC_LEN": "3.2"}
    found = simulation_switches({"static": static, "command_line": CMD})
    assert found == {"static.env.SGLANG_SIMULATE_ACC_LEN": "3.2"}


def test_no_switch_no_env_item(monkeypatch):
    static = _static(monkeypatch)
    assert "env" not in static
    assert simulation_switches({"static": static, "command_line": CMD}) == {}
