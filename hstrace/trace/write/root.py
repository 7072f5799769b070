"""Creating a trace root: done once, by the launcher, before any rank starts.

Ranks never create or rewrite the root (concurrent root creation and root-attribute updates
race: reference/trace-storage.md §7); they only create and write their own `rank{r}` group.
"""

from __future__ import annotations

import getpass
import os
import platform
import socket
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import zarr

from hstrace._version import __version__
from hstrace.errors import TraceError
from hstrace.trace.schema import FORMAT_NAME, ROOT_KEY, SCHEMA_VERSION


def create_trace(
    path: str | os.PathLike,
    engine: dict[str, Any],
    command_line: list[str] | None = None,
    static: dict[str, Any] | None = None,
) -> Path:
    """Create an empty trace (a Zarr v3 directory store) with its run metadata."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise TraceError(f"{path}: already exists; a trace is created once (pick a new path)")
    if "name" not in engine:
        raise TraceError(f"engine must name itself: got {engine!r}")
    meta = {
        "format": FORMAT_NAME,
        "schema_version": SCHEMA_VERSION,
        "hstrace_version": __version__,
        "engine": {
            "name": str(engine["name"]),
            "version": str(engine.get("version", "unknown")),
            **{k: v for k, v in engine.items() if k not in ("name", "version")},
        },
        "command_line": list(command_line if command_line is not None else sys.argv),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {
            "hostname": socket.gethostname(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "user": _user(),
        },
        "static": dict(static or {}),
    }
    zarr.open_group(str(path), mode="w-", attributes={ROOT_KEY: meta}, zarr_format=3)
    return path


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in some containers
        return ""
