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

from hstrace.engines.protocol import ENV, SITECUSTOMIZE, write_sitecustomize

__all__ = ["ENV", "SITECUSTOMIZE", "activate", "register", "register_vllm", "write_sitecustomize"]
_state: dict[str, Any] = {"active": False, "via": None}


def config() -> dict[str, Any] | None:
    raw = os.environ.get(ENV)
    if not raw:
        return None
    return json.loads(raw)


def _refuse(cfg: dict[str, Any], message: str) -> None:
    """Stop the server before it takes traffic: a clear line, and a status file the launcher
    reads (the status protocol shared by every engine's hooks: hstrace.hooks.common).
    SystemExit, not an Exception: SGLang's and vLLM's plugin loaders do not swallow it."""
    from hstrace.hooks.common import refuse

    refuse(cfg, message)


def activate(via: str, engine: str = "sglang") -> bool:
    cfg = config()
    if cfg is None or _state["active"]:
        return False
    from hstrace.trace.write import placement

    placement.remember_given()  # this process's CPUs, before the engine binds its threads
    # The launcher names the engine it started (cfg["engine"], default sglang): a vLLM plugin
    # call inside an SGLang server (or the reverse) does nothing.
    if cfg.get("engine", "sglang") != engine:
        return False
    return _activate_engine(cfg, via, engine)


def _spec(engine: str) -> Any:
    """The engine's spec from the one registry (its versions and its hooks module)."""
    from hstrace.engines.registry import engine_spec

    return engine_spec(engine)


def hooked_engines() -> tuple[str, ...]:
    """The engines with hooks, as the registry lists them."""
    from hstrace.engines.registry import hooked

    return tuple(s.name for s in hooked())


def _activate_engine(cfg: dict[str, Any], via: str, engine: str) -> bool:
    from importlib import import_module

    from hstrace.errors import EngineError

    spec = _spec(engine)
    text = spec.installed_version()
    if text is None:
        _refuse(
            cfg,
            f"hstrace record needs {spec.label} in the server's Python, and it is not installed "
            "there",
        )
    try:
        # the launcher vouches for an untested release whose source it checked
        version = spec.support.check_supported_version(
            text, source_checked=cfg.get("source_checked") == text
        )
    except EngineError as exc:
        _refuse(cfg, str(exc))
        return False
    import_module(spec.patches).install(version, cfg)
    _state.update(active=True, via=via)
    return True


def _plugin_will_run(engine: str) -> bool:
    """The engine calls hstrace's entry point itself (installed, listed, not filtered out)."""
    spec = _spec(engine)
    return spec.support.plugin_will_run(spec.installed_version())


def register_vllm() -> None:
    """vLLM plugin entry point (group `vllm.general_plugins`): vLLM calls it in every process
    (API server, engine core, workers) before the model is built."""
    activate("plugin", engine="vllm")


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


def activate_from_site() -> None:
    _sglang_cpu_shim()  # before anything imports SGLang (torchvision stand-in)
    cfg = config()
    if cfg is None:
        return
    engine = cfg.get("engine", "sglang")
    if engine in hooked_engines() and not _plugin_will_run(engine):
        activate("sitecustomize", engine=engine)
