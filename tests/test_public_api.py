"""The public API is what hstrace/__init__.py exports; importing the package stays cheap."""

from __future__ import annotations

import subprocess
import sys

import hstrace


def test_every_public_name_resolves_to_its_defining_module():
    from hstrace.drafter import load_drafter
    from hstrace.findings import Finding
    from hstrace.replay import replay
    from hstrace.trace import TraceWriter, open_trace
    from hstrace.training import open_training

    expected = {
        "open_trace": open_trace,
        "TraceWriter": TraceWriter,
        "replay": replay,
        "load_drafter": load_drafter,
        "open_training": open_training,
        "Finding": Finding,
    }
    assert set(hstrace.__all__) == {*expected, "__version__"}
    for name, obj in expected.items():
        if name == "replay":  # the package object is bound there too; it calls the function
            assert callable(hstrace.replay) and hstrace.replay.replay is obj
            continue
        assert getattr(hstrace, name) is obj, name


def test_hstrace_replay_runs_a_replay():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = hstrace.replay(
        root / "traces/examples/aux-layer-shift.zarr",
        root / "traces/tiny-world/training-speculators",
    )
    assert result.verdict.code == "aux-layer-shift"


def test_import_hstrace_does_not_import_torch_or_an_engine():
    code = (
        "import sys, hstrace; "
        "print(sorted(m for m in ('torch', 'zarr', 'sglang', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
