"""The reference MTP / NextN head in plain PyTorch: one page of math per forward.

Notation (per token position t of one sequence; H the target's width, V its vocabulary):
    h[t]  in R^H   the target's hidden state of token t, taken where `cfg.hidden_source` says
                   (MiMo on vLLM: the last layer's residual stream before the final norm;
                   DeepSeek-V3 on vLLM: after the final norm)
    x[t]           the token paired with h[t]: the token at t+1 (the head predicts t+2)
    E              the embedding table (the target's, shared), W_out the output head

One depth over a sequence (the serving "draft extend" / the training forward of depth k):
    e   = enorm(E[x]) ;  e[t] = 0 where position t == 0          (both vLLM families mask it)
    g   = hnorm(h)
    z   = eh_proj(cat[e, g])    (DeepSeek-V3: embedding half first)
        = eh_proj(cat[g, e])    (MiMo: hidden half first)           -> cfg.concat_order
    u   = z + Attn(input_layernorm(z)) ;  u = u + MLP(post_attention_layernorm(u))
    o   = final_norm(u)                   (DeepSeek `shared_head.norm`, MiMo `final_layernorm`)
    logits = W_out o                       [T, V]
    fed on to depth k+1: o (MiMo returns the normed state) or u (DeepSeek) -> cfg.feed_normed

Depth k of a serving chain (`draft_chain`): x = the depth k-1 argmax, h = the state fed on,
RoPE positions + k; the query at row t attends the depth-0 keys j <= t and the keys of its own
row from depths 1..k (the same "diagonal" as EAGLE-3's TTT, `hstrace.drafter.model`). vLLM
0.32's proposer runs every depth through MTP layer 0 (`spec_step_idx` 0); DeepSeek-V3's own
training uses layer k for depth k, each over the whole sequence (`teacher_chain`).

The decoder block is the target's dense kind (Llama / Qwen2: GQA attention with RoPE, SwiGLU
MLP, optional q/k/v bias). MLA attention and MoE blocks are not implemented here.
Parameter names follow the roles above; `MTP_KEYS` maps each checkpoint family's keys onto them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hstrace.drafter.model import DraftCache, RMSNorm, rope_inv_freq, rotate_half

EMBED_FIRST: Literal["embed_first"] = "embed_first"  # DeepSeek-V3 / GLM / Qwen3-Next: cat[e, g]
HIDDEN_FIRST: Literal["hidden_first"] = "hidden_first"  # MiMo: cat[g, e]
PRE_FINAL_NORM: Literal["pre_final_norm"] = "pre_final_norm"
POST_FINAL_NORM: Literal["post_final_norm"] = "post_final_norm"

ConcatOrder = Literal["embed_first", "hidden_first"]
HiddenSource = Literal["pre_final_norm", "post_final_norm"]


@dataclass
class MTPConfig:
    """Every knob of an MTP head, named for what it does."""

    family: str  # "mimo" | "deepseek": the checkpoint layout and vLLM module it mirrors
    hidden_size: int  # H (the target's width: the head consumes its states directly)
    vocab_size: int  # V (shared embedding and head: the target's vocabulary)
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int | None = None  # default H // num_attention_heads
    num_mtp_layers: int = 1  # `num_nextn_predict_layers`
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False  # Qwen2 / MiMo: biases on q, k, v (never on o)
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    # the order of the two halves fed to eh_proj: cat[enorm(embed), hnorm(hidden)] (DeepSeek)
    # or cat[hnorm(hidden), enorm(embed)] (MiMo)
    concat_order: ConcatOrder = EMBED_FIRST
    # which target state of token t the head is fed: the last layer's residual stream before
    # the final norm (MiMo on vLLM) or after it (DeepSeek-V3 on vLLM)
    hidden_source: HiddenSource = POST_FINAL_NORM
    # vLLM (both families) zeroes the embedding at position 0
    zero_embed_at_position0: bool = True
    # the state a depth hands to the next one: final_norm(u) (MiMo) or u (DeepSeek)
    feed_normed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.concat_order not in (EMBED_FIRST, HIDDEN_FIRST):
            raise ValueError(f"concat_order {self.concat_order!r}: embed_first | hidden_first")
        if self.hidden_source not in (PRE_FINAL_NORM, POST_FINAL_NORM):
            raise ValueError(
                f"hidden_source {self.hidden_source!r}: pre_final_norm | post_final_norm"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def mimo(cls, hf: dict[str, Any]) -> MTPConfig:
        """A `MiMoForCausalLM` config (Qwen2 fields + `num_nextn_predict_layers`), as vLLM's
        `mimo_mtp.py` builds the head: hidden first, fed the pre-norm state, feeds on normed."""
        return cls(
            family="mimo",
            qkv_bias=True,
            concat_order=HIDDEN_FIRST,
            hidden_source=PRE_FINAL_NORM,
            feed_normed=True,
            **_dense_fields(hf),
        )

    @classmethod
    def deepseek(cls, hf: dict[str, Any]) -> MTPConfig:
        """A DeepSeek-V3-style NextN layer with a dense block (`deepseek_mtp.py` wiring): embed
        first, fed the final-normed state, feeds on the un-normed one."""
        return cls(
            family="deepseek",
            qkv_bias=bool(hf.get("attention_bias", False)),
            concat_order=EMBED_FIRST,
            hidden_source=POST_FINAL_NORM,
            feed_normed=False,
            **_dense_fields(hf),
        )


def _dense_fields(hf: dict[str, Any]) -> dict[str, Any]:
    rope = hf.get("rope_parameters") or {}
    return {
        "hidden_size": int(hf["hidden_size"]),
        "vocab_size": int(hf["vocab_size"]),
        "num_attention_heads": int(hf["num_attention_heads"]),
        "num_key_value_heads": int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
        "intermediate_size": int(hf["intermediate_size"]),
        "head_dim": hf.get("head_dim"),
        "num_mtp_layers": int(hf.get("num_nextn_predict_layers") or 1),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        # transformers >= 5 keeps theta and scaling in `rope_parameters`
        "rope_theta": float(hf.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        "rope_scaling": hf.get("rope_scaling") or (rope if rope.get("rope_type") else None),
        "max_position_embeddings": int(hf.get("max_position_embeddings", 2048)),
    }


# Checkpoint key (relative to one MTP layer's prefix) -> the head's parameter (relative to
# `layers.{k}`), per family. The decoder block's keys are the same in both families and in
# the head (`self_attn.*`, `mlp.*`, `input_layernorm`, `post_attention_layernorm`).
MTP_KEYS: dict[str, dict[str, str]] = {
    "mimo": {
        "token_layernorm.weight": "enorm.weight",
        "hidden_layernorm.weight": "hnorm.weight",
        "input_proj.weight": "eh_proj.weight",
        "final_layernorm.weight": "final_norm.weight",
    },
    "deepseek": {
        "enorm.weight": "enorm.weight",
        "hnorm.weight": "hnorm.weight",
        "eh_proj.weight": "eh_proj.weight",
        "shared_head.norm.weight": "final_norm.weight",
    },
}


class Attention(nn.Module):
    """GQA self-attention with RoPE; keys/values of every depth kept for the serving chain."""

    def __init__(self, cfg: MTPConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hd
        H, b = cfg.hidden_size, cfg.qkv_bias
        self.q_proj = nn.Linear(H, self.nh * self.hd, bias=b)
        self.k_proj = nn.Linear(H, self.nkv * self.hd, bias=b)
        self.v_proj = nn.Linear(H, self.nkv * self.hd, bias=b)
        self.o_proj = nn.Linear(self.nh * self.hd, H, bias=False)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        keys: list[Tensor],
        values: list[Tensor],
        mask0: Tensor,
    ) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        keys.append(k)
        values.append(v)
        rep, scale = self.nh // self.nkv, 1.0 / math.sqrt(self.hd)
        k0, v0 = keys[0].repeat_interleave(rep, 1), values[0].repeat_interleave(rep, 1)
        scores = [
            (q @ k0.transpose(-1, -2)).float().mul(scale).masked_fill(~mask0[:, None], -math.inf)
        ]
        for ks in keys[1:]:  # later depths: the own row only
            scores.append(
                (q * ks.repeat_interleave(rep, 1)).sum(-1, keepdim=True).float().mul(scale)
            )
        p = torch.softmax(torch.cat(scores, -1), dim=-1).to(q.dtype)
        out = p[..., :T] @ v0
        for s, vs in enumerate(values[1:]):
            out = out + p[..., T + s : T + s + 1] * vs.repeat_interleave(rep, 1)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: MTPConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MTPLayer(nn.Module):
    """One NextN layer: enorm, hnorm, eh_proj, one pre-norm decoder block, final_norm."""

    def __init__(self, cfg: MTPConfig):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = cfg
        self.enorm = RMSNorm(H, eps)
        self.hnorm = RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(cfg)
        self.final_norm = RMSNorm(H, eps)

    def forward(
        self,
        embed: Tensor,
        hidden: Tensor,
        positions: Tensor,
        cos: Tensor,
        sin: Tensor,
        keys: list[Tensor],
        values: list[Tensor],
        mask0: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """Returns (u, o): the block's output and final_norm(u)."""
        if self.cfg.zero_embed_at_position0:
            embed = torch.where(positions[..., None] == 0, 0.0, embed).to(embed.dtype)
        e, g = self.enorm(embed), self.hnorm(hidden)
        halves = [e, g] if self.cfg.concat_order == EMBED_FIRST else [g, e]
        z = self.eh_proj(torch.cat(halves, dim=-1))
        u = z + self.self_attn(self.input_layernorm(z), cos, sin, keys, values, mask0)
        u = u + self.mlp(self.post_attention_layernorm(u))
        return u, self.final_norm(u)


