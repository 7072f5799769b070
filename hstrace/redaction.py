"""Redaction of token ids and hidden states: what `hstrace bundle --redact` writes and what
replay reads back (one module below both, so the two sides cannot drift apart).

`ids`: every token id becomes a salted 63-bit hash. The map is a pure function of (salt, id),
so the same salt applied to the training side (`hash_token_ids`) gives the same values and
requests still align with training samples by token ids; equal ids stay equal, nothing else
about them survives. Draft-vocab ids are hashed in their own domain so that draft id 5 and
target id 5 do not become the same value.

`hidden`: hidden-state columns are dropped. Per token and per slot we keep the mean, the std
and the L2 norm, plus a fingerprint: a seeded Gaussian random projection of the slot to
`SKETCH_DIM` values (Johnson-Lindenstrauss), which keeps cosine similarities between slots and
training-time layers approximately (error ~ 1/sqrt(SKETCH_DIM)) but cannot be inverted back
to the hidden state.

The salt: one rule for every salt file. Its bytes, stripped of surrounding whitespace, ARE the
salt (at least 16 bytes); a fresh salt is 32 random bytes written as 64 hex characters, and
those characters are the salt, so a `.salt` file written by one bundle can be passed as
`--salt-file` to the next bundle, to replay, or read on the training side with `read_salt`.
Bundles made before this rule hashed with the hex-decoded bytes of their `.salt` file; a
recorded digest (`salt_sha256`) tells the two readings apart, so those still replay.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hstrace.errors import HstraceError

REDACT_MODES = ("ids", "hidden")

# Columns holding token ids, by vocab domain. Draft top-k ids live in the draft vocab.
TARGET_ID_COLUMNS = {
    "input_ids",
    "prompt_ids",
    "topk_target_ids",
    "bonus_id",
    "ids",
    "target_argmax",  # verify: the target's argmax at each drafted position
}
DRAFT_ID_COLUMNS = {"topk_draft_ids"}
# Columns holding hidden states (one row per token; width = slots * slot_width).
HIDDEN_COLUMNS = {"aux_hidden", "hidden_in"}

SALT_BYTES = 32  # random bytes in a fresh salt (written, and used, as their hex text)
MIN_SALT_BYTES = 16
SKETCH_DIM = 32
SKETCH_SEED = 20260601
STATS = ("mean", "std", "norm")
_MASK63 = (1 << 63) - 1


class RedactedIdsError(HstraceError):
    """A bundle with hashed token ids and no (matching) salt to recover them."""


def redaction_of(meta: dict[str, Any]) -> dict[str, Any]:
    """The trace's `static.bundle.redaction` ({} for a plain trace)."""
    static = meta.get("static") or {}
    return dict(((static.get("bundle") or {}).get("redaction")) or {})


def redaction_modes(meta: dict[str, Any]) -> tuple[str, ...]:
    return tuple(redaction_of(meta).get("modes") or ())


def new_salt() -> bytes:
    """A fresh salt: 32 random bytes as 64 hex characters (the salt file holds exactly it)."""
    return os.urandom(SALT_BYTES).hex().encode("ascii")


def _salt_readings(data: bytes) -> list[bytes]:
    """The salt a file holds (its stripped bytes), then the legacy reading (hex-decoded) that
    bundles made before the one-rule salt used; only a recorded digest may pick the latter."""
    raw = data.strip()
    out = [raw]
    try:
        legacy = bytes.fromhex(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return out
    if legacy:
        out.append(legacy)
    return out


def _read_salt_bytes(p: Path, error: type[HstraceError]) -> bytes:
    try:
        return p.read_bytes()
    except OSError as exc:
        raise error(f"{p}: cannot read salt file ({exc.strerror})") from None


def read_salt(path: str | os.PathLike[str]) -> bytes:
    """The salt in a salt file (its bytes, stripped): for `hstrace bundle --salt-file` and for
    hashing the training side with `hash_token_ids`."""
    p = Path(path)
    salt = _salt_readings(_read_salt_bytes(p, HstraceError))[0]
    if len(salt) < MIN_SALT_BYTES:
        raise HstraceError(
            f"{p}: salt file holds {len(salt)} bytes; need at least {MIN_SALT_BYTES}"
        )
    return salt


def find_salt(trace_path: Path, salt_file: Path | None, digest: str | None) -> tuple[bytes, Path]:
    """The salt of an ids-redacted bundle: `salt_file`, else `<bundle>.salt` next to it (where
    `hstrace bundle` writes it). Checked against the bundle's recorded SHA-256."""
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
    readings = _salt_readings(_read_salt_bytes(path, RedactedIdsError))
    for salt in readings if digest is not None else readings[:1]:
        if digest is None or salt_digest(salt) == digest:
            return salt, path
    raise RedactedIdsError(
        f"{path}: this salt is not the one {trace_path} was redacted with (SHA-256 differs); "
        "give the salt file written when the bundle was made"
    )


def salt_digest(salt: bytes) -> str:
    """What the manifest records: enough to check a salt file, useless to recover ids."""
    return hashlib.sha256(b"hstrace-salt-v1" + salt).hexdigest()


def hash_token_ids(
    ids: np.ndarray | torch.Tensor, salt: bytes, domain: str = "target"
) -> np.ndarray:
    """Salted 63-bit hashes of integer token ids (int64, same shape). Pure in (salt, domain, id):
    apply it to training-side ids with the same salt and the two sides align again."""
    arr = ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    if arr.size == 0:
        return arr.astype(np.int64)
    uniq, inverse = np.unique(arr.astype(np.int64).ravel(), return_inverse=True)
    key = hashlib.blake2b(salt, digest_size=32, person=domain.encode()[:16]).digest()
    hashed = np.fromiter(
        (
            int.from_bytes(
                hashlib.blake2b(
                    int(v).to_bytes(8, "little", signed=True), digest_size=8, key=key
                ).digest(),
                "little",
            )
            & _MASK63
            for v in uniq
        ),
        dtype=np.int64,
        count=len(uniq),
    )
    return hashed[inverse].reshape(arr.shape)


def id_domain(column: str) -> str | None:
    if column in DRAFT_ID_COLUMNS:
        return "draft"
    if column in TARGET_ID_COLUMNS:
        return "target"
    return None


def _sketch_matrix(width: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SKETCH_SEED + width)
    return torch.randn(width, SKETCH_DIM, generator=gen, dtype=torch.float32) / SKETCH_DIM**0.5


def slot_statistics(hidden: torch.Tensor, slot_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For hidden [T, S*W]: (stats [T, S*3] as mean,std,norm per slot, sketch [T, S*SKETCH_DIM]).

    Computed in fp32 from the stored values; the sketch matrix depends only on the seed and W,
    so training-side slots projected with `sketch_slots` are comparable by cosine."""
    t = hidden.to(torch.float32)
    if t.ndim != 2 or slot_width <= 0 or t.shape[1] % slot_width:
        raise HstraceError(
            f"hidden width {tuple(t.shape)} is not a whole number of slots of width {slot_width}"
        )
    slots = t.reshape(t.shape[0], -1, slot_width)
    stats = torch.stack(
        [slots.mean(-1), slots.std(-1, correction=0), slots.norm(dim=-1)], dim=-1
    ).reshape(t.shape[0], -1)
    return stats, sketch_slots(slots)


def sketch_slots(slots: torch.Tensor) -> torch.Tensor:
    """[T, S, W] -> [T, S*SKETCH_DIM] seeded random projection (the redacted fingerprint)."""
    proj = slots.to(torch.float32) @ _sketch_matrix(slots.shape[-1])
    return proj.reshape(slots.shape[0], -1)
