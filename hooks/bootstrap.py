"""Entry into every SGLang / vLLM process: active only when `HSTRACE_RECORD` is set.

vLLM: its `vllm.general_plugins` entry point calls `register_vllm()` in every process; the
generated `sitecustomize` covers installs where that entry point is not visible. The launcher
names the engine in the config (`"engine": "vllm"`), so only that engine's hooks install.

Two ways in, one effect (`activate`, idempotent per process):
- SGLang's plugin entry point (group `sglang.srt.plugins`, 0.5.11+): `register()` runs in the
  main process, every scheduler (one per TP/PP rank, spawned) and the detokenizer;
- a generated `sitecustomize.py` on PYTHONPATH (`activate_from_site`), for installs where the
  entry point is not visible (hstrace not installed in the server's env metadata, SGLANG_PLUGINS
  excluding it, releases before plugins); it defers to the plugin when the plugin will run.
Nothing here imports SGLang at module import time.
"""

from __future__ import annotations

import json
import os
from typing import Any

ENV = "HSTRACE_RECORD"  # JSON: {"out", "streams", "on_full", "status"}
_state: dict[str, Any] = {"active": False, "via": None}


def config() -> dict[str, Any] | None:
    raw = os.environ.get(ENV)
    if not raw:
        return None
    return json.loads(raw)


def _sglang_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def _refuse(cfg: dict[str, Any], message: str) -> None:
    """Stop the server before it takes traffic: a clear line, and a status file the launcher
    reads (the status protocol shared by every engine's hooks: hstrace.engines.hooks_common).
    SystemExit, not an Exception: SGLang's and vLLM's plugin loaders do not swallow it."""
    from hstrace.engines.hooks_common import refuse

    refuse(cfg, message)


def activate(via: str, engine: str = "sglang") -> bool:
    cfg = config()
    if cfg is None or _state["active"]:
        return False
    # The launcher names the engine it started (cfg["engine"], default sglang): a vLLM plugin
    # call inside an SGLang server (or the reverse) does nothing.
    if cfg.get("engine", "sglang") != engine:
        return False
    return _activate_engine(cfg, via, engine)


# engine -> (its version table, its patches, its name in messages). Both version tables offer
# `check_supported_version`; the installed version is read here (vLLM has two distributions).
_ENGINES = {
    "sglang": ("hstrace.engines.sglang_versions", "hstrace.hooks.sglang_patches", "SGLang"),
    "vllm": ("hstrace.engines.vllm_versions", "hstrace.hooks.vllm_patches", "vLLM"),
}


def _installed_version(engine: str) -> str | None:
    if engine == "vllm":
        from hstrace.engines.vllm_versions import installed_version

        return installed_version()
    return _sglang_version()


def _activate_engine(cfg: dict[str, Any], via: str, engine: str) -> bool:
    from importlib import import_module

    from hstrace.errors import EngineError

    versions_module, patches_module, label = _ENGINES[engine]
    text = _installed_version(engine)
    if text is None:
        _refuse(
            cfg,
            f"hstrace record needs {label} in the server's Python, and it is not installed there",
        )
    try:
        version = import_module(versions_module).check_supported_version(text)
    except EngineError as exc:
        _refuse(cfg, str(exc))
        return False
    import_module(patches_module).install(version, cfg)
    _state.update(active=True, via=via)
    return True


def register_vllm() -> None:
    """vLLM plugin entry point (group `vllm.general_plugins`): vLLM calls it in every process
    (API server, engine core, workers) before the model is built."""
    activate("plugin", engine="vllm")


def _vllm_plugin_will_run() -> bool:
    from importlib.metadata import entry_points

    from hstrace.engines.vllm_versions import PLUGIN_GROUP, installed_version

    if installed_version() is None:
        return False
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and "hstrace" not in {x.strip() for x in allowed.split(",")}:
        return False
    return any(ep.name == "hstrace" for ep in entry_points(group=PLUGIN_GROUP))


def _sglang_cpu_shim() -> None:
    """HSTRACE_SGLANG_CPU=1 (tests, demo): CPU stand-ins for SGLang's CUDA-only pieces, installed
    with or without recording (hstrace.hooks.sglang_cpu_shim; refuses other SGLang versions)."""
    if os.environ.get("HSTRACE_SGLANG_CPU") == "1":
        from hstrace.hooks.sglang_cpu_shim import install_from_env

        install_from_env()


def register() -> None:
    """SGLang plugin entry point."""
    _sglang_cpu_shim()
    activate("plugin")


def _plugin_will_run() -> bool:
    from importlib.metadata import entry_points

    from hstrace.engines.sglang_versions import PLUGIN_GROUP, has_plugin_entry_points, parse_version

    text = _sglang_version()
    if text is None or not has_plugin_entry_points(parse_version(text)):
        return False
    allowed = os.environ.get("SGLANG_PLUGINS")
    if allowed and "hstrace" not in {x.strip() for x in allowed.split(",")}:
        return False
    return any(ep.name == "hstrace" for ep in entry_points(group=PLUGIN_GROUP))


def activate_from_site() -> None:
    _sglang_cpu_shim()  # before anything imports SGLang (torchvision stand-in)
    cfg = config()
    if cfg is None:
        return
    if cfg.get("engine", "sglang") == "vllm":
        if not _vllm_plugin_will_run():
            activate("sitecustomize", engine="vllm")
        return
    if _plugin_will_run():
        return
    activate("sitecustomize")


SITECUSTOMIZE = """\
# Generated by hstrace record: activates hstrace's hooks in every Python process of the server
# (only while HSTRACE_RECORD is set), then chains to the sitecustomize it shadows, if any.
import os as _os
import sys as _sys

_here = _os.path.dirname(_os.path.abspath(__file__))
_me = _sys.modules.get("sitecustomize")
try:
    from hstrace.hooks.bootstrap import activate_from_site as _activate
except ImportError:
    _activate = None
if _activate is not None:
    _activate()
_saved = list(_sys.path)
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]
_sys.modules.pop("sitecustomize", None)
try:
    import sitecustomize  # noqa: F401  (the one further down the path)
except ImportError:
    pass
finally:
    _sys.path[:] = _saved
    _sys.modules["sitecustomize"] = _me  # importlib looks this module up when it returns
"""


def write_sitecustomize(directory: str) -> str:
    path = os.path.join(directory, "sitecustomize.py")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(SITECUSTOMIZE)
    return path
