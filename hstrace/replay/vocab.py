"""Evidence `VocabReadings`: how the engine turned draft ids into target ids.

The engine recorded both its draft-space top-k and the target ids it proposed. Applying each
reading of `d2t` to the engine's own draft ids shows which one it used: offsets
(`target = i + d2t[i]`, every library), a direct table (`target = d2t[i]`), or none at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hstrace.drafter.vocab import D2T_READINGS, map_draft_ids
from hstrace.replay.compare import agreement, with_topk
from hstrace.replay.unavailable import Unavailable


@dataclass(frozen=True)
class VocabReadings:
    scores: dict[str, float] | None  # per reading: share of proposed target ids it explains
    draft: torch.Tensor | None = None  # [R, k] the engine's draft ids on the judged rows
    served: torch.Tensor | None = None  # [R, k] the target ids it proposed
    d2t: torch.Tensor | None = None
    unavailable: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        if self.scores is None:
            return {}
        return {
            "target_space_top1": round(self.scores["offsets"], 6),
            "vocab_readings": {k: round(v, 6) for k, v in self.scores.items()},
        }


def build_vocab_readings(drafter: Any, rows: Any) -> VocabReadings:
    """`rows`: hstrace.replay.agreement.EngineRows (or None)."""
    u = Unavailable()
    if drafter is None or rows is None or rows.topk_target_ids is None:
        u.note("vocab map", "no recorded target-space draft ids")
        return VocabReadings(None, unavailable=u.frozen())
    # Only rows where the engine drafted: SGLang writes id -1 on the rest (no draft logits).
    keep = with_topk(rows.topk_draft_ids) & (rows.topk_target_ids[:, 0].long() >= 0)
    if not keep.any():
        u.note("vocab map", "no draft row with a recorded top-k")
        return VocabReadings(None, unavailable=u.frozen())
    d2t = drafter.d2t.long()
    vocab = int(drafter.cfg.vocab_size)
    draft = rows.topk_draft_ids[keep].long().clamp(0, len(d2t) - 1)
    served = rows.topk_target_ids[keep].long()
    real = (rows.topk_draft_ids[keep].long() >= 0) & (served >= 0)  # padded entries: none
    scores = {
        name: agreement(map_draft_ids(draft, d2t, name, vocab)[real], served[real])
        for name in D2T_READINGS
    }
    return VocabReadings(scores, draft, served, d2t, u.frozen())
