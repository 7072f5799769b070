"""Stage `draft-input`: what the drafter was fed next to the aux states.

- `fc-skipped`: the recorded hidden input is one H-wide state, not the n*Ht concat fc expects
  (an engine that runs fc only when the width differs from the embedding's lets it through).
- `token-shift`: the recorded token ids (or positions) are not the EAGLE-3 pairing: aux row t
  goes with the committed token t+1.
"""

from __future__ import annotations

from hstrace.findings import Finding, finding
from hstrace.replay.compare import AGREE_TOP1
from hstrace.replay.evidence import Evidence


def fc_skipped(ev: Evidence) -> list[Finding]:
    cfg = ev.cfg
    rows = ev.agreement.rows
    if cfg is None:
        return []
    widths = set(rows.hidden_widths) if rows is not None else set()
    if not widths and ev.serving_width is not None:
        widths = {ev.serving_width}
    if widths != {int(cfg.hidden_size)} or cfg.hidden_size == ev.fc_in:
        return []
    evidence = {
        "recorded_hidden_width": int(cfg.hidden_size),
        "fc_input_width": int(ev.fc_in),
        "aux_slots_expected": int(cfg.num_aux),
    }
    if ev.agreement.hidden_in_rms is not None:
        evidence["hidden_in_rms"] = ev.agreement.hidden_in_rms
    search = ev.whatif
    if search is not None and search.best is not None and search.best.name == "fc skipped":
        evidence["reproduced_by_reference_without_fc"] = True
    return [
        finding(
            "fc-skipped",
            f"the drafter received one {cfg.hidden_size}-wide state instead of the "
            f"{ev.fc_in}-wide aux concat, so fc was skipped (the width check passed)",
            evidence=evidence,
            num_aux=cfg.num_aux,
            fc_in=ev.fc_in,
        )
    ]


def token_shift(ev: Evidence) -> list[Finding]:
    rows = ev.agreement.rows
    scores = ev.draft_inputs.token_agreement_by_shift  # `replay.fed`
    if rows is None or scores is None:
        return []
    found: list[Finding] = []
    if scores[0] < AGREE_TOP1:
        shift = max((-1, 1), key=lambda s: scores[s])
        if scores[shift] >= AGREE_TOP1:
            found.append(
                finding(
                    "token-shift",
                    f"the drafter was fed token t{1 + shift:+d} with aux row t instead of t+1 "
                    f"({scores[shift]:.0%} of rows; {scores[0]:.0%} have the right pairing)",
                    evidence={"token_agreement_by_shift": ev.draft_inputs.by_shift_json},
                )
            )
    values = ev.draft_inputs.position_offsets
    if values:
        if len(values) > 1:
            found.append(
                finding(
                    "token-shift",
                    f"draft positions are not the token positions: offsets {values[:8]}",
                    evidence={"position_offsets": values[:16]},
                    variant="positions",
                )
            )
        elif values[0] != 0:
            # RoPE is relative: a constant offset changes no logit unless a window or an
            # absolute-position scaling is in play. Worth knowing, not a fault.
            found.append(
                finding(
                    "token-shift",
                    f"draft positions start at {int(values[0])} instead of 0 (constant offset; "
                    "harmless with RoPE and full attention)",
                    evidence={"position_offset": int(values[0])},
                    variant="position-offset",
                    severity="info",
                )
            )
    return found


# A global pairing this good means the rows outside the seams are right.
SEAM_CONTEXT_AGREE = 0.99


def chunk_boundary_token(ev: Evidence) -> list[Finding]:
    """Chunked prefill: at the last row of every non-final chunk the drafter must get the next
    chunk's first prompt token; an engine that hands it the target's prediction there
    (sglang PR #26329, fixed by #26800) is wrong on one row per seam, which a global shift test
    cannot see. The seams come from the trace: one target step per prefill chunk."""
    seams = ev.draft_inputs.seams  # the seam rows as measured (`replay.fed`)
    seams_seen, wrong = seams.rows, seams.wrong
    other_ok, other_total = seams.other_ok, seams.other_total
    if not wrong or not other_total or other_ok / other_total < SEAM_CONTEXT_AGREE:
        return []  # no seam is wrong, or everything is: token-shift speaks for that
    first = wrong[0]
    return [
        finding(
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
        )
    ]
