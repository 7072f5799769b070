"""Redaction for bundles that leave the building.

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
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from hstrace.errors import HstraceError

REDACT_MODES = ("ids", "hidden")

# Columns holding token ids, by vocab domain. Draft top-k ids live in the draft vocab.
TARGET_ID_COLUMNS = {"input_ids", "prompt_ids", "topk_target_ids", "bonus_id", "ids"}
DRAFT_ID_COLUMNS = {"topk_draft_ids"}
# Columns holding hidden states (one row per token; width = slots * slot_width).
HIDDEN_COLUMNS = {"aux_hidden", "hidden_in"}

SALT_BYTES = 32
SKETCH_DIM = 32
SKETCH_SEED = 20260601
STATS = ("mean", "std", "norm")
_MASK63 = (1 << 63) - 1


def new_salt() -> bytes:
    return os.urandom(SALT_BYTES)


def read_salt(path: str | os.PathLike[str]) -> bytes:
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise HstraceError(f"{p}: cannot read salt file ({exc.strerror})") from None
    salt = data.strip()
    if len(salt) < 16:
        raise HstraceError(f"{p}: salt file holds {len(salt)} bytes; need at least 16")
    return salt


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
