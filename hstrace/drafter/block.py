"""The decoder block both reference drafters share (EAGLE-3 and MTP / NextN): one page of math.

A pre-norm transformer block over a stream z[t] in R^H:
    u = r + Attn(x)                   plain block: x = input_layernorm(z), r = z
    y = u + FFN(post_attention_layernorm(u))
EAGLE-3's first layer feeds its own x = cat[input_layernorm(e), hidden_norm(g)] and residual r
(`DecoderBlock.attend_then_ffn`); every other layer of either drafter is the plain block.

Attention, two kinds, both over the same per-depth cache (`attend`):
  GQA (Llama / Qwen2 / Qwen3)  q = W_q x, k = W_k x, v = W_v x     n_h query, n_kv key/value heads
                               (optional per-head RMSNorm on q and k), RoPE (rotate-half) on q, k
  MLA (DeepSeek-V2 / V3)       c_q = q_a_layernorm(W_qa x) ; q = W_qb c_q    (q_lora_rank set)
                                                           q = W_q x          (no q LoRA)
                               [c_kv, k_R] = W_kva x              c_kv: kv_lora_rank, k_R: d_R
                               [k_C, v]    = W_kvb kv_a_layernorm(c_kv)     per head: d_C + d_v
                               q = [q_C, RoPE(q_R)], k = [k_C, RoPE(k_R)]  (k_R one head, shared)
                               RoPE on the d_R dims only, interleaved pairs (vLLM `is_neox_style`
                               False; HF `rope_interleave`)
  s = q k^T * scale (GQA 1/sqrt(d); MLA 1/sqrt(d_C + d_R)); the query at row t sees the depth-0
  keys mask0 allows (causal, windows, documents) and the key of its own row from each later
  depth 1..k (the TTT / serving-chain "diagonal");  out = W_o (softmax(s) v).

Feed-forward, two kinds:
  SwiGLU       W_down (silu(W_gate x) * W_up x)
  MoE (DeepSeek-V3 routing)
      s = sigmoid(W_r x)  (scoring_func softmax: softmax(W_r x)), in fp32
      b = s + bias  (`noaux_tc`: the bias steers the choice only; no bias: b = s)
      group score: the sum of the top-2 b of each of n_group groups (no bias: the max s);
      keep the topk_group best groups, choose the top-k experts E_t by b among them
      w_i = s_i for i in E_t; w /= sum(w) if norm_topk_prob; w *= routed_scaling_factor
      y = sum_{i in E_t} w_i SwiGLU_i(x) + SwiGLU_shared(x)      (shared width n_shared * d_moe)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """HF/SpecForge numerics: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


# -- positions ------------------------------------------------------------------------------------
def rope_inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None = None) -> Tensor:
    """HF inverse frequencies over `dim` rotated dims, with the llama3 / linear scalings
    speculators copies from targets."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    sc = scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "llama3":
        factor, lo, hi = (
            float(sc["factor"]),
            float(sc["low_freq_factor"]),
            float(sc["high_freq_factor"]),
        )
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rotate_pairs(x: Tensor) -> Tensor:
    """The interleaved rotation: (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)


@dataclass
class Rope:
    """cos / sin tables [B, 1, T, d] for one set of positions; `interleaved` pairs (2i, 2i+1)
    instead of halves (i, i + d/2)."""

    cos: Tensor
    sin: Tensor
    interleaved: bool = False

    @classmethod
    def at(
        cls, positions: Tensor, inv_freq: Tensor, dtype: torch.dtype, interleaved: bool = False
    ) -> Rope:
        f = positions.float()[..., None] * inv_freq  # [B, T, d/2]
        emb = f.repeat_interleave(2, -1) if interleaved else torch.cat([f, f], -1)
        return cls(emb[:, None].cos().to(dtype), emb[:, None].sin().to(dtype), interleaved)

    def __call__(self, x: Tensor) -> Tensor:
        turned = rotate_pairs(x) if self.interleaved else rotate_half(x)
        return x * self.cos + turned * self.sin


