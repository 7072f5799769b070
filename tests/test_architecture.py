"""Dependencies point down (docs/architecture.md, "Who may import whom"): every room declares
the rooms it MAY import, and anything else it imports is named with its file and line. The scan
reads every import of the package, `cli/` (`hstrace.cli`) and `hooks/` (`hstrace.hooks`) included,
the lazy ones inside functions too. A module in no declared room fails: a new room is declared
here (and in the doc's table, which mirrors this one) before it can import anything.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# package name -> the folder it installs from (setup.py maps cli/ and hooks/ into hstrace)
SOURCES = {
    "hstrace": REPO / "hstrace",
    "hstrace.cli": REPO / "cli",
    "hstrace.hooks": REPO / "hooks",
}

# The floor: imported by everyone (each room below lists the ones it uses), importing nothing
# of hstrace's rooms.
FLOOR = ("hstrace.errors", "hstrace._version", "hstrace.findings", "hstrace.metrics")

# room -> the rooms it may import (besides itself). Rooms are dotted prefixes, the longest
# declared one wins (hstrace.trace.write is its own room inside hstrace.trace), so modules
# moving inside a room keep passing. "hstrace" is the package's __init__ (the public names)
# only; an import of `hstrace` or of a name in no room (`from hstrace import __version__`)
# counts as an import of it.
ROOMS: dict[str, tuple[str, ...]] = {
    # the floor
    "hstrace.errors": (),
    "hstrace._version": (),
    "hstrace.findings": (),
    "hstrace.metrics": ("hstrace.errors",),
    # the trace store: codecs <- the format layer <- the writer
    "hstrace.trace.codecs": (),
    "hstrace.trace": ("hstrace.errors", "hstrace.trace.codecs"),
    "hstrace.trace.write": (
        "hstrace.errors",
        "hstrace._version",
        "hstrace.trace",
        "hstrace.trace.codecs",
    ),
    # small shared rooms
    "hstrace.redaction": ("hstrace.errors",),
    "hstrace.target_io": ("hstrace.errors",),
    "hstrace.training": ("hstrace.errors",),
    # the judge's low rooms
    "hstrace.drafter": ("hstrace.errors", "hstrace.training"),
    "hstrace.reference": ("hstrace.errors", "hstrace.drafter", "hstrace.trace"),
    "hstrace.evaluation": (
        "hstrace.errors",
        "hstrace.findings",
        "hstrace.metrics",
        "hstrace.drafter",
        "hstrace.training",
    ),
    "hstrace.rules": (
        "hstrace.errors",
        "hstrace.findings",
        "hstrace.drafter",
        "hstrace.training",
        "hstrace.engines",  # the engine registry: an engine's reading of a config
    ),
    # engine adapters and what runs inside the server
    "hstrace.engines": (
        "hstrace.errors",
        "hstrace._version",
        "hstrace.findings",
        "hstrace.trace",
        "hstrace.training",
        "hstrace.drafter",
        "hstrace.reference",
    ),
    "hstrace.hooks": (
        "hstrace.errors",
        "hstrace._version",
        "hstrace.findings",  # the recorded audit facts become findings (`findings.from_fact`)
        "hstrace.trace",
        "hstrace.trace.write",  # placement: the tap thread off the engine's cores, as the writer
        "hstrace.engines",
    ),
    "hstrace.prompts": ("hstrace.errors", "hstrace.training", "hstrace.engines"),
    # the judge
    "hstrace.replay": (
        "hstrace.errors",
        "hstrace.findings",
        "hstrace.metrics",
        "hstrace.trace",
        "hstrace.redaction",
        "hstrace.training",
        "hstrace.drafter",
        "hstrace.evaluation",
        "hstrace.reference",
        "hstrace.target_io",
    ),
    "hstrace.diagnose": (
        "hstrace.errors",
        "hstrace.findings",
        "hstrace.metrics",
        "hstrace.training",
        "hstrace.drafter",
        "hstrace.evaluation",
        "hstrace.rules",
        "hstrace.engines",
        "hstrace.replay",
    ),
    # outputs
    "hstrace.diff": ("hstrace.errors", "hstrace.trace"),
    "hstrace.report": (
        "hstrace.errors",
        "hstrace.findings",
        "hstrace.metrics",
        "hstrace.trace",
        "hstrace.replay",  # the result types (replay.result)
        "hstrace.diff",  # diff.compare
    ),
    "hstrace.html": (
        "hstrace.errors",
        "hstrace._version",
        "hstrace.findings",
        "hstrace.metrics",
        "hstrace.trace",
        "hstrace.replay",
        "hstrace.diff",
        "hstrace.report",
    ),
    "hstrace.bundle": (
        "hstrace.errors",
        "hstrace._version",
        "hstrace.findings",
        "hstrace.trace",
        "hstrace.redaction",
        "hstrace.report",
        "hstrace.html",
        "hstrace.engines",  # the registry: the engines' distributions in the manifest
    ),
    # shipped for out-of-tree producers: the store and its summary renderer, no judge
    "hstrace.testing": ("hstrace.errors", "hstrace.trace", "hstrace.report"),
    # the top of the library
    "hstrace.pipelines": (
        "hstrace.errors",
        "hstrace.findings",
        "hstrace.trace",
        "hstrace.redaction",
        "hstrace.training",
        "hstrace.drafter",
        "hstrace.replay",
        "hstrace.diagnose",
        "hstrace.bundle",
        "hstrace.report",
        "hstrace.html",
    ),
    "hstrace": (
        "hstrace._version",
        "hstrace.findings",
        "hstrace.trace",
        "hstrace.drafter",
        "hstrace.training",
        "hstrace.pipelines",
    ),
    # the commands: anything of the library (not the server-side hooks)
    "hstrace.cli": (
        "hstrace",
        *FLOOR,
        "hstrace.trace",
        "hstrace.redaction",
        "hstrace.target_io",
        "hstrace.training",
        "hstrace.drafter",
        "hstrace.reference",
        "hstrace.evaluation",
        "hstrace.rules",
        "hstrace.engines",
        "hstrace.prompts",
        "hstrace.replay",
        "hstrace.diagnose",
        "hstrace.diff",
        "hstrace.report",
        "hstrace.html",
        "hstrace.bundle",
        "hstrace.pipelines",
    ),
    "hstrace.__main__": ("hstrace.cli",),
}
# Sanctioned upward edges (module, room it may import besides its room's list): none. The
# public `hstrace.replay_trace` is `hstrace.pipelines`' own function; `hstrace.replay` is the
# replay package only and never calls up.
FACADES: set[tuple[str, str]] = set()


def room_of(name: str) -> str | None:
    """The declared room a dotted name lies in (the longest prefix), None if none. The
    package room "hstrace" holds `hstrace` itself only."""
    best = None
    for room in ROOMS:
        if name == room or (room != "hstrace" and name.startswith(room + ".")):
            if best is None or len(room) > len(best):
                best = room
    return best


def _target_room(name: str) -> str:
    """The room an imported name belongs to: `hstrace.X...` in no declared room is the
    package's own surface (a public name, `__version__`)."""
    return room_of(name) or "hstrace"


