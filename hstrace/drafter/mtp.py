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
    u   = z + Attn(input_layernorm(z)) ;  u = u + FFN(post_attention_layernorm(u))
    o   = final_norm(u)                   (DeepSeek `shared_head.norm`, MiMo `final_layernorm`)
    logits = W_out o                       [T, V]   (DeepSeek `shared_head.head` = the target's)
    fed on to depth k+1: o (vLLM 0.32, both families) or u                -> cfg.feed_normed

Depth k of a serving chain (`draft_chain`): x = the depth k-1 argmax, h = the state fed on,
RoPE positions + k; the query at row t attends the depth-0 keys j <= t and the keys of its own
row from depths 1..k (the same "diagonal" as EAGLE-3's TTT, `hstrace.drafter.model`). vLLM
0.32's proposer runs every depth through MTP layer 0 (`spec_step_idx` 0); DeepSeek-V3's own
training uses layer k for depth k, each over the whole sequence (`teacher_chain`).

The decoder block (Attn, FFN) is the target's kind, the one `hstrace.drafter.block` writes out
for both drafters: GQA + RoPE with optional q/k/v bias and a SwiGLU (MiMo / Qwen2, dense
DeepSeek-style layers), or DeepSeek-V3's MLA (q/kv low-rank, nope/rope head dims, interleaved
RoPE; no yarn scaling) and MoE (grouped top-k routing with the selection bias, shared experts).
Parameter names follow the roles above; `MTP_KEYS` maps each checkpoint family's keys onto them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from hstrace.drafter.block import (
    SCORING_FUNCS,
    DecoderBlock,
    GQAttention,
    MLASpec,
    MLAttention,
    MoE,
    MoESpec,
    RMSNorm,
    Rope,
    SwiGLU,
    rope_inv_freq,
)
from hstrace.drafter.model import DraftCache

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
    # the state a depth hands to the next one: final_norm(u) (both vLLM 0.32 families) or u
    feed_normed: bool = False
    # the decoder block's kind: MLA attention (DeepSeek-V2/V3) instead of GQA, MoE instead of
    # the SwiGLU of `intermediate_size`
    mla: MLASpec | None = None
    moe: MoESpec | None = None
    # RoPE over interleaved pairs (DeepSeek MLA: vLLM `is_neox_style=False`) vs halves
    rope_interleave: bool = False
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

    @property
    def rope_dim(self) -> int:
        """The rotated dims per head: the whole head (GQA) or MLA's d_R."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.hd

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
        """A DeepSeek-V3-style NextN layer as vLLM 0.32's `deepseek_mtp.py` builds it: embed
        first, fed the target's final-normed state, feeds on `shared_head.norm(u)`; its block
        is `DeepseekV2DecoderLayer` at index num_hidden_layers + k: MLA when the config has
        rope/nope head dims, MoE when that index is a MoE index (`n_routed_experts`,
        `first_k_dense_replace`, `moe_layer_freq`), else the dense Llama-like block."""
        mla = _mla_spec(hf)
        sc = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope = sc.get("rope_type") or sc.get("type")
        if mla is not None and rope not in (None, "default"):
            raise ValueError(
                f"MLA with rope_type {rope!r}: only unscaled RoPE is implemented (no yarn)"
            )
        return cls(
            family="deepseek",
            qkv_bias=bool(hf.get("attention_bias", False)),
            concat_order=EMBED_FIRST,
            hidden_source=POST_FINAL_NORM,
            feed_normed=True,
            mla=mla,
            moe=_moe_spec(hf),
            rope_interleave=mla is not None,
            **_dense_fields(hf),
        )


def _mla_spec(hf: dict[str, Any]) -> MLASpec | None:
    """vLLM's rule: MLA unless both qk head dims are 0 (or the model type is `deepseek`)."""
    dC, dR = int(hf.get("qk_nope_head_dim") or 0), int(hf.get("qk_rope_head_dim") or 0)
    if hf.get("model_type") == "deepseek" or dC == dR == 0:
        return None
    q_lora = hf.get("q_lora_rank")
    return MLASpec(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=dC,
        qk_rope_head_dim=dR,
        v_head_dim=int(hf["v_head_dim"]),
    )


