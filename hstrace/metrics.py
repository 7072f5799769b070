"""Drafter accuracy metrics, each with its convention next to it, so hstrace's numbers can be put
next to the training libraries' and the engines' (training-formats.md §3.6, §4.4, §8).

Shared alignment (EAGLE-3, all libraries): the drafter's step-0 row t sees aux[t] and the token
at t+1, and predicts the token at t+2. Its reference is therefore the target's distribution *at
position t+1*, and the row counts where the loss mask at t+1 is set (the libraries shift the mask
the same way). The last row has no reference and never counts. Step k (teacher-forced) row t
predicts the token at t+2+k; its reference is the target at t+1+k, under the mask at t+1+k.

Spaces: draft ids live in the draft vocab [0, Vd); `d2t` maps them to target ids by offset
(`target = i + d2t[i]`). A comparison is either in draft space (against the teacher restricted to
the draft vocab, speculators' `full_acc_k`) or in target space (against a full-vocab argmax,
SpecForge's `acc_k` and what serving verification does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from hstrace.errors import CheckpointError


@dataclass(frozen=True)
class Accuracy:
    correct: int
    total: int

    @property
    def value(self) -> float:
        return self.correct / self.total if self.total else float("nan")

    def __add__(self, other: Accuracy) -> Accuracy:
        return Accuracy(self.correct + other.correct, self.total + other.total)


def _rows(loss_mask: Tensor, k: int = 0) -> Tensor:
    """Which step-k rows count: row t counts if loss_mask[t+1+k] (rows without a reference: no)."""
    m = torch.zeros_like(loss_mask, dtype=torch.bool)
    n = loss_mask.shape[-1] - 1 - k
    if n > 0:
        m[..., :n] = loss_mask[..., 1 + k :].bool()
    return m


def reference_ids(target_logits: Tensor, k: int = 0) -> Tensor:
    """Target-space reference for step-k rows: argmax of the target at position t+1+k (row t).
    `target_logits` [.., T, V] are per position (position p scores the token at p+1). Rows past
    the end get -1."""
    ref = torch.full(target_logits.shape[:-1], -1, dtype=torch.int64)
    n = target_logits.shape[-2] - 1 - k
    if n > 0:
        ref[..., :n] = target_logits[..., 1 + k :, :].argmax(-1)
    return ref


def accuracy_target_space(
    draft_target_ids: Tensor, reference: Tensor, loss_mask: Tensor, k: int = 0
) -> Accuracy:
    """Step-k draft tokens (already mapped to target ids) vs a target-space reference per row.

    Used three ways for step 0:
    - `acc0_target`: reference = the real target's argmax at t+1 on the training tokens
      (`reference_ids(hf_target_logits)`); the number serving verification would see.
    - on serving tensors: the same, with the drafter run on recorded serving aux.
    - SpecForge `acc_k` (unconditional, full vocab) when the reference is its teacher's argmax.
    """
    rows = _rows(loss_mask, k)
    hit = (draft_target_ids == reference) & rows
    return Accuracy(int(hit.sum()), int(rows.sum()))


def accuracy_draft_space(
    draft_logits: Tensor, teacher_draft_vocab: Tensor, loss_mask: Tensor, k: int = 0
) -> Accuracy:
    """`acc0_spec` (k=0) / unconditional step-k accuracy in draft space: argmax of the drafter vs
    argmax of the library's teacher restricted to the draft vocab (`teacher[..., t2d]`), the
    teacher row being position t+1+k. Matches speculators `full_acc_0` for k=0. Note: when the
    target's true argmax lies outside the draft vocab this still counts a hit (serving would not)."""
    rows = _rows(loss_mask, k)
    n = draft_logits.shape[-2] - 1 - k
    hit = torch.zeros_like(rows)
    if n > 0:
        d = draft_logits[..., :n, :].argmax(-1)
        t = teacher_draft_vocab[..., 1 + k :, :].argmax(-1)
        hit[..., :n] = d == t
    hit &= rows
    return Accuracy(int(hit.sum()), int(rows.sum()))


