"""Stage `draft-input`: what the drafter was fed next to the aux states.

- `fc-skipped`: the recorded hidden input is one H-wide state, not the n*Ht concat fc expects
  (an engine that runs fc only when the width differs from the embedding's lets it through).
- `token-shift`: the recorded token ids (or positions) are not the EAGLE-3 pairing: aux row t
  goes with the committed token t+1.
"""

from __future__ import annotations

import numpy as np
import torch

from hstrace.findings import Finding
from hstrace.replay.compare import AGREE_TOP1, agreement


def fc_skipped(ctx) -> list[Finding]:
    cfg = ctx.cfg
    rows = ctx.engine_rows
    if cfg is None:
        return []
    widths = (
        {int(it.aux.shape[-1]) for it in rows.items if it.aux is not None}
        if rows is not None
        else set()
    )
    if not widths and ctx.serving_width is not None:
        widths = {ctx.serving_width}
    if widths != {int(cfg.hidden_size)} or cfg.hidden_size == ctx.fc_in:
        return []
    evidence = {
        "recorded_hidden_width": int(cfg.hidden_size),
        "fc_input_width": int(ctx.fc_in),
        "aux_slots_expected": int(cfg.num_aux),
    }
    if rows is not None and all(it.aux is not None for it in rows.items):
        h = torch.cat([it.aux.float() for it in rows.items])
        evidence["hidden_in_rms"] = round(float(h.pow(2).mean().sqrt()), 4)
    whatif = ctx.metrics.get("whatif") or {}
    if whatif.get("reproduced_by") == "fc skipped":
        evidence["reproduced_by_reference_without_fc"] = True
    return [
        Finding(
            "fc-skipped",
            f"the drafter received one {cfg.hidden_size}-wide state instead of the "
            f"{ctx.fc_in}-wide aux concat, so fc was skipped (the width check passed)",
            evidence=evidence,
            fix="serve with --speculative-algorithm EAGLE3 (not EAGLE) so the target captures "
            f"the {cfg.num_aux} aux layers and delivers {ctx.fc_in} values per token",
        )
    ]


def token_shift(ctx) -> list[Finding]:
    rows = ctx.engine_rows
    if rows is None:
        return []
    fed = torch.cat([torch.as_tensor(it.input_ids).long() for it in rows.items])
    scores = {}
    for shift in (-1, 0, 1):
        expected = []
        for req in ctx.engine_requests:
            tok = torch.as_tensor(req.tokens).long()
            idx = torch.as_tensor(req.draft.index) + 1 + shift
            exp = torch.full((len(idx),), -1, dtype=torch.long)
            ok = (idx >= 0) & (idx < len(tok))
            exp[ok] = tok[idx[ok]]
            expected.append(exp)
        exp = torch.cat(expected)
        known = exp >= 0
        scores[shift] = agreement(fed[known], exp[known]) if known.any() else 0.0
    ctx.metrics["draft_input_token_agreement"] = {f"{k:+d}": round(v, 6) for k, v in scores.items()}
    found: list[Finding] = []
    if scores[0] < AGREE_TOP1:
        shift = max((-1, 1), key=lambda s: scores[s])
        if scores[shift] >= AGREE_TOP1:
            found.append(
                Finding(
                    "token-shift",
                    f"the drafter was fed token t{1 + shift:+d} with aux row t instead of t+1 "
                    f"({scores[shift]:.0%} of rows; {scores[0]:.0%} have the right pairing)",
                    evidence={
                        "token_agreement_by_shift": ctx.metrics["draft_input_token_agreement"]
                    },
                    fix="pair the aux state of position t with the token at t+1 (shift the "
                    "input ids left by one before the draft extend, as EAGLE-3 trains)",
                )
            )
    offsets = (rows.positions - rows.index).numpy()
    if len(offsets):
        values = np.unique(offsets)
        if len(values) > 1:
            found.append(
                Finding(
                    "token-shift",
                    f"draft positions are not the token positions: offsets {values[:8].tolist()}",
                    evidence={"position_offsets": values[:16].tolist()},
                    fix="feed each draft row the position of its aux state",
                )
            )
        elif values[0] != 0:
            # RoPE is relative: a constant offset changes no logit unless a window or an
            # absolute-position scaling is in play. Worth knowing, not a fault.
            ctx.metrics["draft_position_base"] = int(values[0])
            found.append(
                Finding(
                    "token-shift",
                    f"draft positions start at {int(values[0])} instead of 0 (constant offset; "
                    "harmless with RoPE and full attention)",
                    evidence={"position_offset": int(values[0])},
                    fix="none needed unless the drafter uses a sliding window or absolute "
                    "position scaling",
                    severity="info",
                )
            )
    return found
