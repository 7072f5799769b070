"""Slot fingerprints (pure): which stored or recorded aux slot holds which hidden state.

Labels lie (layer-id conventions differ by one between libraries), so slots are identified by
their numbers: every serving slot is compared with every training slot on the same aligned
tokens (mean per-token cosine, ratio of mean norms), and, when the target model is at hand,
with every layer of a reference target forward (HF `output_hidden_states` index: 0 = the
embeddings, k = the residual stream after k layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# The same state stored twice in bf16 has a cosine above this; a neighbouring layer is lower.
SAME_COS = 0.999
# Below this a slot does not track its tokens at all (no layer, no slot explains it).
UNRELATED_COS = 0.5


@dataclass(frozen=True)
class SlotMatrix:
    """`cos[i, j]`: mean per-token cosine of serving slot i and training slot j; `rel_norm[i,
    j]`: mean norm of serving slot i over mean norm of training slot j."""

    cos: np.ndarray
    rel_norm: np.ndarray

    @property
    def best(self) -> np.ndarray:
        return self.cos.argmax(axis=1)

    def to_json(self) -> dict[str, list[list[float]]]:
        return {
            "cos": np.round(self.cos, 6).tolist(),
            "rel_norm": np.round(self.rel_norm, 6).tolist(),
        }


@dataclass(frozen=True)
class SlotHealth:
    zero_rows: float  # fraction of token rows that are exactly zero
    constant: bool  # every row (nearly) identical: the state does not track its tokens
    mean_norm: float

    @property
    def corrupt(self) -> bool:
        return self.zero_rows > 0.5 or self.constant


def as_slots(x: torch.Tensor, slot_width: int) -> torch.Tensor:
    """[N, K*H] or [N, K, H] -> [N, K, H] in fp32."""
    x = x.float()
    if x.dim() == 2:
        if x.shape[1] % slot_width:
            raise ValueError(f"width {x.shape[1]} is not a multiple of the slot width {slot_width}")
        x = x.reshape(x.shape[0], -1, slot_width)
    return x


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def slot_matrix(serving: torch.Tensor, training: torch.Tensor) -> SlotMatrix:
    """serving [N, Ks, H], training [N, Kt, H], rows aligned token for token."""
    if serving.shape[0] != training.shape[0] or serving.shape[-1] != training.shape[-1]:
        raise ValueError(f"cannot compare slots {tuple(serving.shape)} and {tuple(training.shape)}")
    s, t = serving.float(), training.float()
    cos = torch.einsum("nih,njh->ij", _unit(s), _unit(t)) / max(s.shape[0], 1)
    ns, nt = s.norm(dim=-1).mean(0), t.norm(dim=-1).mean(0)
    rel = ns[:, None] / nt[None, :].clamp_min(1e-12)
    return SlotMatrix(cos=cos.numpy().astype(np.float64), rel_norm=rel.numpy().astype(np.float64))


def slot_health(x: torch.Tensor) -> list[SlotHealth]:
    """Per slot of x [N, K, H]: zero rows and constant rows (capture not active, a stale
    CUDA-graph buffer, a hybrid model that writes nothing)."""
    acc = SlotHealthSum(x[0] if x.shape[0] else None, x.shape[1])
    acc.add(0, x)
    return acc.result()


class SlotHealthSum:
    """`slot_health` of rows given part by part, in any order (`hstrace.replay.scan` reads a
    request at a time): the per-row norms are kept (one number a row and slot) and joined in
    part order, the spread against the whole's first row is reduced as parts come, so the
    result is the one `slot_health` gives on all rows at once."""

    def __init__(self, first_row: torch.Tensor | None, slots: int) -> None:
        self.first = first_row.float() if first_row is not None else None  # [K, H]
        self.slots = slots
        self.norms: dict[int, list[torch.Tensor]] = {}  # part order -> per slot [n]
        self.spread: list[torch.Tensor] = []  # per part: [K] max distance to the first row

    def add(self, order: int, x: torch.Tensor) -> None:
        x = x.float()
        self.norms[order] = [x[:, k].norm(dim=-1) for k in range(x.shape[1])]
        if x.shape[0]:
            self.spread.append(
                torch.stack(
                    [
                        (x[:, k] - self.first[k : k + 1]).norm(dim=-1).max()
                        for k in range(x.shape[1])
                    ]
                )
            )

    def result(self) -> list[SlotHealth]:
        order = sorted(self.norms)
        out = []
        for k in range(self.slots):
            parts = [self.norms[o][k] for o in order]
            norms = torch.cat(parts) if parts else torch.zeros(0)
            n = norms.shape[0]
            zero = float((norms == 0).float().mean()) if n else 0.0
            spread = torch.stack([s[k] for s in self.spread]).max() if n > 1 else torch.tensor(1.0)
            constant = n > 1 and bool(spread <= 1e-3 * norms.max().clamp_min(1e-12))
            out.append(
                SlotHealth(
                    zero_rows=zero, constant=constant and zero < 1.0, mean_norm=float(norms.mean())
                )
            )
        return out


@dataclass(frozen=True)
class LayerFingerprint:
    """Per slot: the reference-target layer (HF hidden_states index) it matches best."""

    layer: list[int]
    cos: list[float]
    cos_all: np.ndarray  # [K, L+1]

    def to_json(self) -> dict[str, object]:
        return {
            "layer": self.layer,
            "cos": [round(c, 6) for c in self.cos],
            "cos_all": np.round(self.cos_all, 4).tolist(),
        }


def layer_fingerprint(slots: torch.Tensor, layers: torch.Tensor) -> LayerFingerprint:
    """slots [N, K, H] against layers [N, L+1, H] (the reference forward on the same tokens)."""
    m = slot_matrix(slots, layers)
    best = m.cos.argmax(axis=1)
    return LayerFingerprint(
        layer=[int(b) for b in best],
        cos=[float(m.cos[i, b]) for i, b in enumerate(best)],
        cos_all=m.cos,
    )


def rows_of_other_requests(
    serving: list[torch.Tensor], training: list[torch.Tensor]
) -> list[tuple[int, int, float]]:
    """For each aligned request i whose slots do not match its own training rows, the other
    request j whose training rows it matches (crossed rows: batch-index bugs). Inputs are
    per-request [N_i, K, H] on aligned tokens; returns (i, j, cos)."""
    found = []
    for i, s in enumerate(serving):
        own = _mean_cos(s, training[i])
        if own >= SAME_COS:
            continue
        for j, t in enumerate(training):
            if j == i:
                continue
            n = min(len(s), len(t))
            if n == 0:
                continue
            c = _mean_cos(s[:n], t[:n])
            if c >= SAME_COS:
                found.append((i, j, c))
                break
    return found


def _mean_cos(a: torch.Tensor, b: torch.Tensor) -> float:
    n = min(len(a), len(b))
    if n == 0:
        return 0.0
    return float((_unit(a[:n].float()) * _unit(b[:n].float())).sum(-1).mean())
