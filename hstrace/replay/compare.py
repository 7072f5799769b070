"""The pure comparisons of stage compare (tensors in, numbers out; no replay imports): engine
vs reference draft outputs (`compare_topk`, `agreement_by_step`) and slot fingerprints
(`slot_matrix`, `slot_health`, `layer_fingerprint`). The evidence builders of the stage
(`slots`, `accuracy`, `agreement`, `inputs`) use them.

Engine vs reference draft outputs on identical recorded inputs.

The engine recorded, per draft row, its top-k draft ids, their log-probs and the mapped target
ids. The reference drafter is run on the same inputs in fp32 (the judge) and in bf16 (to learn
how far an honest low-precision kernel may stray). A max log-prob difference counts as noise
only when it is within a small multiple of that bf16-vs-fp32 spread: the tolerance is measured
on the same rows, never a fixed epsilon.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# -- compare -----------------------------------------------------------------------------------
# Argmax agreement at or above this counts as "the same function" (bf16 kernels of different
# engines agree on > 99% of rows; ties in tiny models cost a few percent).
AGREE_TOP1 = 0.9
# A what-if "reproduces" the engine when it reaches AGREE_TOP1 and beats the plain reference by
# this much.
WHATIF_MARGIN = 0.2
# How many bf16-vs-fp32 spreads a difference may reach and still count as numerical noise.
NOISE_MULTIPLE = 4.0


@dataclass(frozen=True)
class LogitAgreement:
    rows: int  # rows compared: those where the engine recorded a top-k
    k: int
    top1: float  # same draft-space argmax as the fp32 reference
    topk: float  # mean overlap of the top-k sets
    max_logprob_diff: float  # over the engine's known log-probs, vs fp32 (NaN: none known)
    noise_floor: float  # the same statistic for the reference itself in bf16
    tolerance: float
    rows_without_topk: int = 0  # recorded rows with no top-k (id -1): context only, not compared
    rows_ids_only: int = 0  # compared rows whose log-probs were not recorded (NaN): ids only

    @property
    def within_noise(self) -> bool:
        # Unknown log-probs are no evidence of a difference: the ids alone then decide.
        if self.max_logprob_diff != self.max_logprob_diff:
            return True
        return self.max_logprob_diff <= self.tolerance

    @property
    def agrees(self) -> bool:
        return self.top1 >= AGREE_TOP1

    def to_json(self) -> dict[str, float | int | bool | str | None]:
        known = self.max_logprob_diff == self.max_logprob_diff
        out: dict[str, float | int | bool | str | None] = {
            "rows": self.rows,
            "k": self.k,
            "top1_agreement": round(self.top1, 6),
            "topk_agreement": round(self.topk, 6),
            "max_logprob_diff": round(self.max_logprob_diff, 6) if known else None,
            "noise_floor_bf16_vs_fp32": round(self.noise_floor, 6),
            "tolerance": round(self.tolerance, 6),
            "within_noise": self.within_noise,
        }
        if self.rows_without_topk:
            out["rows_without_topk"] = self.rows_without_topk
        if self.rows_ids_only:
            out["rows_ids_only"] = self.rows_ids_only
            out["logprobs_note"] = (
                f"{self.rows_ids_only} of {self.rows} rows have no recorded log-probs (NaN: "
                "the engine took an argmax without probabilities); compared on ids only"
            )
        return out


def gathered_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits) at `ids` without materialising the full-vocab softmax. Ids < 0 (no
    top-k recorded there) are gathered at 0: mask them out with `known_logprobs`."""
    logits = logits.float()
    return logits.gather(-1, ids.long().clamp(min=0)) - torch.logsumexp(
        logits, dim=-1, keepdim=True
    )


def with_topk(ids: torch.Tensor) -> torch.Tensor:
    """[N] bool: rows where the engine recorded a top-k. SGLang computes draft logits only on
    some draft-extend rows and writes id -1 on the others; those rows still feed the drafter as
    context but have nothing to compare."""
    if ids.numel() == 0:
        return torch.zeros(ids.shape[0], dtype=torch.bool)
    return ids[:, 0].long() >= 0


