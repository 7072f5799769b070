"""Checks a zip before anything reads it: bundles come from strangers (bug reports).

We never extract to disk; the trace inside is read through zarr's read-only `ZipStore`. What
can still hurt a reader is a member name that escapes (if someone does extract it), or a member
that inflates to far more than the file (a zip bomb) once zarr reads it. Both are judged from
the central directory alone, before any member is decompressed.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from hstrace.errors import TraceError

# Defaults sized for bug-report bundles: traces are stored (not deflated) because their chunks
# are already compressed, so a high ratio is suspicious on its own.
MAX_TOTAL_UNCOMPRESSED = 64 << 30
MAX_MEMBER_RATIO = 200.0
# The whole archive: trace chunks are stored and already compressed (ratio ~1), drafter
# weights deflate ~1.1x; 20x over the archive is far above any real bundle and stops a zip of
# many members each under the per-member limit (64 GB from 320 MB at 200x). What a reader
# then inflates per member is bounded again by what the trace declares for that array
# (hstrace/trace/guard.py).
MAX_TOTAL_RATIO = 20.0
# Below this the total ratio is not judged (a few small, well-compressing members).
RATIO_TOTAL_MIN_BYTES = 64 << 20
# Tiny members (zarr.json, offsets) may legitimately compress well; judge ratio above this size.
RATIO_MIN_BYTES = 1 << 20
MAX_MEMBERS = 1_000_000


@dataclass(frozen=True)
class ZipSummary:
    members: int
    compressed_bytes: int
    uncompressed_bytes: int


def unsafe_member_reason(name: str) -> str | None:
    """Why a member name could escape an extraction directory, or None if it is safe."""
    if not name or "\x00" in name:
        return "an empty or NUL-containing name"
    if "\\" in name:
        return "a backslash (Windows path separator)"
    if name.startswith("/") or PurePosixPath(name).is_absolute():
        return "an absolute path"
    if len(name) >= 2 and name[1] == ":":
        return "a drive letter"
    if any(part == ".." for part in PurePosixPath(name).parts):
        return "a '..' component"
    return None


def check_zip(
    path: str | os.PathLike[str],
    *,
    max_total: int = MAX_TOTAL_UNCOMPRESSED,
    max_ratio: float = MAX_MEMBER_RATIO,
) -> ZipSummary:
    """Validate `path`'s central directory; raise `TraceError` (one line) on anything unsafe.

    Checks: it is a readable zip, no member name escapes (absolute, `..`, backslash, drive),
    no duplicate names (readers disagree on which one wins), no symlink entries, total
    uncompressed size under `max_total`, and no member inflating more than `max_ratio` times.
    """
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{p}: no such bundle file")
    try:
        with zipfile.ZipFile(p) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as exc:
        raise TraceError(f"{p}: not a readable zip ({_one_line(exc)})") from None
    if len(infos) > MAX_MEMBERS:
        raise TraceError(f"{p}: {len(infos)} members, more than the {MAX_MEMBERS} allowed")
    seen: set[str] = set()
    total = packed = 0
    for info in infos:
        why = unsafe_member_reason(info.filename)
        if why:
            raise TraceError(f"{p}: member {info.filename!r} has {why}; refusing to read it")
        if info.filename in seen:
            raise TraceError(f"{p}: member {info.filename!r} appears twice; refusing to read it")
        seen.add(info.filename)
        # Unix mode in the high 16 bits; 0o120000 is a symlink.
        if (info.external_attr >> 16) & 0o170000 == 0o120000:
            raise TraceError(f"{p}: member {info.filename!r} is a symlink; refusing to read it")
        if info.file_size < 0 or info.compress_size < 0:
            raise TraceError(f"{p}: member {info.filename!r} has a negative size")
        if info.file_size > RATIO_MIN_BYTES and info.file_size > max_ratio * max(
            1, info.compress_size
        ):
            raise TraceError(
                f"{p}: member {info.filename!r} inflates {info.file_size / max(1, info.compress_size):.0f}x "
                f"(limit {max_ratio:.0f}x); refusing a possible zip bomb"
            )
        total += info.file_size
        packed += info.compress_size
        if total > max_total:
            raise TraceError(
                f"{p}: uncompressed size exceeds {max_total} bytes; refusing a possible zip bomb"
            )
    if total > RATIO_TOTAL_MIN_BYTES and total > MAX_TOTAL_RATIO * max(1, packed):
        raise TraceError(
            f"{p}: members inflate {total / max(1, packed):.0f}x in total ({total} bytes from "
            f"{packed}; limit {MAX_TOTAL_RATIO:.0f}x); refusing a possible zip bomb"
        )
    return ZipSummary(members=len(infos), compressed_bytes=packed, uncompressed_bytes=total)


def read_member(
    path: str | os.PathLike[str], name: str, *, max_bytes: int = 64 << 20
) -> bytes | None:
    """One member's bytes, read with a hard cap (the declared size may lie); None if absent."""
    try:
        with zipfile.ZipFile(path) as zf:
            try:
                info = zf.getinfo(name)
            except KeyError:
                return None
            if info.file_size > max_bytes:
                raise TraceError(f"{path}: member {name!r} is larger than {max_bytes} bytes")
            with zf.open(info) as fh:
                data = fh.read(max_bytes + 1)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise TraceError(f"{path}: member {name!r} cannot be read ({_one_line(exc)})") from None
    if len(data) > max_bytes:
        raise TraceError(f"{path}: member {name!r} inflates past {max_bytes} bytes")
    return data


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
