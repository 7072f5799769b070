"""An engine's patch points checked from its source, by AST: never imports the engine.

What the hooks rely on, read from a source tree (an installed package's directory, or a
release's wheel unpacked by `scripts/vllm-wheel-src.sh`): for each patch point, the function
defined in the class's own body (what `apply_point` patches) and its parameters in
`inspect.signature` order; for each class the hooks read attributes on, those attributes
(assigned as `self.X` in the class or a base class it imports, or a class-level name /
property). `snapshot` gathers the facts (JSON-able, no source text), `mismatches` compares
them with a patch table. The versions policy (`hstrace.engines.support.EngineSupport.
check_source`) runs it on the installed engine of a release outside the tested table; vLLM's
wheel check (`hstrace.engines.vllm.srccheck`) on a committed snapshot and a cached wheel.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hstrace.engines.support import PatchPoint


def module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Parameter names in `inspect.signature` order."""
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args)]
    if a.vararg is not None:
        names.append(a.vararg.arg)
    names.extend(p.arg for p in a.kwonlyargs)
    if a.kwarg is not None:
        names.append(a.kwarg.arg)
    return names


def _own_attrs(cls: ast.ClassDef) -> set[str]:
    found: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
        elif isinstance(node, ast.Assign):
            found.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            decorators = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
            if decorators & {"property", "cached_property"}:
                found.add(node.name)
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    found.add(sub.attr)
    return found


def _imported(tree: ast.Module, name: str, module: str) -> str | None:
    """The module a base-class name comes from (`from X import name`), or this module."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if any((a.asname or a.name) == name for a in node.names):
                return node.module
    return module if _class(tree, name) is not None else None


def class_attrs(root: Path, module: str, name: str, depth: int = 8) -> set[str]:
    """Attributes of `module:name` and the bases it imports by name (within the source tree)."""
    path = module_file(root, module)
    if path is None or depth == 0:
        return set()
    tree = _parse(path)
    cls = _class(tree, name)
    if cls is None:
        return set()
    attrs = _own_attrs(cls)
    for base in cls.bases:
        if isinstance(base, ast.Name):
            origin = _imported(tree, base.id, module)
            if origin is not None:
                attrs |= class_attrs(root, origin, base.id, depth - 1)
    return attrs


def read_point(root: Path, target: str) -> dict[str, Any]:
    """What one `module:Class.method` is in a source tree: its file, whether the class
    exists, and the method's parameters when the class body defines it (None otherwise)."""
    module, qualname = target.split(":")
    cls_name, attr = qualname.split(".")
    path = module_file(root, module)
    out: dict[str, Any] = {"file": None, "class": False, "params": None}
    if path is None:
        return out
    out["file"] = path.relative_to(root).as_posix()
    cls = _class(_parse(path), cls_name)
    if cls is None:
        return out
    out["class"] = True
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == attr:
            out["params"] = _params(node)
    return out


def find_class(root: Path, name: str, package: str) -> list[str]:
    """Modules under `root/package` whose top level defines class `name` (where it moved)."""
    hits = []
    for path in sorted((root / package).rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if f"class {name}" not in text:
            continue
        if _class(_parse(path), name) is not None:
            rel = path.relative_to(root).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            hits.append(".".join(parts))
    return hits


def snapshot(
    root: Path, points: Iterable[PatchPoint], attrs: Mapping[str, tuple[str, ...]]
) -> dict[str, Any]:
    """The JSON-able facts the check needs from one source tree (no source text)."""
    points = list(points)
    return {
        "points": {p.target: read_point(root, p.target) for p in points},
        "attrs": {
            cls: sorted(set(names) & class_attrs(root, *cls.split(":")))
            for cls, names in attrs.items()
            if any(p.target.startswith(cls + ".") for p in points)
        },
    }


def mismatches(
    snap: Mapping[str, Any],
    points: Iterable[PatchPoint],
    attrs: Mapping[str, tuple[str, ...]],
) -> list[str]:
    """One line per patch point the hooks could not patch as written, or attribute they read
    that the class (and its imported bases) never sets."""
    bad = []
    for p in points:
        got = snap["points"].get(p.target)
        if got is None or got["file"] is None:
            bad.append(f"{p.target}: module {p.module} not found")
        elif not got["class"]:
            bad.append(f"{p.target}: class {p.qualname.split('.')[0]} not in {got['file']}")
        elif got["params"] is None:
            bad.append(f"{p.target}: not defined in the class body")
        elif tuple(got["params"][: len(p.params)]) != p.params:
            bad.append(f"{p.target}: expected {p.params}, found {tuple(got['params'])}")
    for cls, names in attrs.items():
        if cls not in snap["attrs"]:
            continue
        missing = sorted(set(names) - set(snap["attrs"][cls]))
        if missing:
            bad.append(f"{cls}: never sets {missing}")
    return bad
