"""Stage `vocab-map`: how the engine turned draft ids into target ids.

The engine recorded both its draft-space top-k and the target ids it proposed. Applying each
reading of `d2t` to the engine's own draft ids shows which one it used: offsets
(`target = i + d2t[i]`, every library), a direct table (`target = d2t[i]`), or none at all.
"""

from __future__ import annotations

import torch

from hstrace.findings import Finding
from hstrace.replay.compare import AGREE_TOP1, agreement, with_topk


def _readings(d2t: torch.Tensor, vocab: int) -> dict[str, callable]:
    return {
        "offsets": lambda i: i + d2t[i],
        "direct table": lambda i: d2t[i].clamp(0, vocab - 1),
        "no mapping": lambda i: i,
    }


def vocab_mapping(ctx) -> list[Finding]:
    rows = ctx.engine_rows
    if ctx.drafter is None or rows is None or rows.topk_target_ids is None:
        ctx.skip("vocab map", "no recorded target-space draft ids")
        return []
    # Only rows where the engine drafted: SGLang writes id -1 on the rest (no draft logits).
    keep = with_topk(rows.topk_draft_ids) & (rows.topk_target_ids[:, 0].long() >= 0)
    if not keep.any():
        ctx.skip("vocab map", "no draft row with a recorded top-k")
        return []
    d2t = ctx.drafter.d2t.long()
    vocab = int(ctx.cfg.vocab_size)
    draft = rows.topk_draft_ids[keep].long().clamp(0, len(d2t) - 1)
    served = rows.topk_target_ids[keep].long()
    real = (rows.topk_draft_ids[keep].long() >= 0) & (served >= 0)  # padded entries: none
    scores = {
        name: agreement(f(draft)[real], served[real]) for name, f in _readings(d2t, vocab).items()
    }
    ctx.metrics["target_space_top1"] = round(scores["offsets"], 6)
    ctx.metrics["vocab_readings"] = {k: round(v, 6) for k, v in scores.items()}
    if scores["offsets"] >= AGREE_TOP1:
        return []
    best = max(scores, key=scores.get)
    evidence = {
        "agreement_by_reading": {k: round(v, 4) for k, v in scores.items()},
        "draft_vocab_size": int(ctx.cfg.draft_vocab_size),
        "target_vocab_size": vocab,
        "d2t_head": d2t[:8].tolist(),
        "example_draft_ids": draft[:4, 0].tolist(),
        "example_served_target_ids": served[:4, 0].tolist(),
        "example_expected_target_ids": (draft[:4, 0] + d2t[draft[:4, 0]]).tolist(),
    }
    if best == "direct table" and scores[best] >= AGREE_TOP1:
        return [
            Finding(
                "d2t-direct-table",
                "the engine reads d2t as a direct draft->target table, but the checkpoint holds "
                f"offsets: {scores[best]:.0%} of proposed target ids equal d2t[i], "
                f"{scores['offsets']:.0%} equal i + d2t[i]",
                evidence=evidence,
                fix="map draft id i to target id i + d2t[i] (SGLang: hot_token_id = d2t + arange); "
                "if a converter wrote absolute ids into d2t, store offsets instead "
                "(d2t = ids - arange(draft_vocab_size))",
            )
        ]
    if best == "no mapping" and scores[best] >= AGREE_TOP1:
        return [
            Finding(
                "vocab-map-missing",
                "the engine proposes draft ids as target ids without applying d2t: "
                f"{scores[best]:.0%} of proposed target ids equal the draft ids "
                f"(draft vocab {ctx.cfg.draft_vocab_size} < target vocab {vocab})",
                evidence=evidence,
                fix="ship the vocab mapping in the checkpoint (key `d2t`, int64 offsets, "
                f"{ctx.cfg.draft_vocab_size} entries) and make sure the engine loads it",
            )
        ]
    return [
        Finding(
            "d2t-direct-table",
            "the engine's target ids match no known reading of d2t "
            f"(offsets {scores['offsets']:.0%}, table {scores['direct table']:.0%}, "
            f"none {scores['no mapping']:.0%})",
            evidence=evidence,
            fix="compare the engine's d2t / hot_token_id with the checkpoint's d2t "
            "(`hstrace check DRAFTER`)",
            severity="warning",
        )
    ]
