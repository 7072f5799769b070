"""Replaying a redacted bundle (`hstrace bundle --redact ids|hidden`, see docs/bundles.md).

`ids`: token ids are salted 63-bit hashes; the drafter cannot embed them. The hash is a pure
function of (salt, domain, id) over a finite vocabulary, so whoever holds the salt recovers
every id by hashing the whole vocabulary once and inverting the table; without the salt
nothing can be replayed (not even alignment with training data, whose ids are in the clear),
so that is one-line bad input that says what to pass.

`hidden`: the hidden-state columns are gone; the per-slot sketches that replace them still
fingerprint slots (see `hstrace.replay.slots.Slots`).

What a bundle's redaction says and how its salt is found live in `hstrace.redaction`, shared
with `hstrace bundle`; this module only turns hashes back into ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hstrace.redaction import RedactedIdsError, hash_token_ids


@dataclass
class IdRecovery:
    """hash -> id tables for the target and the draft vocabularies under one salt."""

    salt: bytes
    tables: dict[str, tuple[np.ndarray, np.ndarray]]  # domain -> (sorted hashes, their ids)

    @classmethod
    def build(cls, salt: bytes, vocab_size: int, draft_vocab_size: int) -> IdRecovery:
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