@dataclass
class MTPOutput:
    logits: Tensor  # [B, T, V] (or [T, V] unbatched): target-vocab logits
    hidden: Tensor  # [B, T, H]: the state fed on to the next depth (cfg.feed_normed)
    cache: DraftCache = field(repr=False)


def _batched(x: Tensor, dims: int) -> tuple[Tensor, bool]:
    return (x.unsqueeze(0), True) if x.dim() == dims else (x, False)


class MTPHead(nn.Module):
    """`layers.{k}` are the NextN layers; `embed_tokens` and `lm_head` the (shared) vocab ends."""

    def __init__(self, cfg: MTPConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([MTPLayer(cfg) for _ in range(cfg.num_mtp_layers)])
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)  # type: ignore[arg-type]

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        f = positions.float()[..., None] * self.inv_freq
        emb = torch.cat([f, f], -1)[:, None]  # [B, 1, T, hd]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _run(
        self, layer: int, ids: Tensor, hidden: Tensor, positions: Tensor, cache: DraftCache
    ) -> tuple[Tensor, Tensor]:
        cos, sin = self._rope(positions, hidden.dtype)
        u, o = self.layers[layer](
            self.embed_tokens(ids),
            hidden,
            positions,
            cos,
            sin,
            cache.keys[0],
            cache.values[0],
            cache.masks[0],
        )
        return self.lm_head(o), (o if self.cfg.feed_normed else u)

    @staticmethod
    def _out(logits: Tensor, hidden: Tensor, cache: DraftCache, unbatched: bool) -> MTPOutput:
        return (
            MTPOutput(logits[0], hidden[0], cache)
            if unbatched
            else MTPOutput(logits, hidden, cache)
        )

    def forward(
        self, input_ids: Tensor, hidden: Tensor, positions: Tensor | None = None, depth: int = 0
    ) -> MTPOutput:
        """Depth `depth` over a sequence, causal: input_ids [T] or [B, T] (token at t+1 for
        hidden row t), hidden [.., T, H] (the target's state of token t, or depth-1's output)."""
        ids, unbatched = _batched(input_ids, 1)
        h, _ = _batched(hidden, 2)
        B, T = ids.shape
        if h.shape[:2] != (B, T) or h.shape[-1] != self.cfg.hidden_size:
            raise ValueError(f"hidden {tuple(h.shape)} does not match input_ids {(B, T)} x H")
        pos = (
            _batched(positions, 1)[0]
            if positions is not None
            else torch.arange(T, device=ids.device).expand(B, T)
        )
        i = torch.arange(T, device=ids.device)
        cache = DraftCache([[]], [[]], [(i[:, None] >= i[None, :]).expand(B, T, T)], pos)
        logits, fed = self._run(depth % len(self.layers), ids, h, pos, cache)
        return self._out(logits, fed, cache, unbatched)

    def step(
        self, input_ids: Tensor, hidden: Tensor, cache: DraftCache, layer: int = 0
    ) -> MTPOutput:
        """Serving depth k = cache.steps: each row attends its depth-0 prefix and its own row of
        depths 1..k; positions = depth-0 positions + k."""
        ids, unbatched = _batched(input_ids, 1)
        h, _ = _batched(hidden, 2)
        logits, fed = self._run(layer, ids, h, cache.positions0 + cache.steps, cache)
        return self._out(logits, fed, cache, unbatched)

    def draft_chain(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        steps: int = 1,
        positions: Tensor | None = None,
        per_depth_layers: bool = False,
    ) -> tuple[Tensor, list[Tensor]]:
        """Greedy serving chain from every row at once: depth k feeds depth k-1's argmax and
        its fed-on state. vLLM 0.32 uses layer 0 at every depth (`per_depth_layers=False`).
        Returns (draft ids [.., T, steps], logits per depth)."""
        out = self.forward(input_ids, hidden, positions)
        drafts, logits = [out.logits.argmax(-1)], [out.logits]
        for k in range(1, steps):
            layer = k % len(self.layers) if per_depth_layers else 0
            out = self.step(drafts[-1], out.hidden, out.cache, layer)
            drafts.append(out.logits.argmax(-1))
            logits.append(out.logits)
        return torch.stack(drafts, -1), logits

    def teacher_chain(
        self, input_ids: Tensor, hidden: Tensor, depths: int | None = None
    ) -> list[MTPOutput]:
        """DeepSeek-V3 training semantics: depth k (layer k) runs over the whole sequence on the
        ground truth shifted left by k (padded with 0) and depth k-1's fed-on state, causal
        attention over its own keys. Depth-k logits at row t predict token t+2+k."""
        n = depths or len(self.layers)
        outs = [self.forward(input_ids, hidden, depth=0)]
        for k in range(1, n):
            shifted = torch.cat(
                [input_ids[..., k:], input_ids.new_zeros(*input_ids.shape[:-1], k)], -1
            )
            outs.append(self.forward(shifted, outs[-1].hidden, depth=k))
        return outs


def feed_from_target(cfg: MTPConfig, pre_norm: Tensor, final_norm: nn.Module) -> Tensor:
    """The target state the head is fed for `cfg.hidden_source`, from the last layer's
    residual stream `pre_norm` [.., T, H] and the target's final norm module."""
    return pre_norm if cfg.hidden_source == PRE_FINAL_NORM else final_norm(pre_norm)