def _moe_spec(hf: dict[str, Any]) -> MoESpec | None:
    """MoE when every MTP layer's index N + k is a MoE index of `DeepseekV2DecoderLayer`
    (>= first_k_dense_replace, a multiple of moe_layer_freq); every layer dense: None."""
    if hf.get("n_routed_experts") is None:
        return None
    n, freq = int(hf["num_hidden_layers"]), int(hf.get("moe_layer_freq") or 1)
    first_dense = int(hf.get("first_k_dense_replace") or 0)
    kinds = {
        (n + k) >= first_dense and (n + k) % freq == 0
        for k in range(int(hf.get("num_nextn_predict_layers") or 1))
    }
    if kinds == {False}:
        return None
    if kinds != {True}:
        raise ValueError("MTP layers of mixed kinds (some MoE, some dense): not implemented")
    spec = MoESpec(
        n_routed_experts=int(hf["n_routed_experts"]),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        n_shared_experts=hf.get("n_shared_experts"),
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        scoring_func=str(hf.get("scoring_func") or "softmax"),
        topk_method=str(hf.get("topk_method") or "greedy"),
    )
    _check_routing(spec)
    return spec


def _check_routing(sp: MoESpec) -> None:
    """Refuse, in one line, a routing the reference `Router` (block.py) cannot compute: it
    scores with sigmoid or softmax, splits the experts into n_group equal groups, keeps the
    topk_group best groups (noaux_tc ranks a group by its two best biased scores), then picks
    num_experts_per_tok experts among the kept ones."""
    if sp.scoring_func not in SCORING_FUNCS:
        raise ValueError(
            f"MoE scoring_func {sp.scoring_func!r}: only {' / '.join(SCORING_FUNCS)} is implemented"
        )
    if sp.n_group < 1 or sp.n_routed_experts % sp.n_group:
        raise ValueError(
            f"MoE n_routed_experts {sp.n_routed_experts} does not split into n_group "
            f"{sp.n_group} equal groups"
        )
    if not 1 <= sp.topk_group <= sp.n_group:
        raise ValueError(f"MoE topk_group {sp.topk_group} is not within n_group {sp.n_group}")
    size = sp.n_routed_experts // sp.n_group
    if sp.topk_method == "noaux_tc" and size < 2:
        raise ValueError(
            f"MoE topk_method noaux_tc ranks a group by its two best experts: "
            f"n_routed_experts {sp.n_routed_experts} in n_group {sp.n_group} leaves groups of "
            f"{size} expert"
        )
    if not 1 <= sp.num_experts_per_tok <= sp.topk_group * size:
        raise ValueError(
            f"MoE num_experts_per_tok {sp.num_experts_per_tok}: the {sp.topk_group} kept "
            f"group(s) of {size} hold {sp.topk_group * size} experts"
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


class MTPLayer(DecoderBlock):
    """One NextN layer: enorm, hnorm, eh_proj around one decoder block of the target's kind
    (`input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`), then final_norm."""

    def __init__(self, cfg: MTPConfig):
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        # built before the block: a seeded init draws eh_proj, attention, FFN in that order
        eh_proj = nn.Linear(2 * H, H, bias=False)
        attn: nn.Module
        if cfg.mla is not None:
            attn = MLAttention(H, cfg.num_attention_heads, cfg.mla, eps)
        else:
            attn = GQAttention(
                H,
                H,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.hd,
                qkv_bias=cfg.qkv_bias,
            )
        mlp = MoE(H, cfg.moe) if cfg.moe is not None else SwiGLU(H, cfg.intermediate_size)
        super().__init__(H, eps, attn, mlp)
        self.cfg = cfg
        self.enorm = RMSNorm(H, eps)
        self.hnorm = RMSNorm(H, eps)
        self.eh_proj = eh_proj
        self.final_norm = RMSNorm(H, eps)

    def forward(  # type: ignore[override]
        self,
        embed: Tensor,
        hidden: Tensor,
        positions: Tensor,
        rope: Rope,
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
        u = super().forward(z, rope, keys, values, mask0)
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
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling), False
        )

    def _run(
        self, layer: int, ids: Tensor, hidden: Tensor, positions: Tensor, cache: DraftCache
    ) -> tuple[Tensor, Tensor]:
        rope = Rope.at(positions, self.inv_freq, hidden.dtype, self.cfg.rope_interleave)
        u, o = self.layers[layer](
            self.embed_tokens(ids),
            hidden,
            positions,
            rope,
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
