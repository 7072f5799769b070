"""Bug-report bundles: a trace subset, its manifest, the replay verdict, one zip.

Public API: `make_bundle`, `BundleOptions`, `parse_size`, `read_salt`, `check_zip`,
`bundle_info`; token-id redaction for the training side: `hstrace.redaction.hash_token_ids`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hstrace.bundle.manifest import MANIFEST, REPORT, REPRODUCE
from hstrace.bundle.pack import BundleOptions, BundleResult, make_bundle, parse_size
from hstrace.errors import TraceError
from hstrace.redaction import hash_token_ids, read_salt
from hstrace.trace.safezip import check_zip, read_member

__all__ = [
    "BundleOptions",
    "BundleResult",
    "bundle_info",
    "check_zip",
    "hash_token_ids",
    "make_bundle",
    "parse_size",
    "read_salt",
]


def bundle_info(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest, REPORT.md and reproduce line of a bundle zip; None for a plain trace zip."""
    check_zip(path)
    raw = read_member(path, MANIFEST)
    if raw is None:
        return None
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: {MANIFEST} is not valid JSON ({exc})") from None
    report = read_member(path, REPORT) or b""
    repro = read_member(path, REPRODUCE) or b""
    return {
        "manifest": manifest,
        "report": report.decode("utf-8", "replace"),
        "reproduce": repro.decode("utf-8", "replace").strip(),
    }