# -- attention ------------------------------------------------------------------------------------
def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keys: list[Tensor],
    values: list[Tensor],
    mask0: Tensor,
    scale: float,
) -> Tensor:
    """softmax(q k^T * scale) v over the depth cache. q [B, n_h, T, d]; this depth's k [B, n_kv,
    T, d] and v [B, n_kv, T, d_v] are appended to `keys` / `values` first. Depth-0 keys are seen
    where mask0 [B, T, T] allows; each later depth's key only by the query of its own row.
    Returns [B, T, n_h * d_v]."""
    B, nh, T, _ = q.shape
    keys.append(k)
    values.append(v)
    rep = nh // k.shape[1]
    k0, v0 = keys[0].repeat_interleave(rep, 1), values[0].repeat_interleave(rep, 1)
    scores = [(q @ k0.transpose(-1, -2)).float().mul(scale).masked_fill(~mask0[:, None], -math.inf)]
    for ks in keys[1:]:  # the diagonal: own row only
        scores.append((q * ks.repeat_interleave(rep, 1)).sum(-1, keepdim=True).float().mul(scale))
    p = torch.softmax(torch.cat(scores, -1), dim=-1).to(q.dtype)
    out = p[..., :T] @ v0
    for s, vs in enumerate(values[1:]):
        out = out + p[..., T + s : T + s + 1] * vs.repeat_interleave(rep, 1)
    return out.transpose(1, 2).reshape(B, T, -1)


class GQAttention(nn.Module):
    """Grouped-query attention with RoPE over the whole head (Llama / Qwen2 / Qwen3)."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,  # set: per-head RMSNorm on q and k (Qwen3)
    ):
        super().__init__()
        self.nh, self.nkv, self.hd = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(in_dim, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(in_dim, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(in_dim, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, out_dim, bias=o_bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)

    def forward(
        self, x: Tensor, rope: Rope, keys: list[Tensor], values: list[Tensor], mask0: Tensor
    ) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, hd]
        out = attend(rope(q), rope(k), v, keys, values, mask0, 1.0 / math.sqrt(self.hd))
        return self.o_proj(out)


@dataclass
class MLASpec:
    """Multi-head latent attention sizes (DeepSeek-V2/V3 config names)."""

    q_lora_rank: int | None  # None: q = W_q x directly
    kv_lora_rank: int
    qk_nope_head_dim: int  # d_C
    qk_rope_head_dim: int  # d_R
    v_head_dim: int  # d_v


class MLAttention(nn.Module):
    """DeepSeek's multi-head latent attention, computed un-absorbed (k and v per head); the
    absorbed form engines decode with is the same product reassociated."""

    def __init__(self, hidden: int, heads: int, spec: MLASpec, eps: float):
        super().__init__()
        self.nh, self.spec = heads, spec
        dC, dR, dv = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        if spec.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(hidden, spec.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, heads * (dC + dR), bias=False)
        else:
            self.q_proj = nn.Linear(hidden, heads * (dC + dR), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, spec.kv_lora_rank + dR, bias=False)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(spec.kv_lora_rank, heads * (dC + dv), bias=False)
        self.o_proj = nn.Linear(heads * dv, hidden, bias=False)
        self.scale = (dC + dR) ** -0.5

    def forward(
        self, x: Tensor, rope: Rope, keys: list[Tensor], values: list[Tensor], mask0: Tensor
    ) -> Tensor:
        B, T, _ = x.shape
        s = self.spec
        dC, dR, dv = s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim
        if s.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_C, q_R = q.view(B, T, self.nh, dC + dR).transpose(1, 2).split([dC, dR], -1)
        c_kv, k_R = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, dR], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, T, self.nh, dC + dv)
        k_C, v = kv.transpose(1, 2).split([dC, dv], -1)
        k_R = rope(k_R[:, None]).expand(B, self.nh, T, dR)  # one rotary key, every head
        q = torch.cat([q_C, rope(q_R)], -1)
        k = torch.cat([k_C, k_R], -1)
        return self.o_proj(attend(q, k, v, keys, values, mask0, self.scale))


# -- feed-forward ---------------------------------------------------------------------------------
class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


SCORING_FUNCS = ("sigmoid", "softmax")  # the MoE scoring functions `Router` computes


@dataclass
class MoESpec:
    """DeepSeek-V2/V3 mixture-of-experts sizes and routing (config names)."""

    n_routed_experts: int
    num_experts_per_tok: int  # k
    moe_intermediate_size: int  # d_moe
    n_shared_experts: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # the defaults are `_moe_spec`'s (hstrace.drafter.mtp) for a config that omits the field
    scoring_func: str = "softmax"  # one of SCORING_FUNCS: "sigmoid" (V3) | "softmax" (V2)
    topk_method: str = "greedy"  # noaux_tc: a per-expert bias steers the choice


class Router(nn.Module):
    """`mlp.gate`: the router weight and (noaux_tc) the selection bias."""

    def __init__(self, hidden: int, spec: MoESpec):
        super().__init__()
        self.spec = spec
        # zeros, not empty: a checkpoint without the gate must not route on stale memory
        self.weight = nn.Parameter(torch.zeros(spec.n_routed_experts, hidden))
        if spec.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(spec.n_routed_experts), requires_grad=False
            )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(w [N, k] the routing weights, idx [N, k] the chosen experts) for rows x [N, H]."""
        sp = self.spec
        logits = F.linear(x.float(), self.weight.float())
        if sp.scoring_func == "sigmoid":
            s = logits.sigmoid()
        elif sp.scoring_func == "softmax":
            s = logits.softmax(-1)
        else:
            raise ValueError(f"unsupported MoE scoring_func {sp.scoring_func!r}")
        N = s.shape[0]
        bias = getattr(self, "e_score_correction_bias", None)
        b = s + bias.float() if bias is not None else s
        grouped = b.view(N, sp.n_group, -1)
        g = grouped.topk(2, -1).values.sum(-1) if bias is not None else grouped.max(-1).values
        kept = torch.zeros_like(g, dtype=torch.bool).scatter_(1, g.topk(sp.topk_group, -1)[1], True)
        b = b.masked_fill(~kept.repeat_interleave(grouped.shape[-1], 1), -math.inf)
        idx = b.topk(sp.num_experts_per_tok, -1).indices
        w = s.gather(1, idx)
        if sp.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return w * sp.routed_scaling_factor, idx


