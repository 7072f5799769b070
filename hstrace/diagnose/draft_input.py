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


# A global pairing this good means the rows outside the seams are right.
SEAM_CONTEXT_AGREE = 0.99


def chunk_boundary_token(ctx) -> list[Finding]:
    """Chunked prefill: at the last row of every non-final chunk the drafter must get the next
    chunk's first prompt token; an engine that hands it the target's prediction there
    (sglang PR #26329, fixed by #26800) is wrong on one row per seam, which a global shift test
    cannot see. The seams come from the trace: one target step per prefill chunk."""
    seams_seen, wrong, other_ok, other_total = 0, [], 0, 0
    for r in ctx.serving.requests:
        d = r.draft
        if d is None or len(r.prefill_chunks) < 2:
            continue
        seams = set(r.seams)
        idx = np.asarray(d.index)
        fed = np.asarray(d.input_ids)
        ok = idx + 1 < len(r.tokens)
        expected = np.full(len(idx), -1, dtype=np.int64)
        expected[ok] = np.asarray(r.tokens)[idx[ok] + 1]
        at_seam = np.array([int(i) in seams for i in idx], dtype=bool) & ok
        rest = ok & ~at_seam
        other_ok += int((fed[rest] == expected[rest]).sum())
        other_total += int(rest.sum())
        seams_seen += int(at_seam.sum())
        for row in np.flatnonzero(at_seam & (fed != expected)):
            item = {
                "request": r.name,
                "position": int(idx[row]),
                "fed_token": int(fed[row]),
                "next_prompt_token": int(expected[row]),
                "chunk": next(list(c) for c in r.prefill_chunks if c[1] - 1 == int(idx[row])),
            }
            if ctx.target is not None:
                pred = ctx.target.forward(torch.as_tensor(r.tokens[: idx[row] + 1]).long())
                item["fed_is_target_prediction"] = int(pred.logits[-1].argmax()) == int(fed[row])
            wrong.append(item)
    if seams_seen:
        ctx.metrics["chunk_seams"] = {"rows": seams_seen, "wrong": len(wrong)}
    if not wrong or not other_total or other_ok / other_total < SEAM_CONTEXT_AGREE:
        return []  # no seam is wrong, or everything is: token-shift speaks for that
    first = wrong[0]
    return [
        Finding(
            "chunk-boundary-token",
            f"at {len(wrong)} of {seams_seen} chunked-prefill seam row(s) the drafter was fed "
            f"another token than the next prompt token (e.g. {first['request']} position "
            f"{first['position']}: fed {first['fed_token']}, prompt has "
            f"{first['next_prompt_token']}); {other_ok / other_total:.0%} of the other rows "
            "are paired right",
            evidence={
                "seam_rows": wrong[:20],
                "seams": seams_seen,
                "other_rows_token_agreement": round(other_ok / other_total, 4),
            },
            fix=(
                "at the end of a non-final prefill chunk the draft input's last token must be "
                "the first token of the next chunk, not the target's sampled prediction: "
                "upgrade SGLang to a version with PR #26800 (the fix of PR #26329), or serve "
                "with a --chunked-prefill-size larger than the prompts to confirm"
            ),
        )
    ]
