"""Replaying a redacted bundle (`hstrace bundle --redact ids|hidden`, see docs/bundles.md).

`ids`: token ids are salted 63-bit hashes; the drafter cannot embed them. The hash is a pure
function of (salt, domain, id) over a finite vocabulary, so whoever holds the salt recovers
every id by hashing the whole vocabulary once and inverting the table; without the salt
nothing can be replayed (not even alignment with training data, whose ids are in the clear),
so that is one-line bad input that says what to pass.

`hidden`: the hidden-state columns are gone; the per-slot sketches that replace them still
fingerprint slots (see `hstrace.replay.context.ReplayContext.slots`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hstrace.errors import HstraceError


class RedactedIdsError(HstraceError):
    """A bundle with hashed token ids and no (matching) salt to recover them."""


def redaction_of(meta: dict[str, Any]) -> dict[str, Any]:
    """The trace's `static.bundle.redaction` ({} for a plain trace)."""
    static = meta.get("static") or {}
    return dict(((static.get("bundle") or {}).get("redaction")) or {})


def redaction_modes(meta: dict[str, Any]) -> tuple[str, ...]:
    return tuple(redaction_of(meta).get("modes") or ())


def _salt_candidates(data: bytes) -> list[bytes]:
    """`hstrace bundle` writes a fresh salt as hex text, while `--salt-file` takes the file's
    bytes as they are: try both readings, the recorded digest decides."""
    raw = data.strip()
    out = [raw]
    try:
        out.append(bytes.fromhex(raw.decode("ascii")))
    except (UnicodeDecodeError, ValueError):
        pass
    return out


def find_salt(trace_path: Path, salt_file: Path | None, digest: str | None) -> tuple[bytes, Path]:
    """The salt of an ids-redacted bundle: `salt_file`, else `<bundle>.salt` next to it (where
    `hstrace bundle` writes it). Checked against the bundle's recorded SHA-256."""
    from hstrace.bundle.redact import salt_digest

    how = (
        "the drafter cannot embed hashed ids: give --salt-file FILE (the salt `hstrace bundle` "
        "wrote next to the zip), or replay the unredacted trace"
    )
    path = Path(salt_file) if salt_file is not None else Path(str(trace_path) + ".salt")
    if not path.is_file():
        where = f"--salt-file {path} does not exist" if salt_file else f"no {path.name} beside it"
        raise RedactedIdsError(
            f"{trace_path}: token ids are redacted (salted hashes), {where}; {how}"
        )
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RedactedIdsError(f"{path}: cannot read salt file ({exc.strerror})") from None
    for salt in _salt_candidates(data):
        if digest is None or salt_digest(salt) == digest:
            return salt, path
    raise RedactedIdsError(
        f"{path}: this salt is not the one {trace_path} was redacted with (SHA-256 differs); "
        "give the salt file written when the bundle was made"
    )


@dataclass
class IdRecovery:
    """hash -> id tables for the target and the draft vocabularies under one salt."""

    salt: bytes
    tables: dict[str, tuple[np.ndarray, np.ndarray]]  # domain -> (sorted hashes, their ids)

    @classmethod
    def build(cls, salt: bytes, vocab_size: int, draft_vocab_size: int) -> IdRecovery:
        from hstrace.bundle.redact import hash_token_ids

        tables = {}
        # -1 is included: engines pad unused top-k entries with it.
        for domain, size in (("target", vocab_size), ("draft", draft_vocab_size)):
            ids = np.arange(-1, size, dtype=np.int64)
            hashes = hash_token_ids(ids, salt, domain=domain)
            order = np.argsort(hashes)
            tables[domain] = (hashes[order], ids[order])
        return cls(salt, tables)

    def recover(self, x: Any, domain: str = "target") -> Any:
        """The clear ids of hashed `x` (numpy or torch, same type and shape back)."""
        if x is None:
            return None
        is_torch = isinstance(x, torch.Tensor)
        arr = (x.numpy() if is_torch else np.asarray(x)).astype(np.int64)
        hashes, ids = self.tables[domain]
        at = np.clip(np.searchsorted(hashes, arr), 0, len(hashes) - 1)
        found = hashes[at] == arr
        if not found.all():
            raise RedactedIdsError(
                f"{int((~found).sum())} hashed {domain} ids match no id of the drafter's "
                f"{domain} vocabulary ({len(ids) - 1} ids) under this salt: wrong drafter?"
            )
        out = ids[at]
        return torch.from_numpy(out) if is_torch else out


def recover_serving_ids(serving: Any, recovery: IdRecovery) -> None:
    """Replace the hashed ids of a `ServingData` in place by the clear ones."""
    for r in serving.requests:
        r.tokens = recovery.recover(r.tokens)
        d = r.draft
        if d is not None:
            d.input_ids = recovery.recover(d.input_ids)
            d.topk_target_ids = recovery.recover(d.topk_target_ids)
            d.topk_draft_ids = recovery.recover(d.topk_draft_ids, domain="draft")
        for c in getattr(r, "chains", []):
            c.input_ids = recovery.recover(c.input_ids)
            c.topk_draft_ids = recovery.recover(c.topk_draft_ids, domain="draft")
