"""Greedy parity (`hstrace record --parity`): the outputs of the recorded run next to those of
the same server command with speculative decoding off, token by token.

Speculative decoding must not change greedy output (the target verifies every token); where it
does, the engine's verify or its state rollback is wrong (vLLM PR #50146: hybrid targets whose
state was not rolled back). This module states what was compared and the first difference, as
facts; `hstrace.diagnose.parity` names the finding. Pure: no engine, no server.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hstrace.engines.base import Prompt


def greedy(prompt: Prompt) -> bool:
    """Whether a prompt is sent greedily (temperature 0, or none given: the default)."""
    return float(dict(prompt.sampling).get("temperature", 0.0)) == 0.0


def compare_outputs(
    prompts: Sequence[Prompt],
    with_spec: Sequence[Mapping[str, Any]],
    without_spec: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """Each greedy prompt's output ids with speculation (`with_spec`, the recorded run's
    per-request metrics, in prompt order) and without (`without_spec`), compared token by
    token up to the shorter one; a length difference counts where the shorter one ends.

    Returns `{"requests", "tokens", "skipped", "first_difference"}`: requests and tokens
    compared, the prompts not compared and why, and the first request that differs
    (`request` index, `source_id`, `rid`, `position`, `with_spec` / `without_spec` token or
    None past the end, and both runs' output lengths), or None when parity held."""
    compared = tokens = 0
    skipped: list[dict[str, Any]] = []
    first: dict[str, Any] | None = None
    for i, prompt in enumerate(prompts):
        a = with_spec[i].get("output_ids") if i < len(with_spec) else None
        b = without_spec[i].get("output_ids") if i < len(without_spec) else None
        if not greedy(prompt):
            skipped.append({"request": i, "why": "sampled (temperature > 0): not deterministic"})
            continue
        if a is None or b is None:
            skipped.append({"request": i, "why": "the engine returned no output token ids"})
            continue
        compared += 1
        n = min(len(a), len(b))
        at = next((j for j in range(n) if a[j] != b[j]), None)
        if at is None and len(a) != len(b):
            at = n
        tokens += n if at is None else at
        if at is not None and first is None:
            first = {
                "request": i,
                "source_id": prompt.source_id,
                "rid": with_spec[i].get("rid"),
                "position": at,
                "with_spec": a[at] if at < len(a) else None,
                "without_spec": b[at] if at < len(b) else None,
                "with_spec_len": len(a),
                "without_spec_len": len(b),
            }
    return {
        "requests": compared,
        "tokens": tokens,
        "skipped": skipped,
        "first_difference": first,
    }
