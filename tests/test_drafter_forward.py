"""The reference drafter against the independently written Appendix A forward
(shared/reference/training-formats.md), which was checked numerically against speculators 0.9.0
and SpecForge. Different code (explicit per-query loop) computing the same semantics."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from helpers.drafters import randomized, tiny_cfg

from hstrace.drafter import Eagle3Drafter


def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, pos, theta, hd):
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd))
    fr = pos.float()[:, None] * inv[None]
    emb = torch.cat([fr, fr], -1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def appendix_a(sd, aux, ids, pos0, K, nh, nkv, hd, eps, theta, nbr, nbf, norm_output, window=None):
    T = ids.shape[0]
    L = "layers.0."
    x = _rms(aux, sd["input_norm.weight"], eps) if nbf else aux
    h = x @ sd["fc.weight"].T
    keys, vals, out_logits = [], [], []
    for k in range(K):
        tok = torch.cat([ids[k:], ids.new_zeros(k)])
        e_n = _rms(sd["embed_tokens.weight"][tok], sd[L + "input_layernorm.weight"], eps)
        g_n = _rms(h, sd[L + "hidden_norm.weight"], eps)
        res = g_n if nbr else h
        a = torch.cat([e_n, g_n], -1)
        q = (a @ sd[L + "self_attn.q_proj.weight"].T).view(T, nh, hd)
        kk = (a @ sd[L + "self_attn.k_proj.weight"].T).view(T, nkv, hd)
        vv = (a @ sd[L + "self_attn.v_proj.weight"].T).view(T, nkv, hd)
        q, kk = _rope(q, pos0 + k, theta, hd), _rope(kk, pos0 + k, theta, hd)
        keys.append(kk)
        vals.append(vv)
        out = torch.zeros(T, nh, hd)
        for i in range(T):
            lo = 0 if window is None else max(0, i - window + 1)
            Kc = torch.cat([keys[0][lo : i + 1]] + [keys[s][i : i + 1] for s in range(1, k + 1)])
            Vc = torch.cat([vals[0][lo : i + 1]] + [vals[s][i : i + 1] for s in range(1, k + 1)])
            Kc, Vc = Kc.repeat_interleave(nh // nkv, 1), Vc.repeat_interleave(nh // nkv, 1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[i], Kc).float() / hd**0.5, -1)
            out[i] = torch.einsum("hn,nhd->hd", p, Vc)
        h2 = res + out.reshape(T, nh * hd) @ sd[L + "self_attn.o_proj.weight"].T
        z = _rms(h2, sd[L + "post_attention_layernorm.weight"], eps)
        h2 = (
            h2
            + (F.silu(z @ sd[L + "mlp.gate_proj.weight"].T) * (z @ sd[L + "mlp.up_proj.weight"].T))
            @ sd[L + "mlp.down_proj.weight"].T
        )
        hn = _rms(h2, sd["norm.weight"], eps)
        out_logits.append(hn @ sd["lm_head.weight"].T)
        h = hn if norm_output else h2
    return out_logits


@pytest.mark.parametrize("nbr,nbf,norm_output", list(itertools.product([False, True], repeat=3)))
def test_matches_appendix_a_for_every_flag_combination(nbr, nbf, norm_output):
    torch.manual_seed(0)
    cfg = tiny_cfg(norm_before_residual=nbr, norm_before_fc=nbf, feed_normed=norm_output)
    model = randomized(Eagle3Drafter(cfg), seed=1)
    T = 9
    ids = torch.randint(0, cfg.vocab_size, (T,))
    aux = torch.randn(T, 3 * cfg.hidden_size)
    pos0 = torch.arange(T) + 1
    sd = model.state_dict()
    ref = appendix_a(sd, aux, ids, pos0, 4, 4, 2, 8, 1e-6, 10000.0, nbr, nbf, norm_output)
    ours = model.ttt(ids, aux, steps=4, positions=pos0)
    for k, (r, o) in enumerate(zip(ref, ours, strict=True)):
        assert o.logits.shape == (T, cfg.draft_vocab_size)
        assert (r[: T - k] - o.logits[: T - k]).abs().max().item() <= 1e-5, f"step {k}"


def test_flags_change_the_logits():
    """The comparison above would be vacuous if the flags did nothing."""
    torch.manual_seed(0)
    ids, aux = torch.randint(0, 97, (7,)), torch.randn(7, 96)
    outs = {}
    for flag in ["norm_before_residual", "norm_before_fc", "feed_normed"]:
        for v in (False, True):
            m = randomized(Eagle3Drafter(tiny_cfg(**{flag: v})), seed=3)
            outs[(flag, v)] = m.ttt(ids, aux, steps=2)
    for flag in ["norm_before_residual", "norm_before_fc"]:
        assert (outs[(flag, False)][0].logits - outs[(flag, True)][0].logits).abs().max() > 0.05
    # feed_normed leaves step 0 untouched and changes step 1
    a, b = outs[("feed_normed", False)], outs[("feed_normed", True)]
    assert torch.equal(a[0].logits, b[0].logits)
    assert (a[1].logits - b[1].logits).abs().max() > 0.05


def test_sliding_window_matches_windowed_reference():
    torch.manual_seed(0)
    cfg = tiny_cfg(sliding_window=3)
    model = randomized(Eagle3Drafter(cfg), seed=2)
    T = 10
    ids, aux = torch.randint(0, 97, (T,)), torch.randn(T, 96)
    ref = appendix_a(
        model.state_dict(),
        aux,
        ids,
        torch.arange(T),
        3,
        4,
        2,
        8,
        1e-6,
        1e4,
        False,
        False,
        False,
        window=3,
    )
    ours = model.ttt(ids, aux, steps=3)
    for k in range(3):
        assert (ref[k][: T - k] - ours[k].logits[: T - k]).abs().max() <= 1e-5
    full = randomized(Eagle3Drafter(tiny_cfg()), seed=2).ttt(ids, aux, steps=1)[0].logits
    assert torch.allclose(full[:3], ours[0].logits[:3], atol=1e-6)  # inside the window: identical
    assert (full[5:] - ours[0].logits[5:]).abs().max() > 1e-3  # past it: different


def test_batch_equals_single_and_bf16_is_close():
    torch.manual_seed(0)
    model = randomized(Eagle3Drafter(tiny_cfg()), seed=4)
    ids, aux = torch.randint(0, 97, (2, 6)), torch.randn(2, 6, 96)
    batched = model.ttt(ids, aux, steps=3)
    for b in range(2):
        single = model.ttt(ids[b], aux[b], steps=3)
        for k in range(3):
            assert torch.allclose(batched[k].logits[b], single[k].logits, atol=1e-5)
    bf = randomized(Eagle3Drafter(tiny_cfg()), seed=4).to(torch.bfloat16)
    lo = bf(ids[0], aux[0].bfloat16()).logits.float()
    assert (lo - batched[0].logits[0]).abs().max() < 0.1 * batched[0].logits[0].abs().max()


def test_d2t_offsets_and_direct_misreading():
    model = Eagle3Drafter(tiny_cfg())
    used = torch.sort(torch.randperm(97)[:61]).values
    model.d2t.copy_(used - torch.arange(61))
    ids = torch.tensor([0, 5, 60])
    assert torch.equal(model.draft_to_target(ids), used[ids])
    assert torch.equal(model.draft_to_target(ids, direct=True), (used - torch.arange(61))[ids])
    full = model.full_vocab_logits(torch.arange(61.0))
    assert full.shape == (97,) and torch.equal(full[used], torch.arange(61.0))
    assert torch.isinf(full).sum() == 97 - 61


def test_draft_chain_feeds_its_own_tokens():
    """Chain step k must equal a TTT step whose shifted ground truth happens to be the drafts."""
    torch.manual_seed(0)
    model = randomized(Eagle3Drafter(tiny_cfg()), seed=5)
    ids, aux = torch.randint(0, 97, (5,)), torch.randn(5, 96)
    drafts, targets, logits = model.draft_chain(ids, aux, steps=3)
    assert drafts.shape == targets.shape == (5, 3)
    out0 = model(ids, aux)
    out1 = model.step(targets[:, 0], out0.hidden, out0.cache)
    assert torch.allclose(out1.logits, logits[1], atol=1e-5)


def test_trainable_with_autograd():
    torch.manual_seed(0)
    model = randomized(Eagle3Drafter(tiny_cfg(feed_normed=True, norm_before_fc=True)), seed=6)
    ids, aux = torch.randint(0, 97, (8,)), torch.randn(8, 96)
    loss = sum(o.logits.logsumexp(-1).mean() for o in model.ttt(ids, aux, steps=3))
    loss.backward()
    assert model.fc.weight.grad is not None and model.fc.weight.grad.abs().sum() > 0
    assert model.input_norm.weight.grad.abs().sum() > 0
