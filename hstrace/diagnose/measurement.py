"""Is the acceptance real? `acceptance-simulated`: a simulated/synthetic acceptance switch.

Engines ship switches that make the verifier accept a fixed or random number of drafts without
asking the target (benchmarking the rest of the system independently of the drafter): SGLang
`SGLANG_SIMULATE_ACC_LEN` / `SGLANG_SIMULATE_ACC_METHOD`, vLLM's speculative config
`"rejection_sample_method": "synthetic"` (`synthetic_acceptance_length`), TensorRT-LLM
`TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS`. With one on, every accept length in the trace is
what the switch said, so the finding leads the verdict (`hstrace.findings.LEADING`).

The static audit is searched for the switches wherever a producer put them: the documented key
`static.acceptance_simulation` (docs/trace-format.md), an environment or server-args dict, the
speculative config, and the recorded command lines.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from hstrace.findings import Finding, finding
from hstrace.replay.evidence import Evidence

# Environment variables that simulate acceptance (any non-empty value other than 0/false).
ENV_SWITCHES = (
    "SGLANG_SIMULATE_ACC_LEN",
    "SGLANG_SIMULATE_ACC_METHOD",
    "TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS",
)
# vLLM speculative-config keys: the method, and the numbers it takes.
VLLM_METHOD_KEY = "rejection_sample_method"
VLLM_SYNTHETIC = "synthetic"
VLLM_NUMBERS = ("synthetic_acceptance_length", "synthetic_acceptance_rate")
MAX_DEPTH = 6


def _on(value: Any) -> bool:
    if value is None or value is False:
        return False
    text = str(value).strip().lower()
    return text not in ("", "0", "false", "none", "off", "null")


def _walk(node: Any, path: str, found: dict[str, Any], depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        return
    if isinstance(node, dict):
        for k, v in node.items():
            key = str(k)
            where = f"{path}.{key}" if path else key
            upper = key.upper()
            if upper in ENV_SWITCHES and _on(v):
                found[where] = v
            elif key == VLLM_METHOD_KEY and str(v).lower() == VLLM_SYNTHETIC:
                found[where] = v
            elif key in VLLM_NUMBERS and _on(v) and _synthetic_sibling(node):
                found[where] = v
            elif key == "enabled" and path.endswith("acceptance_simulation") and v is True:
                found[where] = v
            elif key == "simulated" and "accept" in path.lower() and v is True:
                found[where] = v  # vLLM hooks: static.acceptance.simulated
            else:
                _walk(v, where, found, depth + 1)
    elif isinstance(node, list | tuple):
        for i, v in enumerate(node[:64]):
            _walk(v, f"{path}[{i}]", found, depth + 1)
    elif isinstance(node, str) and len(node) < 20000:
        _scan_text(node, path, found)


def _synthetic_sibling(node: dict[str, Any]) -> bool:
    return str(node.get(VLLM_METHOD_KEY, "")).lower() == VLLM_SYNTHETIC


def _scan_text(text: str, where: str, found: dict[str, Any]) -> None:
    """A command line or a JSON string (vLLM's --speculative-config) that sets a switch."""
    for name in ENV_SWITCHES:
        m = re.search(rf"\b{name}=(\S+)", text)
        if m and _on(m.group(1).strip("'\"")):
            found[f"{where} ({name})"] = m.group(1).strip("'\"")
    if re.search(rf'"?{VLLM_METHOD_KEY}"?\s*[:=]\s*"?{VLLM_SYNTHETIC}', text):
        found[f"{where} ({VLLM_METHOD_KEY})"] = VLLM_SYNTHETIC


def simulation_switches(meta: dict[str, Any]) -> dict[str, Any]:
    """{where in the trace: value} of every simulated-acceptance switch the trace records."""
    found: dict[str, Any] = {}
    static = meta.get("static") or {}
    _walk(static, "static", found)
    cmd = meta.get("command_line")
    if isinstance(cmd, list):
        cmd = shlex.join(str(c) for c in cmd)
    if isinstance(cmd, str):
        _scan_text(cmd, "command_line", found)
    return found


def acceptance_simulated(ev: Evidence) -> list[Finding]:
    switches = simulation_switches(ev.serving.meta)
    if not switches:
        return []
    evidence: dict[str, Any] = {"switches": {k: str(v) for k, v in switches.items()}}
    if ev.serving.accept_lens:
        lens = ev.serving.accept_lens
        evidence["recorded_accept_lens"] = {
            "verify_rows": len(lens),
            "mean_accept_len": round(sum(lens) / len(lens), 4),
            "convention": "accepted draft tokens per verify, excluding the bonus token",
        }
    return [
        finding(
            "acceptance-simulated",
            "the engine ran with a simulated-acceptance switch "
            f"({', '.join(sorted(switches))}): the verifier accepted what the switch said, not "
            "what the target agreed with, so every accept length in this trace is fake",
            evidence=evidence,
        )
    ]