def known_logprobs(ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """[N, k] bool: entries with a real id and a recorded log-prob (NaN = not recorded)."""
    return (ids.long() >= 0) & ~torch.isnan(logprobs.float())


@dataclass(frozen=True)
class RefRows:
    """What the comparisons need of reference logits [N, Vd] beside the engine's top-k ids
    [N, k], row by row: the logits themselves are not kept (a draft vocab of 32k is 128 KB a
    row in fp32), so replay's memory does not grow with them. Computed from one batch of
    logits at a time (`of`) and joined (`cat`); every per-row value is the one the full
    logits give."""

    argmax: torch.Tensor  # [N] the reference's argmax
    logprobs: torch.Tensor  # [N, k] log_softmax at the engine's ids (ids < 0 gathered at 0)
    topk: torch.Tensor | None = None  # [N, k] the reference's own top-k ids

    @classmethod
    def of(cls, logits: torch.Tensor, ids: torch.Tensor, topk: bool = True) -> RefRows:
        k = ids.shape[1] if ids.dim() == 2 else 0
        logits = logits.float()
        return cls(
            argmax=logits.argmax(-1),
            logprobs=gathered_logprobs(logits, ids),
            topk=logits.topk(k, dim=-1).indices if topk else None,
        )

    @classmethod
    def cat(cls, parts: list[RefRows]) -> RefRows:
        return cls(
            argmax=torch.cat([p.argmax for p in parts]),
            logprobs=torch.cat([p.logprobs for p in parts]),
            topk=torch.cat([p.topk for p in parts])
            if all(p.topk is not None for p in parts)
            else None,
        )

    def __getitem__(self, m: Any) -> RefRows:
        return RefRows(
            self.argmax[m], self.logprobs[m], self.topk[m] if self.topk is not None else None
        )

    def __len__(self) -> int:
        return int(self.argmax.shape[0])


def gap_at(ref_logprobs: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor | None) -> float:
    """`logprob_gap` from the reference's log-probs at `ids` (`RefRows.logprobs`)."""
    if logprobs is None:
        return float("nan")
    known = known_logprobs(ids, logprobs)
    if not known.any():
        return float("nan")
    gap = (logprobs.float() - ref_logprobs).abs()
    return float(gap[known].max())


def logprob_gap(logits: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor | None) -> float:
    """Max |engine log-prob - log_softmax(logits)| over the known entries; NaN when none."""
    if logprobs is None:
        return float("nan")
    return gap_at(gathered_logprobs(logits, ids), ids, logprobs)


def compare_topk(
    engine_ids: torch.Tensor,
    engine_logprobs: torch.Tensor | None,
    ref_logits: torch.Tensor | RefRows,
    ref_logits_lowp: torch.Tensor | None = None,
    *,
    lowp_logprobs: torch.Tensor | None = None,
) -> LogitAgreement:
    """engine_ids/logprobs [N, k] (draft space); ref_logits [N, Vd] fp32 on the same inputs
    (or their `RefRows`); ref_logits_lowp [N, Vd] the same reference in bf16 (sets the noise
    floor; or give `lowp_logprobs`, its log-probs at engine_ids [N, k]). Rows without a top-k (id -1) are left out;
    NaN log-probs count as unknown (those rows: ids only)."""
    k = engine_ids.shape[1] if engine_ids.dim() == 2 else 0
    ref = ref_logits if isinstance(ref_logits, RefRows) else RefRows.of(ref_logits, engine_ids)
    lowp = lowp_logprobs
    if ref_logits_lowp is not None:
        lowp = gathered_logprobs(ref_logits_lowp, engine_ids)
    keep = with_topk(engine_ids)
    dropped = int((~keep).sum())
    engine_ids = engine_ids[keep].long()
    ref = ref[keep]
    if engine_logprobs is not None:
        engine_logprobs = engine_logprobs[keep]
    if lowp is not None:
        lowp = lowp[keep]
    n = int(engine_ids.shape[0])
    if n == 0:
        return LogitAgreement(0, k, 0.0, 0.0, float("nan"), 0.0, 1e-4, rows_without_topk=dropped)
    ref_top = ref.topk
    top1 = float((ref_top[:, 0] == engine_ids[:, 0]).float().mean())
    real = engine_ids >= 0
    hits = ((engine_ids[:, :, None] == ref_top[:, None, :]).any(-1) & real).float().sum(-1)
    overlap = hits / real.sum(-1).clamp(min=1)
    diff = gap_at(ref.logprobs, engine_ids, engine_logprobs)
    ids_only = 0
    if engine_logprobs is not None:
        ids_only = int((~known_logprobs(engine_ids, engine_logprobs).any(-1)).sum())
    noise = 0.0
    if lowp is not None:
        spread = (lowp - ref.logprobs).abs()
        noise = float(spread[real].max())
    # The floor of 1e-4 covers an fp32 engine, whose spread against the judge is ~1e-6.
    tolerance = NOISE_MULTIPLE * noise + 1e-4
    return LogitAgreement(
        rows=n,
        k=k,
        top1=top1,
        topk=float(overlap.mean()),
        max_logprob_diff=diff,
        noise_floor=noise,
        tolerance=tolerance,
        rows_without_topk=dropped,
        rows_ids_only=ids_only,
    )


def agreement_by_step(
    steps: torch.Tensor,
    engine_ids: torch.Tensor,
    engine_logprobs: torch.Tensor | None,
    ref_logits: torch.Tensor | RefRows,
) -> list[dict[str, float | int]]:
    """`compare_topk`'s top-1 / top-k / max difference per recorded step (rows grouped by
    `steps` [N], ascending), so a drift that starts mid-run shows where it starts."""
    ref = ref_logits if isinstance(ref_logits, RefRows) else RefRows.of(ref_logits, engine_ids)
    out: list[dict[str, float | int]] = []
    for step in torch.unique(steps).tolist():
        rows = steps == step
        a = compare_topk(
            engine_ids[rows],
            engine_logprobs[rows] if engine_logprobs is not None else None,
            ref[rows],
        )
        out.append(
            {
                "step": int(step),
                "rows": a.rows,
                "top1_agreement": round(a.top1, 6),
                "topk_agreement": round(a.topk, 6),
                "max_logit_diff": (
                    round(a.max_logprob_diff, 6)
                    if a.max_logprob_diff == a.max_logprob_diff
                    else None
                ),
            }
        )
    return out


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of equal entries (token ids, argmaxes)."""
    if a.numel() == 0:
        return 0.0
    return float((a.long() == b.long()).float().mean())


# -- fingerprint -------------------------------------------------------------------------------
# Slot fingerprints (pure): which stored or recorded aux slot holds which hidden state.
#
# Labels lie (layer-id conventions differ by one between libraries), so slots are identified by
# their numbers: every serving slot is compared with every training slot on the same aligned
# tokens (mean per-token cosine, ratio of mean norms), and, when the target model is at hand,
# with every layer of a reference target forward (HF `output_hidden_states` index: 0 = the
# embeddings, k = the residual stream after k layers).

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
    """`slot_health` of rows given part by part, in any order (`hstrace.replay.runner` reads a
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
