"""What an engine's versions are, as data: the release range its patch table covers, the
patch-point rows, how its version is read in a Python and how its plugin entry point is found.

One shape for every engine (`EngineSupport`); each engine package holds one (`versions.SUPPORT`).
Pure data and lookups: imports no engine, and nothing here runs inside a server.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

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

    def parse_version(self, text: str) -> Version:
        return parse_version(text, self.label)

    def check_supported_version(self, version_text: str) -> Version:
        """The parsed version, or an `EngineError` naming the supported range."""
        version = self.parse_version(version_text)
        if not (self.min_supported <= version <= self.max_supported):
            lo = ".".join(map(str, self.min_supported))
            hi = ".".join(map(str, self.max_supported))
            span = lo if lo == hi else f"{lo}-{hi}"
            raise EngineError(
                f"{self.label} {version_text} is not supported by this hstrace (patch tables "
                f"cover {span}); install {self.install_hint} or an hstrace release that knows "
                f"{version_text}"
            )
        return version

    def patch_points_for(self, version: Version) -> tuple[PatchPoint, ...]:
        return choose_points(self.patch_points, version)

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
