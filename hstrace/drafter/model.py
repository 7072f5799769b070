"""The EAGLE-3 drafter in plain PyTorch: one page of math per forward.

Notation (per token position t of one sequence):
    a[t]  in R^{n*Ht}  the target's aux hidden states, slots in ascending layer order
    x[t]               the token fed with a[t]: the token at t+1 (the drafter predicts t+2)
    g[t]  in R^H       the drafter's hidden stream: fc(a) at step 0, the fed-back state after

Step 0 (the serving "draft extend", the training TTT step 0):
    a'  = input_norm(a) | cat_j fc_norm_j(a_j) | a            (norm_before_fc | fc_norm | neither)
    g   = fc(a')
    e_n = input_layernorm(embed(x)),  g_n = hidden_norm(g)
    h   = (g_n if norm_before_residual else g) + Attn(cat[e_n, g_n]) ;  h = h + MLP(post_ln(h))
    logits = lm_head(norm(h) if logits_use_norm else h)          [T, Vd]  (draft vocab)
    g'  = norm(h) if feed_normed else h                           fed to step 1

TTT step k > 0 (teacher forcing in training = a greedy chain in serving when accepted):
    tokens shifted left by k, RoPE positions + k, hidden = g' of step k-1, no fc.
    Query t attends the step-0 keys at j <= t (same document, inside the sliding window) and
    the key of its own position t from every step 1..k (the TTT "diagonal").

Draft ids map to target ids by offsets: target = i + d2t[i] (`draft_to_target`,
`hstrace.drafter.vocab`). `cfg.skip_fc` is a serving fault (no fc: one H-wide state in).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from hstrace.drafter.block import DecoderBlock, GQAttention, RMSNorm, Rope, SwiGLU, rope_inv_freq
from hstrace.drafter.config import DrafterConfig
from hstrace.drafter.vocab import DIRECT_TABLE, OFFSETS, draft_vocab_targets, map_draft_ids


@dataclass
class DraftCache:
    """Keys/values per layer per step, and the step-0 mask, for TTT steps k > 0."""

    keys: list[list[Tensor]]  # [layer][step] -> [B, nkv, T, hd]
    values: list[list[Tensor]]
    masks: list[Tensor]  # [layer] -> bool [B, T, T]: which step-0 keys each query may see
    positions0: Tensor  # [B, T]: step-0 RoPE positions; step k uses positions0 + k

    @property
    def steps(self) -> int:
        return len(self.keys[0])


@dataclass
class DraftOutput:
    logits: Tensor  # [B, T, Vd] (or [T, Vd] for unbatched input): draft-vocab logits
    hidden: Tensor  # [B, T, H]: the state to feed back at the next step
    cache: DraftCache = field(repr=False)


class DecoderLayer(DecoderBlock):
    """Layer 0 is the EAGLE-3 midlayer (attention over [embed, hidden], 2H wide, its own
    residual); later layers are the plain pre-norm block (speculators multi-layer drafts)."""

    def __init__(self, cfg: DrafterConfig, first: bool):
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        attn = GQAttention(
            2 * H if first else H,
            H,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.hd,
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias,
            qk_norm_eps=eps if cfg.qk_norm else None,
        )
        super().__init__(H, eps, attn, SwiGLU(H, cfg.intermediate_size))
        self.first, self.norm_before_residual = first, cfg.norm_before_residual
        if first:
            self.hidden_norm = RMSNorm(H, eps)

    def forward(  # type: ignore[override]
        self,
        h: Tensor,
        e: Tensor | None,
        rope: Rope,
        keys: list[Tensor],
        values: list[Tensor],
        mask0: Tensor,
    ) -> Tensor:
        if not self.first:
            return super().forward(h, rope, keys, values, mask0)
        assert e is not None
        g_n = self.hidden_norm(h)
        residual = g_n if self.norm_before_residual else h
        x = torch.cat([self.input_layernorm(e), g_n], dim=-1)  # embeds FIRST
        return self.attend_then_ffn(residual, x, rope, keys, values, mask0)


def _batched(x: Tensor, dims: int) -> tuple[Tensor, bool]:
    return (x.unsqueeze(0), True) if x.dim() == dims else (x, False)


class Eagle3Drafter(nn.Module):
    """Parameter names follow the speculators layout (`layers.0.*`); see `checkpoint.py`."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        H, n, Ht = cfg.hidden_size, cfg.num_aux, cfg.aux_width
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(n * Ht, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(Ht, cfg.rms_norm_eps) for _ in range(n)])
        self.fc = nn.Linear(n * Ht, H, bias=False)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, i == 0) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        # d2t: offsets (target = i + d2t[i]); zeros = identity onto ids 0..Vd-1. t2d: draft-vocab mask.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.hd, cfg.rope_theta, cfg.rope_scaling), persistent=False
        )

    # -- pieces ---------------------------------------------------------------------------------
    def combine(self, aux: Tensor) -> Tensor:
        """Project the target's aux concat [.., n*Ht] to the drafter's width [.., H]."""
        cfg = self.cfg
        if cfg.skip_fc:  # the serving fault: one H-wide state taken as fc's output
            if aux.shape[-1] != cfg.hidden_size:
                raise ValueError(
                    f"skip_fc: aux width {aux.shape[-1]} != hidden_size {cfg.hidden_size}"
                )
            return aux
        if aux.shape[-1] != cfg.num_aux * cfg.aux_width:
            raise ValueError(
                f"aux width {aux.shape[-1]} != num_aux*target_hidden = {cfg.num_aux * cfg.aux_width}"
            )
        if cfg.norm_before_fc:
            aux = self.input_norm(aux)
        if cfg.fc_norm:
            aux = torch.cat(
                [nm(c) for nm, c in zip(self.fc_norm, aux.chunk(cfg.num_aux, -1), strict=True)], -1
            )
        return self.fc(aux)

    def _step0_masks(
        self, B: int, T: int, document_ids: Tensor | None, device: torch.device
    ) -> list[Tensor]:
        i = torch.arange(T, device=device)
        diag = i[:, None] == i[None, :]
        masks = []
        for layer in range(len(self.layers)):
            m = i[:, None] >= i[None, :]
            w = self.cfg.window_of_layer(layer)
            if w is not None:
                m = m & (i[None, :] > i[:, None] - w)
            m = m.expand(B, T, T)
            if document_ids is not None:  # packed samples: -1 = padding, sees only itself
                d = document_ids
                m = m & (d[:, :, None] == d[:, None, :]) & (d[:, :, None] != -1)
            masks.append(m | diag)
        return masks

    def _run(
        self, ids: Tensor, g: Tensor, positions: Tensor, cache: DraftCache
    ) -> tuple[Tensor, Tensor]:
        e = self.embed_tokens(ids)
        rope = Rope.at(positions, self.inv_freq, g.dtype)
        h = g
        for li, layer in enumerate(self.layers):
            h = layer(
                h,
                e if li == 0 else None,
                rope,
                cache.keys[li],
                cache.values[li],
                cache.masks[li],
            )
        hn = self.norm(h)
        logits = self.lm_head(hn if self.cfg.logits_use_norm else h)
        return logits, (hn if self.cfg.feed_normed else h)

    # -- forwards -------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Tensor,
        aux_hidden: Tensor,
        positions: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> DraftOutput:
        """Step 0. input_ids [T] or [B, T] (token at t+1 for aux row t); aux_hidden [.., T, n*Ht]."""
        ids, unbatched = _batched(input_ids, 1)
        aux, _ = _batched(aux_hidden, 2)
        B, T = ids.shape
        if aux.shape[:2] != (B, T):
            raise ValueError(f"aux_hidden rows {tuple(aux.shape[:2])} != input_ids {(B, T)}")
        pos = (
            _batched(positions, 1)[0]
            if positions is not None
            else torch.arange(T, device=ids.device).expand(B, T)
        )
        docs = _batched(document_ids, 1)[0] if document_ids is not None else None
        nl = len(self.layers)
        cache = DraftCache(
            [[] for _ in range(nl)],
            [[] for _ in range(nl)],
            self._step0_masks(B, T, docs, ids.device),
            pos,
        )
        logits, hidden = self._run(ids, self.combine(aux), pos, cache)
        return self._out(logits, hidden, cache, unbatched)

    def step(
        self, input_ids: Tensor, hidden: Tensor, cache: DraftCache, positions: Tensor | None = None
    ) -> DraftOutput:
        """TTT step k = cache.steps: hidden = the previous step's `.hidden` (no fc), keys appended.
        Positions default to step-0 positions + k."""
        ids, unbatched = _batched(input_ids, 1)
        g, _ = _batched(hidden, 2)
        k = cache.steps
        pos = _batched(positions, 1)[0] if positions is not None else cache.positions0 + k
        logits, h = self._run(ids, g, pos, cache)
        return self._out(logits, h, cache, unbatched)

    @staticmethod
    def _out(logits: Tensor, hidden: Tensor, cache: DraftCache, unbatched: bool) -> DraftOutput:
        if unbatched:
            return DraftOutput(logits[0], hidden[0], cache)
        return DraftOutput(logits, hidden, cache)

    def ttt(
        self,
        input_ids: Tensor,
        aux_hidden: Tensor,
        steps: int = 3,
        positions: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> list[DraftOutput]:
        """Training semantics: step k feeds the ground truth shifted left by k (padded with 0).
        Step-k logits are valid for rows [0, T-k)."""
        out = [self.forward(input_ids, aux_hidden, positions, document_ids)]
        for k in range(1, steps):
            shifted = torch.cat(
                [input_ids[..., k:], input_ids.new_zeros(*input_ids.shape[:-1], k)], -1
            )
            out.append(self.step(shifted, out[-1].hidden, out[-1].cache))
        return out

    def draft_chain(
        self,
        input_ids: Tensor,
        aux_hidden: Tensor,
        steps: int = 3,
        positions: Tensor | None = None,
        direct_d2t: bool = False,
    ) -> tuple[Tensor, Tensor, list[Tensor]]:
        """Greedy serving semantics from every row at once: step k feeds the draft's own step k-1
        argmax mapped to target ids. Returns (draft ids [.., T, steps], target ids, logits)."""
        out = self.forward(input_ids, aux_hidden, positions)
        drafts, logits = [out.logits.argmax(-1)], [out.logits]
        for _ in range(1, steps):
            out = self.step(
                self.draft_to_target(drafts[-1], direct=direct_d2t), out.hidden, out.cache
            )
            drafts.append(out.logits.argmax(-1))
            logits.append(out.logits)
        d = torch.stack(drafts, -1)
        return d, self.draft_to_target(d, direct=direct_d2t), logits

    # -- vocab ----------------------------------------------------------------------------------
    def draft_to_target(self, ids: Tensor, direct: bool = False, reading: str = OFFSETS) -> Tensor:
        """Offsets (every library): target = i + d2t[i]. `direct=True` (= `reading=DIRECT_TABLE`)
        is the misreading target = d2t[i], for what-if replays (`hstrace.drafter.vocab`)."""
        return map_draft_ids(ids, self.d2t, DIRECT_TABLE if direct else reading)

    def full_vocab_logits(self, logits: Tensor) -> Tensor:
        """Scatter draft-vocab logits into the target vocab; ids outside the draft vocab = -inf."""
        out = logits.new_full((*logits.shape[:-1], self.cfg.vocab_size), float("-inf"))
        return out.index_copy(-1, draft_vocab_targets(self.d2t.to(logits.device)), logits)
