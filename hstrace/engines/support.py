"""What an engine's versions are, as data: the release range its patch table covers, the
patch-point rows, how its version is read in a Python and how its plugin entry point is found.

One shape for every engine (`EngineSupport`); each engine package holds one (`versions.SUPPORT`).
Pure data and lookups: imports no engine, and nothing here runs inside a server.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hstrace.errors import EngineError

Version = tuple[int, int, int]


def parse_version(text: str, engine: str = "engine") -> Version:
    match = re.match(r"^\s*(\d+)\.(\d+)\.(\d+)", text)
    if not match:
        raise EngineError(f"cannot read {engine} version {text!r}")
    return int(match[1]), int(match[2]), int(match[3])


@dataclass(frozen=True)
class PatchPoint:
    """One function hstrace wraps: `module:Qual.name`, the parameter names it binds by, the
    versions in which they look like that, and what it feeds."""

    target: str
    params: tuple[str, ...]
    since: Version
    until: Version  # inclusive
    feeds: tuple[str, ...]

    def applies_to(self, version: Version) -> bool:
        return self.since <= version <= self.until

    @property
    def module(self) -> str:
        return self.target.split(":")[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":")[1]


def choose_points(table: tuple[PatchPoint, ...], version: Version) -> tuple[PatchPoint, ...]:
    chosen = tuple(p for p in table if p.applies_to(version))
    targets = [p.target for p in chosen]
    duplicated = {t for t in targets if targets.count(t) > 1}
    if duplicated:  # a table bug, not bad input
        raise AssertionError(f"patch table has overlapping rows for {sorted(duplicated)}")
    return chosen


class UntestedVersion(EngineError):
    """A release outside the tested table: refused unless its source passes `check_source`
    (then recorded with a warning, and the trace says so)."""


def dotted(version: Version) -> str:
    return ".".join(map(str, version))


@dataclass(frozen=True)
class EngineSupport:
    """One engine's versions, as data: which releases the patch table covers, how its version
    is read in a Python, and how its plugin entry point is found. Each `*_versions.py` holds one
    (`SUPPORT`); the bootstrap and the launcher ask it, never the engine-specific module."""

    label: str  # the engine's name in messages
    distributions: tuple[str, ...]  # the distributions that install it (same import name)
    min_supported: Version
    max_supported: Version
    install_hint: str  # what to install instead of an unsupported release
    patch_points: tuple[PatchPoint, ...]
    plugin_group: str
    plugins_env: str  # the engine's allow-list of plugins (comma-separated names)
    plugins_since: Version = (0, 0, 0)  # the first release that loads plugin entry points
    empty_env_allows_all: bool = True  # SGLANG_PLUGINS="": all; VLLM_PLUGINS="": none
    # The import name (the directory `check_source` reads) and, per patched class
    # (`module:Class`), the attributes the hooks read on its instances.
    package: str = ""
    attrs_read: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def parse_version(self, text: str) -> Version:
        return parse_version(text, self.label)

    @property
    def span(self) -> str:
        lo, hi = dotted(self.min_supported), dotted(self.max_supported)
        return lo if lo == hi else f"{lo}-{hi}"

    def tested(self, version: Version) -> bool:
        return self.min_supported <= version <= self.max_supported

    def nearest_tested(self, version: Version) -> Version:
        """The tested release whose patch-table rows an untested (newer) one is checked
        against and hooked with: the newest."""
        return min(max(version, self.min_supported), self.max_supported)

    def check_supported_version(self, version_text: str, source_checked: bool = False) -> Version:
        """The parsed version. A release older than the table is refused (`EngineError`); a
        newer one raises `UntestedVersion` naming the range, unless `source_checked` (the
        launcher ran `check_source` on the installed engine and every patch point matched)."""
        version = self.parse_version(version_text)
        if version < self.min_supported:  # the table's oldest row is where the code changed
            raise EngineError(
                f"{self.label} {version_text} is not supported by this hstrace (patch tables "
                f"cover {self.span}; older releases run code paths the hooks do not know); "
                f"install {self.install_hint}"
            )
        if not self.tested(version) and not source_checked:
            raise UntestedVersion(
                f"{self.label} {version_text} is not supported by this hstrace (patch tables "
                f"cover {self.span}) unless its source matches every patch point: `hstrace "
                f"record` checks that before starting it; else install {self.install_hint} or "
                f"an hstrace release that knows {version_text}"
            )
        return version

    def patch_points_for(self, version: Version) -> tuple[PatchPoint, ...]:
        """The rows hooked for `version` (an untested one: its nearest tested release's)."""
        return choose_points(self.patch_points, self.nearest_tested(version))

    def check_source(self, version_text: str, root: Path) -> dict[str, Any]:
        """The versions policy for a release outside the tested table, read from its source
        under `root` (the directory holding the package; `hstrace.engines.srccheck`, by AST,
        never importing it): every patch point of the nearest tested release must be defined
        in its class with the same leading parameters, and every attribute the hooks read
        must be set. All match: what was checked (the trace's `static.version_check`). Any
        differs: `EngineError` naming the patch point(s)."""
        from hstrace.engines import srccheck

        version = self.parse_version(version_text)
        nearest = self.nearest_tested(version)
        points = self.patch_points_for(version)
        snap = srccheck.snapshot(root, points, self.attrs_read)
        bad = srccheck.mismatches(snap, points, self.attrs_read)
        if bad:
            more = f" (and {len(bad) - 1} more: {'; '.join(bad[1:4])})" if len(bad) > 1 else ""
            raise EngineError(
                f"{self.label} {version_text} is outside the tested table ({self.span}) and "
                f"differs from {dotted(nearest)} where hstrace hooks it: {bad[0]}{more}; "
                f"install {self.install_hint}"
            )
        n_attrs = sum(len(v) for v in snap["attrs"].values())
        return {
            "version": version_text,
            "tested": self.span,
            "checked_against": dotted(nearest),
            "patch_points": [p.target for p in points],
            "attributes": {k: list(v) for k, v in snap["attrs"].items()},
            "source": str(root),
            "warning": (
                f"hstrace: warning: {self.label} {version_text} is not in hstrace's tested "
                f"table ({self.span}); its {len(points)} patch points and the {n_attrs} "
                f"attributes the hooks read match {dotted(nearest)}'s: recording it with "
                f"{dotted(nearest)}'s hooks (the trace says so in static.version_check)"
            ),
        }

    def installed_version(self) -> str | None:
        """The engine's version in this Python (any of its distributions), or None."""
        from importlib.metadata import PackageNotFoundError, version

        for dist in self.distributions:
            try:
                return version(dist)
            except PackageNotFoundError:
                continue
        return None

    def plugin_will_run(self, installed: str | None) -> bool:
        """Whether the engine will call hstrace's plugin entry point itself (then the generated
        sitecustomize leaves activation to it)."""
        from importlib.metadata import entry_points

        if installed is None or self.parse_version(installed) < self.plugins_since:
            return False
        allowed = os.environ.get(self.plugins_env)
        if allowed is not None and (allowed or not self.empty_env_allows_all):
            if "hstrace" not in {x.strip() for x in allowed.split(",")}:
                return False
        return any(ep.name == "hstrace" for ep in entry_points(group=self.plugin_group))