def _modules() -> list[tuple[str, Path]]:
    out = []
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.append((".".join((package, *parts)), path))
    return out


def _imports(mod: str, path: Path, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in the file, lazy ones too; relative ones resolved."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = mod.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from hstrace import redaction` imports hstrace.redaction, `from hstrace.trace
            # import open_trace` a name of hstrace.trace
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return [(line, name) for line, name in out if name.split(".")[0] == "hstrace"]


def _violations_in(files: list[tuple[str, Path]]) -> list[str]:
    bad = set()
    for mod, path in files:
        room = room_of(mod)
        if room is None:
            bad.add(f"{mod}: in no declared room (declare it in ROOMS and docs/architecture.md)")
            continue
        allowed = {room, *ROOMS[room]}
        for line, name in _imports(mod, path, path.name == "__init__.py"):
            target = _target_room(name)
            if target not in allowed and (mod, target) not in FACADES:
                bad.add(f"{mod}:{line} imports {name} (room {room} may not import {target})")
    return sorted(bad)


def test_rooms_import_only_what_they_may():
    assert _violations_in(_modules()) == []


def test_the_scan_covers_the_package_cli_and_hooks():
    mods = {m for m, _ in _modules()}
    for package in SOURCES:
        assert any(m == package or m.startswith(package + ".") for m in mods if m != "hstrace")
    assert {"hstrace.cli.main", "hstrace.trace.reader", "hstrace.trace.write.writer"} <= mods
    assert any(m.startswith("hstrace.hooks.") for m in mods)


def test_the_table_names_only_declared_rooms():
    undeclared = {t for allowed in ROOMS.values() for t in allowed if t not in ROOMS}
    assert undeclared == set()
    assert all(r not in allowed for r, allowed in ROOMS.items())  # a room is implied in itself


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_a_planted_upward_import_is_named(room, tmp_path):
    """The checker itself, for every room: a module of the room that imports every room it may
    not (at module level and lazily, inside a function) is named once per import, with its line
    and the rule; the imports it may make are not named."""
    forbidden = sorted(r for r in ROOMS if r != room and r not in ROOMS[room])
    assert forbidden, f"{room} may import every room: nothing is below it"
    mod = room if room == "hstrace" else f"{room}.probe"
    probe = tmp_path / ("__init__.py" if room == "hstrace" else "probe.py")
    lines = ["import os"]
    lines += [f"from {r} import planted_{i}" for i, r in enumerate(ROOMS[room])]
    lines += [f"import {r}" for r in forbidden]
    lines += ["def lazy():"] + [f"    from {r} import planted" for r in forbidden]
    probe.write_text("\n".join(lines) + "\n")
    first = 2 + len(ROOMS[room])
    want = []
    for i, r in enumerate(forbidden):
        want.append(f"{mod}:{first + i} imports {r} (room {room} may not import {r})")
        at = first + len(forbidden) + 1 + i
        want.append(f"{mod}:{at} imports {r}.planted (room {room} may not import {r})")
    assert _violations_in([(mod, probe)]) == sorted(want)


def test_a_module_in_no_declared_room_fails(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from hstrace.errors import TraceError\n")
    assert _violations_in([("hstrace.newroom.probe", probe)]) == [
        "hstrace.newroom.probe: in no declared room (declare it in ROOMS and docs/architecture.md)"
    ]


def test_relative_and_package_root_imports_are_resolved(tmp_path):
    """`from .. import x` resolves against the module's package; `from hstrace import
    __version__` is an import of the package's surface, which the format layer may not make."""
    probe = tmp_path / "probe.py"
    probe.write_text("from .. import bundle\nfrom hstrace import __version__\n")
    assert _violations_in([("hstrace.trace.probe", probe)]) == [
        "hstrace.trace.probe:1 imports hstrace.bundle (room hstrace.trace may not import "
        "hstrace.bundle)",
        "hstrace.trace.probe:2 imports hstrace.__version__ (room hstrace.trace may not import "
        "hstrace)",
    ]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle of a module graph, each once (as found from its first module)."""
    found, seen = [], set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycle = path[path.index(nxt) :]
                key = frozenset(cycle)
                if key not in seen:
                    seen.add(key)
                    found.append([*cycle, nxt])
            elif len(path) < 12:
                walk(nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, [start])
    return found


def _module_graph(prefix: str) -> dict[str, set[str]]:
    """module -> the modules under `prefix` it imports (lazy imports too)."""
    files = [(m, p) for m, p in _modules() if m == prefix or m.startswith(prefix + ".")]
    mods = {m for m, _ in files}
    graph: dict[str, set[str]] = {}
    for mod, path in files:
        for _, name in _imports(mod, path, path.name == "__init__.py"):
            # the longest module the name lies in (`from hstrace.trace.x import y` -> .x)
            target = max(
                (m for m in mods if name == m or name.startswith(m + ".")), key=len, default=None
            )
            if target and target != mod and target != prefix:
                graph.setdefault(mod, set()).add(target)
    return graph


def test_the_trace_store_has_no_import_circle():
    """No module of hstrace.trace reaches itself through its imports, lazy ones included
    (sink.py <-> process_sink.py was one: default_sink now lives in writer.py)."""
    assert _cycles(_module_graph("hstrace.trace")) == []


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert _cycles(graph) == [["a", "b", "c", "a"]]


def _doc_table() -> dict[str, tuple[str, ...]]:
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Who may import whom", 1)[1].split("\n## ", 1)[0]
    table: dict[str, tuple[str, ...]] = {}
    for row in re.findall(r"^\| `([\w.]+)` \| (.*?) \|$", section, flags=re.M):
        room, allowed = row
        table[room] = tuple(re.findall(r"`([\w.]+)`", allowed))
    return table


def test_the_doc_mirrors_the_table():
    """docs/architecture.md's "Who may import whom" lists the same rooms with the same rooms
    each may import (order aside)."""
    doc = _doc_table()
    assert sorted(doc) == sorted(ROOMS)
    assert {r: sorted(a) for r, a in doc.items()} == {r: sorted(a) for r, a in ROOMS.items()}
