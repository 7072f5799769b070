"""Pair serving requests with training samples by their token ids (pure; no I/O).

A serving request is aligned with the training sample that shares the longest common prefix of
token ids with it. `exact`: the two sequences are identical. `prefix`: they share at least
`min_tokens` leading tokens (typically the prompt; a served generation then drifts from the
dataset's response). Only the common prefix is compared afterwards.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Fewer shared leading tokens than this is a coincidence, not the same text.
DEFAULT_MIN_TOKENS = 8


@dataclass(frozen=True)
class Match:
    serving: int  # index into the serving sequences
    training: int  # index into the training sequences
    kind: str  # "exact" | "prefix"
    length: int  # tokens in the common prefix: the ones compared


@dataclass(frozen=True)
class Coverage:
    serving_requests: int
    aligned_requests: int
    exact: int
    prefix: int
    serving_tokens: int
    aligned_tokens: int
    training_samples: int
    training_samples_matched: int

    @property
    def token_fraction(self) -> float:
        return self.aligned_tokens / self.serving_tokens if self.serving_tokens else 0.0

    def to_json(self) -> dict[str, int | float]:
        return {
            "serving_requests": self.serving_requests,
            "aligned_requests": self.aligned_requests,
            "exact": self.exact,
            "prefix": self.prefix,
            "serving_tokens": self.serving_tokens,
            "aligned_tokens": self.aligned_tokens,
            "aligned_token_fraction": round(self.token_fraction, 6),
            "training_samples": self.training_samples,
            "training_samples_matched": self.training_samples_matched,
        }


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def align(
    serving: Sequence[np.ndarray],
    training: Sequence[np.ndarray],
    min_tokens: int = DEFAULT_MIN_TOKENS,
) -> tuple[list[Match], Coverage]:
    """Best training sample for every serving sequence (longest common prefix, ties to the
    lower index). Candidates come from an index on the first `min_tokens` ids, so the cost is
    linear in the data, not quadratic."""
    index: dict[bytes, list[int]] = defaultdict(list)
    training = [np.asarray(t, dtype=np.int64).reshape(-1) for t in training]
    for j, ids in enumerate(training):
        if len(ids) >= min_tokens:
            index[ids[:min_tokens].tobytes()].append(j)

    matches: list[Match] = []
    serving_tokens = 0
    for i, raw in enumerate(serving):
        ids = np.asarray(raw, dtype=np.int64).reshape(-1)
        serving_tokens += len(ids)
        if len(ids) < min_tokens:
            continue
        best: tuple[int, int] | None = None
        for j in index.get(ids[:min_tokens].tobytes(), ()):
            n = common_prefix(ids, training[j])
            if best is None or n > best[1]:
                best = (j, n)
        if best is None:
            continue
        j, n = best
        exact = n == len(ids) == len(training[j])
        matches.append(Match(serving=i, training=j, kind="exact" if exact else "prefix", length=n))

    coverage = Coverage(
        serving_requests=len(serving),
        aligned_requests=len(matches),
        exact=sum(m.kind == "exact" for m in matches),
        prefix=sum(m.kind == "prefix" for m in matches),
        serving_tokens=serving_tokens,
        aligned_tokens=sum(m.length for m in matches),
        training_samples=len(training),
        training_samples_matched=len({m.training for m in matches}),
    )
    return matches, coverage
