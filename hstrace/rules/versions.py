"""Which engine versions a rule (or a finding) applies to: one `packaging` specifier set per
engine (`{"sglang": SpecifierSet("<0.5.12")}`), written in findings as "sglang<0.5.12" and
"sglang>=0.5.23, vllm" (engines separated by ", "; an engine without a specifier = every
version of it; `None` = every engine).

A build is judged as its release: the first three numbers of its version string, so
0.5.23.post1, 0.5.23rc1 and 0.32.0+cpu are 0.5.23 and 0.32.0 (engine facts here are known per
release); a version string with no number is judged as 0, the oldest.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from hstrace.findings import Finding

AppliesTo = Mapping[str, SpecifierSet] | None

_ENGINE = re.compile(r"\s*([a-z][a-z0-9_-]*)\s*(.*?)\s*")


def engines(**specs: str) -> dict[str, SpecifierSet]:
    """`engines(sglang="<0.5.12", vllm="")`: the mapping a rule's `applies_to` takes."""
    return {name: SpecifierSet(spec) for name, spec in specs.items()}


def format_applies_to(applies_to: AppliesTo) -> str | None:
    """The string a `Finding.applies_to` carries ("sglang>=0.5.23, vllm")."""
    if applies_to is None:
        return None
    return ", ".join(f"{name}{spec}" for name, spec in applies_to.items())


def parse_applies_to(text: str | None) -> dict[str, SpecifierSet] | None:
    """The inverse of `format_applies_to`. A comma piece that starts with an engine name opens
    its clause; one that starts with an operator continues the clause before it
    ("sglang>=0.5.12,<0.5.17"). Raises ValueError on anything else."""
    if not text:
        return None
    clauses: dict[str, list[str]] = {}
    name = None
    for piece in text.split(","):
        m = _ENGINE.fullmatch(piece)
        if m:
            name = m.group(1)
            clauses.setdefault(name, [])
            if m.group(2):
                clauses[name].append(m.group(2))
        elif name is not None and piece.strip():
            clauses[name].append(piece.strip())
        else:
            raise ValueError(f"applies_to {text!r}: cannot read {piece!r}")
    try:
        return {n: SpecifierSet(",".join(specs)) for n, specs in clauses.items()}
    except InvalidSpecifier as exc:
        raise ValueError(f"applies_to {text!r}: {exc}") from None


def release(version: str) -> Version:
    """The release a build of `version` is judged as (see the module docstring)."""
    return Version(".".join(re.findall(r"\d+", str(version))[:3]) or "0")


def covers(applies_to: AppliesTo, engine: str, version: str) -> bool:
    """Does `applies_to` include this engine at this version?"""
    if applies_to is None:
        return True
    spec = applies_to.get(engine)
    return spec is not None and spec.contains(release(version), prereleases=True)


def applies(finding: Finding, engine: str, version: str) -> bool:
    """Does a finding's `applies_to` ("sglang<0.5.17", "sglang>=0.5.23, vllm", None) cover
    this engine? For findings made outside the rule table too (the recorder's load audit)."""
    try:
        parsed = parse_applies_to(finding.applies_to)
    except ValueError:
        return True  # an unreadable scope narrows nothing: the finding is kept
    return covers(parsed, engine, version)
