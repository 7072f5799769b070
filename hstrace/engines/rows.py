"""Trace rows every engine's taps build the same way: the row type (`TableWrite`), the
`requests` row, the request-key column and the `aux_hidden` column attributes.

Pure row building (torch tensors in, rows out); no engine, no writer, no patching. The taps of
each engine package (`hstrace.engines.<name>.taps`) build on it; the hooks pass the rows to the
rank's writer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hstrace.trace.schema import SAMPLING_COLUMNS, SAMPLING_FLOAT, SAMPLING_UNSET


@dataclass
class TableWrite:
    """Rows of one trace table for one event, axis by axis (what `TraceWriter.write` takes)."""

    table: str
    step: dict[str, Any] = field(default_factory=dict)
    req: dict[str, Any] = field(default_factory=dict)
    tok: dict[str, Any] = field(default_factory=dict)
    other: dict[str, dict[str, Any]] = field(
        default_factory=dict
    )  # extra axes: proposed, accepted, rid
    column_attrs: dict[str, dict[str, Any]] | None = None


# ---- rows every engine's taps build the same way ----------------------------------------------


_KEYS: dict[str, int] = {}  # request id -> its key: a decode batch's ids recur every step
_KEYS_MAX = 4096  # ids kept before the cache starts over
# the last batch's ids and their column: a steady decode batch's column is made once, not at
# every step (a column is only ever read: staged, compared; never written in place)
_LAST_KEYS: tuple[tuple[str, ...], Any] | None = None


def request_keys(rids: Sequence[str]) -> Any:
    """The store's stable 63-bit hash of each request id, as the `req_key` column (each id
    hashed once while it is among the last `_KEYS_MAX` ids seen; the last batch's column
    shared while the batch stays the same)."""
    global _LAST_KEYS
    import torch

    from hstrace.trace import request_key

    batch = tuple(rids)
    last = _LAST_KEYS  # one read: another thread may replace it
    if last is not None and last[0] == batch:
        return last[1]
    keys, out = _KEYS, []
    for rid in rids:
        key = keys.get(rid)
        if key is None:
            if len(keys) >= _KEYS_MAX:
                keys.clear()
            key = keys[rid] = request_key(rid)
        out.append(key)
    column = torch.tensor(out, dtype=torch.int64)
    _LAST_KEYS = (batch, column)
    return column


# The sampling parameters of a request as the engine resolved them: the trace's columns
# (hstrace.trace.schema.SAMPLING_COLUMNS, docs/trace-format.md "Request metadata").
UNSET = SAMPLING_UNSET


def sampling_row(params: Any, aliases: dict[str, str] | None = None) -> dict[str, float | int]:
    """One request's sampling parameters read off the engine's own object (vLLM
    `SamplingParams`, SGLang `SamplingParams`), named as `SAMPLING_COLUMNS`; `aliases` maps a
    column to the engine's attribute where the names differ (SGLang: max_new_tokens). A
    request without one (a pooling request) gets NaN / -1."""
    aliases = aliases or {}
    row: dict[str, float | int] = {}
    for name in SAMPLING_COLUMNS:
        value = None if params is None else getattr(params, aliases.get(name, name), None)
        if name in SAMPLING_FLOAT:
            row[name] = float("nan") if value is None else float(value)
        else:
            row[name] = UNSET if value is None else int(value)
    return row


def requests_write(
    rids: Sequence[str],
    prompts: Sequence[Any],
    n_cached: Sequence[int],
    sampling: Sequence[dict[str, float | int]] | None = None,
) -> Any:
    """One `requests` row per new request: its id (bytes and hash), prompt token ids, the
    prompt tokens the engine served from its prefix cache, and (`sampling`, one
    `sampling_row` per request) the sampling parameters as the engine resolved them."""
    import torch

    ids = [torch.as_tensor(list(p), dtype=torch.int64) for p in prompts]
    rid_bytes = [torch.frombuffer(bytearray(str(r).encode()), dtype=torch.uint8) for r in rids]
    return TableWrite(
        "requests",
        req={
            "req_key": request_keys([str(r) for r in rids]),
            "n_prompt": torch.tensor([len(p) for p in ids], dtype=torch.int64),
            "rid_len": torch.tensor([len(b) for b in rid_bytes], dtype=torch.int64),
            "n_cached": torch.tensor(list(n_cached), dtype=torch.int64),
            **_sampling_columns(sampling),
        },
        tok={"prompt_ids": torch.cat(ids)},
        other={"rid": {"bytes": torch.cat(rid_bytes)}},
    )


def _sampling_columns(sampling: Sequence[dict[str, float | int]] | None) -> dict[str, Any]:
    import torch

    if sampling is None:
        return {}
    return {
        name: torch.tensor(
            [row[name] for row in sampling],
            dtype=torch.float64 if name in SAMPLING_FLOAT else torch.int64,
        )
        for name in SAMPLING_COLUMNS
    }


def aux_hidden_attrs(
    layer_ids: Sequence[int], width: int, convention: str | None = None
) -> dict[str, Any]:
    """Column attributes of `target.aux_hidden`, as the reference engine writes them. Both
    engines' capture id k is the residual stream entering decoder layer k = HF
    `hidden_states[k]` (SGLang's `layers_to_capture`, vLLM's aux ids: no +1 at this point), and
    captures are concatenated in layer order (so the slots are the sorted, distinct ids).
    `convention` names what the state is when it is not that (an MTP head is handed the
    target's forward output, e.g. `mtp_target_output`)."""
    slots = sorted(set(layer_ids))
    return {
        "layer_ids": slots,
        "layer_id_convention": convention or "hf_hidden_states_index",
        "slot_width": width // len(slots) if slots else width,
    }
