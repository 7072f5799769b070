"""A TTT loss for training the reference drafter with plain autograd (speculators' alignment).

Step k's logits at row t predict the token the teacher row t+k scores, so step k compares
`logits[:, :T-k]` with `teacher[:, k:]` under `loss_mask[:, k:]`; a row counts as "fully
correct" at step k only if it was correct at every step before (speculators `full_acc_k`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TTTLoss:
    loss: Tensor  # scalar, differentiable: sum_k decay^k * KL_k
    step_losses: list[float]
    full_acc: list[float]  # P(steps 0..k all argmax-correct), teacher argmax over the draft vocab
    cond_acc: list[float]  # full_acc_k / full_acc_{k-1}


def ttt_loss(
    step_logits: list[Tensor],
    teacher_logits: Tensor,
    loss_mask: Tensor | None = None,
    step_decay: float = 1.0,
) -> TTTLoss:
    """step_logits[k]: [B, T, Vd] (or [T, Vd]); teacher_logits: draft-vocab teacher at each row
    [B, T, Vd]; loss_mask [B, T] (1 = train on this row)."""
    if teacher_logits.dim() == 2:
        step_logits = [s.unsqueeze(0) for s in step_logits]
        teacher_logits = teacher_logits.unsqueeze(0)
        loss_mask = loss_mask.unsqueeze(0) if loss_mask is not None else None
    B, T, _ = teacher_logits.shape
    mask = (
        loss_mask if loss_mask is not None else torch.ones(B, T, device=teacher_logits.device)
    ).bool()
    prev = mask.clone()
    total = teacher_logits.new_zeros(())
    losses, full, cond = [], [], []
    n_mask = mask.sum().clamp(min=1)
    prev_count = mask.sum().float()
    for k, logits in enumerate(step_logits):
        s = logits[:, : T - k].float()
        t = teacher_logits[:, k:].float()
        m = mask[:, k:]
        p_t = torch.softmax(t, -1)
        kl = (p_t * (torch.log_softmax(t, -1) - torch.log_softmax(s, -1))).sum(-1)
        step = (kl * m).sum() / m.sum().clamp(min=1)
        total = total + step_decay**k * step
        correct = (s.argmax(-1) == t.argmax(-1)) & m & prev[:, : T - k]
        prev = correct
        n_correct = correct.sum().float()
        losses.append(step.item())
        full.append((n_correct / n_mask).item())
        cond.append((n_correct / prev_count.clamp(min=1)).item())
        prev_count = n_correct
    return TTTLoss(total, losses, full, cond)
