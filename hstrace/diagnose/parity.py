"""`spec-changes-output`: greedy output with speculative decoding differs from without it.

`hstrace record --parity` runs the recorded greedy prompts again on the same server command with
speculation off and keeps the comparison in the trace (`static.parity`, facts stated by
`hstrace.engines.parity.compare_outputs`); this check names the finding from it, for `record`
itself and for every later `replay` of the trace.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hstrace.findings import Finding, finding
from hstrace.replay.evidence import Evidence


def parity_findings(parity: Mapping[str, Any] | None) -> list[Finding]:
    """The finding of a recorded parity comparison (none when parity held or none ran)."""
    if not parity or not parity.get("first_difference"):
        return []
    d = parity["first_difference"]
    where = f"request {d['request']}" + (f" ({d['source_id']})" if d.get("source_id") else "")
    said = (
        f"token {d['with_spec']} with speculation, {d['without_spec']} without"
        if d.get("with_spec") is not None and d.get("without_spec") is not None
        else f"outputs of {d['with_spec_len']} vs {d['without_spec_len']} tokens"
    )
    return [
        finding(
            "spec-changes-output",
            f"greedy output changes with speculative decoding: {where}, position "
            f"{d['position']}: {said} ({parity.get('requests')} greedy requests compared)",
            {
                "first_difference": dict(d),
                "requests_compared": parity.get("requests"),
                "tokens_equal_before": parity.get("tokens"),
                "command_without_speculation": parity.get("command_without_speculation"),
            },
            request=d["request"],
            position=d["position"],
        )
    ]


def spec_changes_output(ev: Evidence) -> list[Finding]:
    return parity_findings(ev.static.get("parity"))
