"""The public API is what hstrace/__init__.py exports; importing the package stays cheap."""

from __future__ import annotations

import subprocess
import sys

import hstrace


def test_every_public_name_resolves_to_its_defining_module():
    from hstrace.drafter import load_drafter
    from hstrace.findings import Finding
    from hstrace.pipelines import replay_trace
    from hstrace.trace import TraceWriter, open_trace
    from hstrace.training import open_training

    expected = {
        "open_trace": open_trace,
        "TraceWriter": TraceWriter,
        "replay_trace": replay_trace,
        "load_drafter": load_drafter,
        "open_training": open_training,
        "Finding": Finding,
    }
    assert set(hstrace.__all__) == {*expected, "__version__"}
    for name, obj in expected.items():
        assert getattr(hstrace, name) is obj, name


def test_hstrace_replay_is_the_package_and_replay_trace_the_function():
    """One name, one concept: `hstrace.replay` is the replay room (a package, not callable),
    `hstrace.replay_trace` the public function."""
    import hstrace.replay.run  # binds the package as `hstrace.replay`

    assert hstrace.replay.__name__ == "hstrace.replay" and not callable(hstrace.replay)
    assert not hasattr(hstrace.replay, "replay")
    assert hstrace.replay_trace.__module__ == "hstrace.pipelines"


def test_hstrace_replay_runs_a_replay():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = hstrace.replay_trace(
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
