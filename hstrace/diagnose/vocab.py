"""Stage `vocab-map`: how the engine turned draft ids into target ids.

The engine recorded both its draft-space top-k and the target ids it proposed. Applying each
reading of `d2t` to the engine's own draft ids shows which one it used: offsets
(`target = i + d2t[i]`, every library), a direct table (`target = d2t[i]`), or none at all.
"""

from __future__ import annotations

from hstrace.drafter.vocab import map_draft_ids
from hstrace.findings import Finding, finding
from hstrace.replay.compare import AGREE_TOP1
from hstrace.replay.evidence import Evidence


def vocab_mapping(ev: Evidence) -> list[Finding]:
    v = ev.vocab  # the readings scored on the engine's own ids (`replay.fed`)
    if v.scores is None:
        return []  # `skipped` says why (vocab map)
    scores, draft, served, d2t = v.scores, v.draft, v.served, v.d2t
    vocab = int(ev.cfg.vocab_size)
    if scores["offsets"] >= AGREE_TOP1:
        return []
    best = max(scores, key=scores.get)
    evidence = {
        "agreement_by_reading": {k: round(v, 4) for k, v in scores.items()},
        "draft_vocab_size": int(ev.cfg.draft_vocab_size),
        "target_vocab_size": vocab,
        "d2t_head": d2t[:8].tolist(),
        "example_draft_ids": draft[:4, 0].tolist(),
        "example_served_target_ids": served[:4, 0].tolist(),
        "example_expected_target_ids": map_draft_ids(draft[:4, 0], d2t).tolist(),
    }
    if best == "direct table" and scores[best] >= AGREE_TOP1:
        return [
            finding(
                "d2t-direct-table",
                "the engine reads d2t as a direct draft->target table, but the checkpoint holds "
                f"offsets: {scores[best]:.0%} of proposed target ids equal d2t[i], "
                f"{scores['offsets']:.0%} equal i + d2t[i]",
                evidence=evidence,
            )
        ]
    if best == "no mapping" and scores[best] >= AGREE_TOP1:
        return [
            finding(
                "vocab-map-missing",
                "the engine proposes draft ids as target ids without applying d2t: "
                f"{scores[best]:.0%} of proposed target ids equal the draft ids "
                f"(draft vocab {ev.cfg.draft_vocab_size} < target vocab {vocab})",
                evidence=evidence,
                draft_vocab_size=ev.cfg.draft_vocab_size,
            )
        ]
    return [
        finding(
            "d2t-direct-table",
            "the engine's target ids match no known reading of d2t "
            f"(offsets {scores['offsets']:.0%}, table {scores['direct table']:.0%}, "
            f"none {scores['no mapping']:.0%})",
            evidence=evidence,
            variant="unknown",
            severity="warning",
        )
    ]
