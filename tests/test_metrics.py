"""hstrace.metrics: each convention checked on hand-made tensors, plus cross-checks against the
drafter room's `ttt_loss` (speculators alignment) and a real HF Llama for the teacher."""

from __future__ import annotations

import pytest
import torch

from hstrace.drafter import ttt_loss
from hstrace.metrics import (
    TargetHead,
    accuracy_draft_space,
    accuracy_target_space,
    chain_acceptance_length,
    per_position_accuracy,
    reference_ids,
    simulated_acceptance_length,
)


def one_hot_logits(ids: list[int], v: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), v).float()


def test_step0_rows_use_the_mask_and_reference_at_t_plus_1():
    # teacher at position p prefers token p % 4; drafter row t must predict teacher row t+1
    teacher = one_hot_logits([0, 1, 2, 3, 0], 4)
    draft = one_hot_logits([1, 2, 0, 0, 3], 4)  # rows 0,1 right; row 2 wrong; row 3 right
    mask = torch.tensor([0, 1, 1, 0, 1])  # rows counted: t with mask[t+1] -> 0, 1, 3
    acc = accuracy_draft_space(draft, teacher, mask)
    assert (acc.correct, acc.total) == (3, 3)
    acc_all = accuracy_draft_space(draft, teacher, torch.ones(5, dtype=torch.int64))
    assert (acc_all.correct, acc_all.total) == (3, 4)  # last row never counts


def test_reference_ids_and_target_space_accuracy():
    logits = one_hot_logits([5, 6, 7, 8], 10)
    assert reference_ids(logits).tolist() == [6, 7, 8, -1]
    assert reference_ids(logits, k=1).tolist() == [7, 8, -1, -1]
    drafted = torch.tensor([6, 0, 8, 9])
    acc = accuracy_target_space(drafted, reference_ids(logits), torch.ones(4))
    assert (acc.correct, acc.total) == (2, 3)
    assert acc.value == pytest.approx(2 / 3)


def test_per_position_full_cond_uncond():
    mask = torch.ones(6, dtype=torch.int64)  # step-k rows: 5 - k
    hits = [
        torch.tensor([1, 1, 1, 1, 0, 0]).bool(),
        torch.tensor([1, 1, 0, 1, 1, 1]).bool(),
        torch.tensor([1, 0, 1, 1, 1, 1]).bool(),
    ]
    pp = per_position_accuracy(hits, mask)
    assert pp.uncond == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    # rows alive: {0,1,2,3} -> {0,1,3} -> {0}; AND over steps, over step-0 rows
    assert pp.full == pytest.approx([4 / 5, 3 / 5, 1 / 5])
    assert pp.cond == pytest.approx([4 / 5, 3 / 4, 1 / 3])
    assert simulated_acceptance_length(pp.full) == pytest.approx(1 + 8 / 5)
    assert simulated_acceptance_length(pp.full, count_bonus=False) == pytest.approx(8 / 5)


def test_chain_acceptance_length_counts_the_matching_prefix():
    drafts = torch.tensor([[1, 2, 3], [1, 9, 3], [9, 2, 3]])
    ref = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    assert chain_acceptance_length(drafts, ref, count_bonus=False) == pytest.approx((3 + 1 + 0) / 3)
    assert chain_acceptance_length(drafts, ref) == pytest.approx(1 + 4 / 3)


def test_step0_draft_space_agrees_with_ttt_loss_full_acc0():
    g = torch.Generator().manual_seed(0)
    t, vd = 40, 12
    teacher = torch.randn(t, vd, generator=g)
    draft = teacher.roll(-1, 0) + 0.8 * torch.randn(t, vd, generator=g)
    mask = (torch.rand(t, generator=g) > 0.3).to(torch.int64)
    ours = accuracy_draft_space(draft, teacher, mask)
    # ttt_loss pairs row t with teacher row t: hand it the rows already shifted by one
    rows_teacher = torch.cat([teacher[1:], teacher[-1:]])
    rows_mask = torch.cat([mask[1:], torch.zeros(1, dtype=torch.int64)])
    theirs = ttt_loss([draft], rows_teacher, rows_mask)
    assert 0 < ours.value < 1
    assert ours.value == pytest.approx(theirs.full_acc[0])


def test_target_head_teacher_matches_hf_logits(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path)
    head = TargetHead.from_pretrained(tmp_path)
    pre = []
    model.model.norm.register_forward_pre_hook(lambda _m, a: pre.append(a[0]))
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    post = out.hidden_states[-1][0]
    torch.testing.assert_close(head.teacher_logits(post, "post"), out.logits[0])
    torch.testing.assert_close(head.teacher_logits(pre[0][0], "pre"), out.logits[0])
    # the norm matters: treating a pre-norm state as post-norm gives other logits
    assert not torch.allclose(head.teacher_logits(pre[0][0], "post"), out.logits[0], atol=1e-3)
    with pytest.raises(ValueError):
        head.teacher_logits(post, "normed")