@dataclass(frozen=True)
class PerPosition:
    """Teacher-forced accuracy over K steps (training-formats §8).

    - `uncond[k]`: step-k rows correct, over step-k rows (SpecForge/EAGLE `acc_k`).
    - `full[k]`: rows correct at every step 0..k, over step-0 rows (speculators `full_acc_k`, and
      vLLM's per-position acceptance rate for a greedy chain).
    - `cond[k]` = full[k] / full[k-1] (speculators `cond_acc_k`).
    """

    uncond: list[float]
    full: list[float]
    cond: list[float]


def per_position_accuracy(hits: list[Tensor], loss_mask: Tensor) -> PerPosition:
    """`hits[k]` bool [.., T]: row t correct at step k (any space; rows past T-1-k ignored)."""
    rows0 = _rows(loss_mask, 0)
    n0 = max(int(rows0.sum()), 1)
    alive = rows0.clone()
    uncond, full, cond = [], [], []
    prev = float(rows0.sum())
    for k, h in enumerate(hits):
        rows_k = _rows(loss_mask, k)
        uncond.append(float((h & rows_k).sum()) / max(int(rows_k.sum()), 1))
        alive = alive & h & rows_k
        n = float(alive.sum())
        full.append(n / n0)
        cond.append(n / prev if prev else 0.0)
        prev = n
    return PerPosition(uncond, full, cond)


def simulated_acceptance_length(full_acc: list[float], count_bonus: bool = True) -> float:
    """Expected tokens per verify round of a greedy chain of K = len(full_acc) drafts, from the
    fraction of rows whose first k+1 drafts are all correct: Σ_k full_acc[k], plus 1 for the
    bonus token (the target's own token after the accepted drafts) when `count_bonus`.

    count_bonus=True matches SGLang `accept_len`/`spec_accept_length` and vLLM's mean acceptance
    length; count_bonus=False with SpecForge's unconditional-product input matches its
    `eval/simulated_acc_len` (which has no +1). hstrace's trace `accept_len` excludes the bonus."""
    return float(sum(full_acc)) + (1.0 if count_bonus else 0.0)


def chain_acceptance_length(drafts: Tensor, reference: Tensor, count_bonus: bool = True) -> float:
    """Mean acceptance of greedy chains: `drafts` [R, K] target-space draft tokens per round,
    `reference` [R, K] the target's greedy tokens at the same positions; a round accepts the
    longest matching prefix (+1 bonus when `count_bonus`)."""
    if drafts.shape[0] == 0:
        return float("nan")
    match = (drafts == reference).to(torch.int64).cumprod(-1).sum(-1).float()
    return float(match.mean()) + (1.0 if count_bonus else 0.0)


@dataclass(frozen=True)
class TargetHead:
    """The target's final norm and lm_head: enough to rebuild a library's teacher from the stored
    last state (speculators: `lm_head(norm(last))`, pre-norm; SpecForge: `lm_head(last)`, post)."""

    norm_weight: Tensor
    lm_head: Tensor  # [V, Ht]
    eps: float

    @classmethod
    def from_pretrained(cls, path: str | Path) -> TargetHead:
        from safetensors import safe_open

        root = Path(path)
        try:
            cfg = json.loads((root / "config.json").read_text())
            want = {"model.norm.weight": None, "lm_head.weight": None}
            for f in sorted(root.glob("*.safetensors")):
                with safe_open(str(f), "pt") as st:
                    for k in want:
                        if k in st.keys():
                            want[k] = st.get_tensor(k)
            if cfg.get("tie_word_embeddings") and want["lm_head.weight"] is None:
                with safe_open(str(sorted(root.glob("*.safetensors"))[0]), "pt") as st:
                    want["lm_head.weight"] = st.get_tensor("model.embed_tokens.weight")
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{root}: cannot read target head ({exc})") from exc
        missing = [k for k, v in want.items() if v is None]
        if missing:
            raise CheckpointError(f"{root}: target checkpoint lacks {missing}")
        return cls(
            want["model.norm.weight"].float(),
            want["lm_head.weight"].float(),
            float(cfg.get("rms_norm_eps", 1e-6)),
        )

    def teacher_logits(self, last: Tensor, last_norm: str) -> Tensor:
        """Full-vocab teacher logits [.., T, V] from a stored last state, per its norm state."""
        x = last.float()
        if last_norm == "pre":
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        elif last_norm != "post":
            raise ValueError(f"last_norm must be 'pre' or 'post', got {last_norm!r}")
        return x @ self.lm_head.T
