"""A real `hstrace record --server-cmd "python -m sglang.launch_server ..."` on CPU (sglang==0.5.23).

On CPU the released SGLang loads both target and EAGLE-3 drafter weights, then dies in KV-pool
init (a triton kernel, no GPU). hstrace must have written the static audit by then, keep the
trace readable, and exit non-zero with SGLang's last error lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sglang = pytest.importorskip(
    "sglang", reason="needs sglang==0.5.23 (scripts/sglang-venv.sh builds its venv)"
)
pytestmark = [pytest.mark.sglang, pytest.mark.slow]

from helpers.sglang_world import build_drafter, build_target, fakes_pythonpath  # noqa: E402


def _record(
    tmp_path: Path, drafter: Path, target: Path
) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "trace.zarr"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 5, 9, 13]}) + "\n")
    server = (
        f"{sys.executable} -m sglang.launch_server --model-path {target} --device cpu --host 127.0.0.1 "
        f"--port 30177 --dtype bfloat16 --skip-tokenizer-init --speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path {drafter} --speculative-num-steps 3 "
        f"--speculative-eagle-topk 1 --speculative-num-draft-tokens 8 --mem-fraction-static 0.1"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=fakes_pythonpath())
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hstrace",
            "record",
            "--server-cmd",
            server,
            "--out",
            str(out),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "4",
            "--startup-timeout",
            "300",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    return proc, out


def test_record_on_cpu_writes_static_audit_before_sglang_dies(tmp_path: Path) -> None:
    target = build_target(tmp_path / "target")
    drafter = build_drafter(tmp_path / "drafter", prefix="transformer.layers.0")  # wrong prefix
    proc, out = _record(tmp_path, drafter, target)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "hstrace: error:" in proc.stderr
    from hstrace.trace import open_trace

    tr = open_trace(out)
    static = tr.meta["static"]
    weights = static["weights"]
    # every decoder-layer key was dropped, and the decoder layer parameters were never loaded
    assert any(k.startswith("transformer.layers.0") for k in weights["dropped_keys"])
    assert "model.layers.0.self_attn.qkv_proj.weight" in weights["unloaded_parameters"]
    assert [f["code"] for f in static["findings_load"]] == ["weights-dropped"]
    assert static["hot_token_id"]["head"][:4] == [0, 2, 4, 6]
    assert static["aux_layers"]["read_by_sglang"] == [0, 1, 2]
    assert static["fc_width"]["match"] is True
    assert "model.safetensors" in static["checkpoint_sha256"]
    # the main process resolved the server args: raw 8, effective num_steps + 1 = 4 (topk 1)
    assert static["spec_resolution"]["adjusted"] == {
        "num_draft_tokens": {"user": 8, "effective": 4}
    }
    assert static["findings_spec_resolution"][0]["code"] == "spec-params-adjusted"
    assert tr.meta["record"]["ok"] is False
