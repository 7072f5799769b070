"""Helpers for the engine tests: checking a patch table against the installed engine, and a
release the patch tables do not know, as the server's Python would see it."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def signature_mismatches(points: Iterable[Any]) -> list[str]:
    """Each patch point whose function is missing or binds other leading parameters in the
    installed engine (what `hstrace.hooks.common.apply_point` would refuse to patch)."""
    bad = []
    for point in points:
        cls_name, attr = point.qualname.split(".")
        cls = getattr(importlib.import_module(point.module), cls_name)
        found = cls.__dict__.get(attr)
        params = tuple(inspect.signature(found).parameters) if found is not None else ()
        if params[: len(point.params)] != point.params:
            bad.append(f"{point.target}: expected {point.params}, found {params}")
    return bad


def fake_release_on_path(
    tmp_path: Path, monkeypatch: Any, dist: str, version: str, package: str | None = None
) -> None:
    """A real dist-info of `dist` at `version`, first on the server's PYTHONPATH (so its
    `importlib.metadata.version` answers `version`); with `package`, also an empty package of
    that name (a release whose source has none of the patch points: the versions policy
    refuses it naming the first one)."""
    info = tmp_path / f"{dist}-{version}.dist-info"
    info.mkdir()
    if package is not None:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
