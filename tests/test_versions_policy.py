"""The versions policy (`hstrace.engines.support.EngineSupport`): a release newer than the tested
table is recorded when its source matches every patch point's signature and every attribute
the hooks read (a one-line warning naming the tested release it was checked against, and
`static.version_check` in the trace); when any differs it is refused naming the patch point;
an older release is refused. Checked by AST on a source tree, never importing the engine.

The engine here is a toy (`toyengine`, a package written into tmp_path with its dist-info, run
by the real launcher through this Python): the policy is engine-independent, and the real
releases are checked in tests/test_vllm_srccheck.py (vLLM 0.33.0's wheel) and below on the
installed vLLM / SGLang when present.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hstrace.engines.base import EngineConfig
from hstrace.engines.server import ServerEngine
from hstrace.engines.support import EngineSupport, PatchPoint, UntestedVersion
from hstrace.errors import EngineError

TOY = EngineSupport(
    label="Toy",
    distributions=("toyengine",),
    min_supported=(1, 2, 0),
    max_supported=(1, 3, 0),
    install_hint="toyengine==1.3.0",
    patch_points=(
        PatchPoint("toyengine.worker:Worker.step", ("self", "batch"), (1, 2, 0), (1, 2, 9), ()),
        PatchPoint(
            "toyengine.worker:Worker.step", ("self", "batch", "plan"), (1, 3, 0), (1, 3, 0), ()
        ),
        PatchPoint("toyengine.model:Draft.forward", ("self", "ids"), (1, 2, 0), (1, 3, 0), ()),
    ),
    plugin_group="toyengine.plugins",
    plugins_env="TOY_PLUGINS",
    package="toyengine",
    attrs_read={"toyengine.worker:Worker": ("topk", "hot_ids")},
)

WORKER = """
from toyengine.base import Base


class Worker(Base):
    def __init__(self):
        self.topk = 1

    def step(self, batch, plan, extra=None):
        return batch
"""
BASE = """
class Base:
    def __init__(self):
        self.hot_ids = None
"""
MODEL = """
class Draft:
    def forward(self, ids, positions=None):
        return ids
