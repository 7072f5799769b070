"""`batch-coupling`: a request's rows belong to another request of the same batch.

Decided from the trace's own batch composition (the `req` axis of each step): within one
target step, a request's captured row that equals another co-batched request's row although
their token prefixes differ was copied from it (a hidden state depends on every token before
it, so two different prefixes never give the same state); within one draft-extend step, a
request fed the other request's tokens. The evidence names the request whose rows these are.
The accept lengths by verify batch size are reported beside it (sglang#16274, PR #20492,
TensorRT-LLM#9208: acceptance that depends on batch size or DP rank).
"""

from __future__ import annotations

from typing import Any

from hstrace.findings import Finding, finding
from hstrace.replay.evidence import Evidence


def batch_coupling(ev: Evidence) -> list[Finding]:
    b = ev.batch  # measured from the trace's batch composition (`replay.fed`)
    by_size, aux, fed = b.accept_len_by_verify_batch_size, b.aux_rows, b.draft_inputs
    if not b.coupled:
        return []
    first = aux[0] if aux else fed[0]
    owner = first.get("rows_of") or first.get("tokens_of")
    what = "aux rows" if aux else "draft input tokens"
    pos = first.get("positions")
    where = f" (positions {pos[0]}-{pos[-1]})" if pos else ""
    evidence: dict[str, Any] = {"aux_rows": aux[:20], "draft_inputs": fed[:20]}
    if len(by_size) > 1:
        evidence["accept_len_by_verify_batch_size"] = by_size
    if ev.accept_len_by_rank:
        evidence["accept_len_by_rank"] = ev.accept_len_by_rank
    return [
        finding(
            "batch-coupling",
            f"the {what} of {first['request']}{where} in batched step {first['step']} are "
            f"those of {owner}, batched with it: rows were taken from the wrong request of the "
            "batch",
            evidence=evidence,
        )
    ]