class MoE(nn.Module):
    def __init__(self, hidden: int, spec: MoESpec):
        super().__init__()
        self.gate = Router(hidden, spec)
        d = spec.moe_intermediate_size
        self.experts = nn.ModuleList(SwiGLU(hidden, d) for _ in range(spec.n_routed_experts))
        if spec.n_shared_experts:
            self.shared_experts = SwiGLU(hidden, d * spec.n_shared_experts)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        w, idx = self.gate(rows)
        y = torch.zeros_like(rows)
        for e, expert in enumerate(self.experts):
            r, slot = (idx == e).nonzero(as_tuple=True)
            if r.numel():
                y.index_add_(0, r, expert(rows[r]) * w[r, slot, None].to(rows.dtype))
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(rows)
        return y.view_as(x)


# -- the block ------------------------------------------------------------------------------------
class DecoderBlock(nn.Module):
    """input_layernorm, self_attn, post_attention_layernorm, mlp: the checkpoint names of every
    Llama / Qwen / DeepSeek decoder layer."""

    def __init__(self, hidden: int, eps: float, attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = mlp

    def attend_then_ffn(
        self,
        residual: Tensor,
        x: Tensor,
        rope: Rope,
        keys: list[Tensor],
        values: list[Tensor],
        mask0: Tensor,
    ) -> Tensor:
        u = residual + self.self_attn(x, rope, keys, values, mask0)
        return u + self.mlp(self.post_attention_layernorm(u))

    def forward(
        self, z: Tensor, rope: Rope, keys: list[Tensor], values: list[Tensor], mask0: Tensor
    ) -> Tensor:
        return self.attend_then_ffn(z, self.input_layernorm(z), rope, keys, values, mask0)