"""


def toy_tree(root: Path, version: str, worker: str = WORKER) -> Path:
    pkg = root / "toyengine"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('the check must never import me')\n")
    (pkg / "worker.py").write_text(worker)
    (pkg / "base.py").write_text(BASE)
    (pkg / "model.py").write_text(MODEL)
    dist = root / f"toyengine-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: toyengine\nVersion: {version}\n")
    return root


def test_tested_releases_pass_untested_newer_ones_need_the_source_check() -> None:
    assert TOY.check_supported_version("1.3.0") == (1, 3, 0)
    with pytest.raises(
        UntestedVersion,
        match=r"Toy 1\.4\.0 is not supported .* \(patch tables cover 1\.2\.0-1\.3\.0\) unless its source matches",
    ):
        TOY.check_supported_version("1.4.0")
    assert TOY.check_supported_version("1.4.0", source_checked=True) == (1, 4, 0)
    # older than the table: refused even with a source check (older code paths)
    with pytest.raises(EngineError) as old:
        TOY.check_supported_version("1.1.0", source_checked=True)
    assert not isinstance(old.value, UntestedVersion) and "older releases" in str(old.value)
    # an untested release is hooked with its nearest tested release's rows
    assert [p.params for p in TOY.patch_points_for((1, 4, 0))][0] == ("self", "batch", "plan")


def test_a_matching_source_is_recorded_with_a_warning_naming_the_tested_release(tmp_path) -> None:
    root = toy_tree(tmp_path, "1.4.0")
    check = TOY.check_source("1.4.0", root)
    assert check["checked_against"] == "1.3.0" and check["tested"] == "1.2.0-1.3.0"
    assert check["patch_points"] == [
        "toyengine.worker:Worker.step",
        "toyengine.model:Draft.forward",
    ]
    assert check["attributes"] == {"toyengine.worker:Worker": ["hot_ids", "topk"]}  # base too
    assert check["warning"] == (
        "hstrace: warning: Toy 1.4.0 is not in hstrace's tested table (1.2.0-1.3.0); its 2 patch "
        "points and the 2 attributes the hooks read match 1.3.0's: recording it with 1.3.0's "
        "hooks (the trace says so in static.version_check)"
    )


@pytest.mark.parametrize(
    ("worker", "named"),
    [
        (
            WORKER.replace("batch, plan,", "plan, batch,"),
            "toyengine.worker:Worker.step: expected ('self', 'batch', 'plan'), found ('self', 'plan', 'batch', 'extra')",
        ),
        (
            WORKER.replace("def step", "def run"),
            "toyengine.worker:Worker.step: not defined in the class body",
        ),
        (
            WORKER.replace("class Worker", "class Runner"),
            "toyengine.worker:Worker.step: class Worker not in toyengine/worker.py",
        ),
        (
            WORKER.replace("self.topk = 1", "self.top_k = 1"),
            "toyengine.worker:Worker: never sets ['topk']",
        ),
    ],
)
def test_a_differing_source_is_refused_naming_the_patch_point(tmp_path, worker, named) -> None:
    root = toy_tree(tmp_path, "1.4.0", worker)
    with pytest.raises(EngineError) as err:
        TOY.check_source("1.4.0", root)
    message = str(err.value)
    assert "\n" not in message and named in message, message
    assert message.startswith(
        "Toy 1.4.0 is outside the tested table (1.2.0-1.3.0) and differs from 1.3.0"
    )


class ToyEngine(ServerEngine):
    name = "toy"
    support = TOY


def test_the_launcher_checks_the_servers_own_install(tmp_path, monkeypatch, capsys) -> None:
    """`check_supported` asks the server's Python (here this one, with the toy on PYTHONPATH)
    for the version and the package's directory, without importing it, then applies the
    policy; the trace's static record and the hooks' config say the release was checked."""
    root = toy_tree(tmp_path / "site", "1.4.0")
    monkeypatch.setenv("PYTHONPATH", str(root))
    eng = ToyEngine(EngineConfig(server_cmd=f"{sys.executable} -m toyengine.serve"))
    assert eng.check_supported() == "1.4.0"
    assert "hstrace: warning: Toy 1.4.0 is not in hstrace's tested table" in capsys.readouterr().err
    static = eng._launch_static("1.4.0")
    assert static["version_check"]["checked_against"] == "1.3.0"
    assert (
        static["version_check"]["source"] == str(root) and "warning" not in static["version_check"]
    )

    broken = toy_tree(tmp_path / "broken", "1.4.0")
    (broken / "toyengine" / "model.py").write_text(MODEL.replace("ids, positions", "tokens"))
    monkeypatch.setenv("PYTHONPATH", str(broken))
    eng = ToyEngine(EngineConfig(server_cmd=f"{sys.executable} -m toyengine.serve"))
    with pytest.raises(
        EngineError, match=r"toyengine.model:Draft.forward: expected \('self', 'ids'\)"
    ):
        eng.check_supported()


def test_the_bootstrap_hooks_an_untested_release_only_when_the_launcher_vouched(
    monkeypatch, tmp_path
) -> None:
    import json

    from hstrace.hooks import bootstrap

    from hstrace.engines.registry import engine_spec

    spec = engine_spec("vllm")
    installed: list[tuple] = []
    monkeypatch.setattr(spec, "installed_version", lambda: "0.33.1")
    monkeypatch.setattr(
        "hstrace.hooks.vllm_patches.install", lambda version, cfg: installed.append(version)
    )
    cfg = {
        "out": str(tmp_path / "t.zarr"),
        "streams": [],
        "status": str(tmp_path / "s.jsonl"),
        "engine": "vllm",
        "source_checked": "0.33.1",
    }
    monkeypatch.setenv(bootstrap.ENV, json.dumps(cfg))
    monkeypatch.setattr(bootstrap, "_state", {"active": False, "via": None})
    assert bootstrap.activate("plugin", engine="vllm") is True
    assert installed == [(0, 33, 1)]
    # vouched for another release: refused before the server takes traffic
    monkeypatch.setenv(bootstrap.ENV, json.dumps({**cfg, "source_checked": "0.33.2"}))
    monkeypatch.setattr(bootstrap, "_state", {"active": False, "via": None})
    with pytest.raises(SystemExit):
        bootstrap.activate("plugin", engine="vllm")


SITE = (
    Path(sys.prefix)
    / "lib"
    / f"python{sys.version_info.major}.{sys.version_info.minor}"
    / "site-packages"
)


@pytest.mark.parametrize(("engine", "version"), [("sglang", "0.5.24"), ("vllm", "0.33.1")])
def test_the_installed_engines_source_passes_as_the_next_release(engine, version) -> None:
    """The real installed engine (when this Python has it) read as if it were the next
    release: its source matches the tested table, so the policy would record it."""
    from hstrace.engines.registry import engine_spec

    support = engine_spec(engine).support
    if support.installed_version() is None or not (SITE / support.package).is_dir():
        pytest.skip(f"{engine} is not installed in this Python")
    check = support.check_source(version, SITE)
    assert check["checked_against"] == ".".join(map(str, support.max_supported))
