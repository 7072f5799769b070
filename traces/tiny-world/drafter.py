"""Train the tiny world's EAGLE-3 drafter on the dumped training tensors (speculators layout:
aux = HF hs[2], hs[4], hs[5]; teacher = target lm_head(norm(pre-norm final)) restricted to the
draft vocab), with hstrace's reference drafter and plain autograd, then evaluate on held-out
samples with `hstrace.metrics`."""

from __future__ import annotations

from dataclasses import replace

import torch

from hstrace.drafter import DrafterConfig, Eagle3Drafter, ttt_loss
from hstrace.metrics import (
    Accuracy,
    TargetHead,
    accuracy_draft_space,
    accuracy_target_space,
    per_position_accuracy,
    reference_ids,
    simulated_acceptance_length,
)


def drafter_config(target_cfg, d2t_len: int) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=target_cfg.hidden_size,
        vocab_size=target_cfg.vocab_size,
        draft_vocab_size=d2t_len,
        num_attention_heads=2,  # head_dim 32, as the target (engines' CPU kernels need >= 32)
        num_key_value_heads=1,
        intermediate_size=128,
        target_hidden_size=target_cfg.hidden_size,
        num_aux=3,
        num_hidden_layers=1,
        rope_theta=10000.0,
        norm_before_residual=False,  # expressible in both dialects (SpecForge has no such flag)
        feed_normed=False,
        logits_use_norm=True,
    )


def batch(samples, head: TargetHead, t2d: torch.Tensor):
    """Stack samples into (next_ids [B,T], aux [B,T,3H] fp32, teacher [B,T,Vd], mask [B,T])."""
    ids = torch.stack([s.input_ids for s in samples])
    aux = torch.stack([s.aux_concat for s in samples]).float()
    teacher = torch.stack([head.teacher_logits(s.last, s.last_norm) for s in samples])
    mask = torch.stack([s.loss_mask for s in samples])
    next_ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)  # row t: token t+1
    # ttt_loss compares row t with teacher row t; the reference for row t is position t+1
    teacher_rows = torch.cat([teacher[:, 1:], teacher[:, -1:]], 1)[..., t2d]
    mask_rows = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], 1)
    return ids, next_ids, aux, teacher[..., t2d], teacher_rows, mask, mask_rows


def train(model: Eagle3Drafter, train_samples, head, t2d, steps: int, seed: int, lr: float):
    torch.manual_seed(seed)
    _, next_ids, aux, _, teacher_rows, _, mask_rows = batch(train_samples, head, t2d)
    params = [p for n, p in model.named_parameters() if n != "embed_tokens.weight"]
    model.embed_tokens.weight.requires_grad_(False)  # frozen copy of the target's
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    res = None
    for _ in range(steps):
        outs = model.ttt(next_ids, aux, steps=2)
        res = ttt_loss([o.logits for o in outs], teacher_rows, mask_rows, step_decay=0.8)
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        opt.step()
        sched.step()
    return res


@torch.no_grad()
def evaluate(model: Eagle3Drafter, samples, head, t2d, target_logits, steps: int = 3) -> dict:
    """Held-out metrics. target_logits: per sample [T, V] from the real target (HF forward)."""
    ids, next_ids, aux, teacher_dv, _, mask, _ = batch(samples, head, t2d)
    outs = model.ttt(next_ids, aux, steps=steps)
    acc_teacher = accuracy_draft_space(outs[0].logits, teacher_dv, mask)
    tl = torch.stack(target_logits)
    acc_target = Accuracy(0, 0)
    hits = []
    for k, o in enumerate(outs):
        drafted = model.draft_to_target(o.logits.argmax(-1))
        ref = reference_ids(tl, k)
        if k == 0:
            acc_target = accuracy_target_space(drafted, ref, mask, 0)
        hits.append(drafted == ref)
    pp = per_position_accuracy(hits, mask)
    return {
        "acc0_teacher": acc_teacher.value,
        "acc0_target": acc_target.value,
        "rows": acc_teacher.total,
        "per_position_full": pp.full,
        "per_position_uncond": pp.uncond,
        "sim_accept_len_with_bonus": simulated_acceptance_length(pp.full, count_bonus=True),
    }


def with_layer_ids(model: Eagle3Drafter, ids: list[int]) -> Eagle3Drafter:
    model.cfg = replace(model.cfg, aux_layer_ids=ids)
    return model
