"""Comparing a rebuilt world (`traces/*/build.py`) with the committed one, file by file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The key HF writes into every config it saves: the transformers that saved it. A newer
# transformers on the rebuilding machine changes only this stamp, not the world.
VERSION_STAMP = "transformers_version"


def unstamped(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: unstamped(v) for k, v in x.items() if k != VERSION_STAMP}
    if isinstance(x, list):
        return [unstamped(v) for v in x]
    return x


def differing_files(
    rebuilt: Path, committed: Path, rebuilt_files: dict[str, str], committed_files: dict[str, str]
) -> list[str]:
    """The files whose digests differ, less the JSON files that differ only in the
    transformers version stamp (read from both trees and compared without it)."""
    out = []
    for rel in sorted(set(rebuilt_files) | set(committed_files)):
        if rebuilt_files.get(rel) == committed_files.get(rel):
            continue
        if rel.endswith(".json") and rel in rebuilt_files and rel in committed_files:
            a = json.loads((rebuilt / rel).read_text())
            b = json.loads((committed / rel).read_text())
            if a != b and unstamped(a) == unstamped(b):
                continue
        out.append(rel)
    return out


def same_kernels(rebuilt: dict[str, Any], committed: dict[str, Any]) -> bool:
    """Whether a rebuild ran on the kernels the committed world was built with: the same torch,
    ATen capability and finer CPU features (`cpu_kernels`, traces/tiny-world/world_kernels.py).
    A MANIFEST without `cpu_kernels` (built before it was recorded) says too little: a rebuild
    is then compared numerically (two AVX-512 hosts, one with AMX, rebuilt the same world with
    other bits)."""
    keys = ("torch_version", "cpu_capability", "cpu_kernels")
    if committed.get("cpu_kernels") is None:
        return False
    return all(rebuilt.get(k) == committed.get(k) for k in keys)
