"""vLLM's patch points checked from a release's source, by AST: never imports vLLM.

`scripts/vllm-wheel-src.sh VERSION` unpacks a wheel's `vllm/**/*.py` (the CUDA wheel reads
fine without a GPU); `snapshot` parses the files each patch point names and records what the
hooks rely on (the general check: `hstrace.engines.srccheck`), with vLLM's `ATTRS_READ` (the
attributes the hooks read on the instance, `hstrace.engines.vllm.versions`). `mismatches`
compares a snapshot with the patch table, so the check runs on a committed snapshot in CI
(`tests/fixtures/vllm_src_points.json`) and on the real wheel when it is cached.

    python -m hstrace.engines.vllm.srccheck SOURCE_ROOT VERSION   # JSON snapshot + mismatches
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hstrace.engines import srccheck as _general
from hstrace.engines.srccheck import class_attrs, module_file, read_point
from hstrace.engines.support import PatchPoint
from hstrace.engines.vllm.versions import ATTRS_READ

__all__ = [
    "ATTRS_READ",
    "class_attrs",
    "find_class",
    "main",
    "mismatches",
    "module_file",
    "read_point",
    "snapshot",
]


def find_class(root: Path, name: str) -> list[str]:
    """Modules under `root/vllm` whose top level defines class `name` (where a class moved)."""
    return _general.find_class(root, name, "vllm")


def snapshot(
    root: Path, points: Iterable[PatchPoint], attrs: Mapping[str, tuple[str, ...]] = ATTRS_READ
) -> dict[str, Any]:
    return _general.snapshot(root, points, attrs)


def mismatches(
    snap: Mapping[str, Any],
    points: Iterable[PatchPoint],
    attrs: Mapping[str, tuple[str, ...]] = ATTRS_READ,
) -> list[str]:
    return _general.mismatches(snap, points, attrs)


def main(argv: list[str] | None = None) -> int:
    from hstrace.engines.vllm.versions import SUPPORT
    from hstrace.errors import EngineError

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("hstrace: error: usage: srccheck SOURCE_ROOT VERSION", file=sys.stderr)
        return 2
    root = Path(args[0])
    if not (root / "vllm" / "__init__.py").is_file():
        print(f"hstrace: error: {root} holds no vllm/__init__.py", file=sys.stderr)
        return 2
    try:
        version = SUPPORT.check_supported_version(args[1])
    except EngineError as exc:
        print(f"hstrace: error: {exc}", file=sys.stderr)
        return 2
    points = SUPPORT.patch_points_for(version)
    snap = snapshot(root, points)
    bad = mismatches(snap, points)
    print(json.dumps({"version": args[1], **snap, "mismatches": bad}, indent=1, sort_keys=True))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
