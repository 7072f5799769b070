"""What a trace's metadata and values may be: the reader's checks, one named line each.

The metadata checks are on types and ranges (a `tables` list where a dict belongs, negative row
counts, `engine` given as a string); the value checks run on the rows a reader actually reads
(token ids against the vocabulary, counts against their ranges and against the offsets), so
validation never reads data a command does not need.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hstrace.errors import TraceError

# Columns of schema v1 holding token ids; the top-k ids may be -1 where no top-k was computed
# (SGLang keeps logits only for some rows: docs/trace-format.md); an engine may pad a request's
# proposed drafts with -1 (vLLM's placeholder).
TARGET_ID_COLUMNS = {
    ("tok", "input_ids"),
    ("tok", "prompt_ids"),
    ("tok", "topk_target_ids"),
    ("req", "bonus_id"),
    ("proposed", "ids"),
    ("accepted", "ids"),
}
DRAFT_ID_COLUMNS = {("tok", "topk_draft_ids")}
SENTINEL_OK = {("tok", "topk_target_ids"), ("tok", "topk_draft_ids"), ("proposed", "ids")}
# Target ids the engine mapped from draft ids itself: a misread d2t (SGLang's hot_token_id =
# d2t + arange over a d2t that holds a table) proposes ids past the vocabulary, and that is the
# evidence of the fault, not corruption (replay only compares them, never indexes with them).
# `verify.proposed` holds the same mapped drafts.
ENGINE_MAPPED = {("tok", "topk_target_ids"), ("proposed", "ids")}
# Counts and indices that are never negative (positions may be: a producer's shift knob).
NONNEGATIVE = {
    ("req", "n_tok"),
    ("req", "n_prompt"),
    ("req", "rid_len"),
    ("req", "n_cached"),
    ("req", "accept_len"),
    ("req", "n_proposed"),
    ("req", "n_accepted"),
    ("step", "step_index"),
}
# (count column, axis whose rows it counts) in one table: per step, the counts sum to the rows.
COUNTS_OF = {
    "n_tok": "tok",
    "n_prompt": "tok",
    "rid_len": "rid",
    "n_proposed": "proposed",
    "n_accepted": "accepted",
}
# (column, bound column): column <= bound, row by row.
BOUNDED_BY = {("req", "accept_len"): "n_proposed", ("req", "n_accepted"): "n_proposed"}
# Storage dtypes the schema allows for its columns (by logical dtype class).
INT_DTYPES = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32"}
FLOAT_LOGICAL = {"bfloat16", "float16", "float32", "float64"}
FLOAT_COLUMNS = {"aux_hidden", "hidden_in", "topk_logprobs", "lse", "logits"}


def expect_dict(value: Any, what: str, where: str) -> dict:
    if not isinstance(value, dict):
        raise TraceError(
            f"{where}: {what} should be a JSON object, found {type(value).__name__} "
            f"{_short(value)} (corrupt)"
        )
    return value


def expect_count(value: Any, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(
            f"{where}: {what} should be a whole number, found {_short(value)} (corrupt)"
        )
    if value < 0:
        raise TraceError(f"{where}: {what} is negative ({value}) (corrupt)")
    return value


def check_root_meta(meta: dict, where: str) -> None:
    engine = expect_dict(meta.get("engine", {}), "root attribute 'engine'", where)
    if "name" in engine and not isinstance(engine["name"], str):
        raise TraceError(f"{where}: engine name {_short(engine['name'])} is not a string (corrupt)")
    expect_dict(meta.get("static") or {}, "root attribute 'static'", where)
    expect_dict(meta.get("host") or {}, "root attribute 'host'", where)
    cmd = meta.get("command_line", [])
    if not isinstance(cmd, list):
        raise TraceError(
            f"{where}: root attribute 'command_line' should be a list, found {_short(cmd)} "
            "(corrupt)"
        )
    created = meta.get("created")
    if created is not None and not isinstance(created, str):
        raise TraceError(f"{where}: root attribute 'created' {_short(created)} is not a string")


def check_rank_meta(meta: dict, where: str) -> None:
    commit = expect_dict(meta["commit"], "the commit record", where)
    tables = expect_dict(commit.get("tables") or {}, "commit record 'tables'", where)
    for name, entry in tables.items():
        entry = expect_dict(entry, f"commit record of table {name!r}", where)
        expect_count(entry.get("steps"), f"commit record {name}.steps", where)
        rows = expect_dict(entry.get("rows"), f"commit record {name}.rows", where)
        for key, n in rows.items():
            expect_count(n, f"commit record {name}.rows[{key!r}]", where)
    dropped = expect_dict(commit.get("dropped_steps") or {}, "commit record 'dropped_steps'", where)
    for name, n in dropped.items():
        expect_count(n, f"commit record dropped_steps[{name!r}]", where)
    expect_dict(meta.get("static") or {}, "rank attribute 'static'", where)
    errors = meta.get("errors") or []
    if not isinstance(errors, list) or not all(isinstance(e, dict) for e in errors):
        raise TraceError(f"{where}: rank attribute 'errors' should be a list of objects (corrupt)")


def check_table_meta(tmeta: Any, where: str) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """(axes, columns spec) of a table group's `hstrace` attributes."""
    tmeta = expect_dict(tmeta, "the table attributes", where)
    axes = tmeta.get("axes")
    if not isinstance(axes, list) or not all(isinstance(a, str) for a in axes):
        raise TraceError(
            f"{where}: table attribute 'axes' should be a list of names, found {_short(axes)} "
            "(corrupt)"
        )
    cols = expect_dict(tmeta.get("columns"), "table attribute 'columns'", where)
    spec: dict[str, dict[str, Any]] = {}
    for axis, c in cols.items():
        if axis not in axes:
            raise TraceError(f"{where}: columns of axis {axis!r}, not one of its axes {axes}")
        c = expect_dict(c, f"columns of axis {axis!r}", where)
        spec[axis] = {name: expect_dict(v, f"column {axis}/{name}", where) for name, v in c.items()}
    return axes, spec


def check_dtype(axis: str, column: str, stored: str, spec: dict, logical: str, where: str) -> None:
    """The array's data_type must be what the table declares and what the schema allows."""
    declared = spec.get("dtype")
    if declared is not None and declared != stored:
        raise TraceError(
            f"{where}: column {axis}/{column} is stored as {stored} but the table declares "
            f"{declared} (its metadata was edited: corrupt)"
        )
    if logical == "bfloat16":
        if stored != "uint16":
            raise TraceError(
                f"{where}: column {axis}/{column} is bfloat16 but stored as {stored}; schema v1 "
                "stores bfloat16 as its uint16 bits (corrupt)"
            )
    elif logical != stored:
        raise TraceError(
            f"{where}: column {axis}/{column} has logical dtype {logical} but is stored as "
            f"{stored} (corrupt)"
        )
    if column in FLOAT_COLUMNS and logical not in FLOAT_LOGICAL:
        raise TraceError(
            f"{where}: column {axis}/{column} holds floats, found dtype {logical} (corrupt)"
        )
    if (axis, column) in NONNEGATIVE | TARGET_ID_COLUMNS | DRAFT_ID_COLUMNS and (
        stored not in INT_DTYPES
    ):
        raise TraceError(
            f"{where}: column {axis}/{column} holds integers, found dtype {stored} (corrupt)"
        )


def check_values(
    axis: str,
    column: str,
    data: np.ndarray,
    first_row: int,
    where: str,
    vocab: int | None,
    draft_vocab: int | None,
) -> None:
    """Range checks of rows [first_row, first_row + len(data)) of one column."""
    key = (axis, column)
    if data.size == 0:
        return
    if key in NONNEGATIVE:
        _refuse_if(data < 0, data, axis, column, first_row, where, "is negative")
    if key == ("step", "mode"):
        _refuse_if(
            (data != 0) & (data != 1),
            data,
            axis,
            column,
            first_row,
            where,
            "is neither 0 (prefill/extend) nor 1 (verify)",
        )
    if key in TARGET_ID_COLUMNS or key in DRAFT_ID_COLUMNS:
        low = -1 if key in SENTINEL_OK else 0
        _refuse_if(data < low, data, axis, column, first_row, where, "is not a token id (negative)")
        bound = draft_vocab if key in DRAFT_ID_COLUMNS else vocab
        if bound is not None and key not in ENGINE_MAPPED:
            _refuse_if(
                data >= bound,
                data,
                axis,
                column,
                first_row,
                where,
                f"is outside the vocabulary of {bound} ids",
            )


def check_bounded(
    axis: str, column: str, data: np.ndarray, bound_name: str, bound: np.ndarray, first: int, where
) -> None:
    bad = data > bound
    if np.any(bad):
        i = int(np.argmax(bad))
        raise TraceError(
            f"{where}: {axis}/{column} = {int(data.flat[i])} at row {first + i} is larger than "
            f"{axis}/{bound_name} = {int(bound.flat[i])} there (corrupt)"
        )


def check_counts_match(
    column: str, counts: np.ndarray, off_req: np.ndarray, off_axis: np.ndarray, axis: str, where
) -> None:
    """Per step, the request rows' counts sum to the step's rows on `axis`."""
    steps = len(off_req) - 1
    if steps <= 0:
        return
    step_of = np.repeat(np.arange(steps), np.diff(off_req))
    sums = np.bincount(step_of, weights=counts.astype(np.float64), minlength=steps)
    rows = np.diff(off_axis).astype(np.float64)
    bad = sums != rows
    if np.any(bad):
        s = int(np.argmax(bad))
        raise TraceError(
            f"{where}: req/{column} of step {s} sums to {int(sums[s])}, but the step has "
            f"{int(rows[s])} {axis} rows (corrupt)"
        )


def static_vocab(static: dict) -> tuple[int | None, int | None]:
    """(target vocab, draft vocab) the trace's static audit declares, or None where unknown."""

    def num(*path: str) -> int | None:
        v: Any = static
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    vocab = (
        num("target", "vocab_size")
        or num("draft_config", "transformer_layer_config", "vocab_size")
        or num("draft_config", "vocab_size")
    )
    draft = num("draft_config", "draft_vocab_size") or num("hot_token_id", "size")
    return vocab, draft


def _refuse_if(bad, data, axis, column, first_row, where, why) -> None:
    if np.any(bad):
        flat = int(np.argmax(bad.reshape(-1)))
        row = first_row + flat // max(1, int(np.prod(data.shape[1:])))
        raise TraceError(
            f"{where}: {axis}/{column} = {int(data.reshape(-1)[flat])} at row {row} {why} (corrupt)"
        )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_token_ids(where: str, ids: Any, vocab: int, what: str = "token id") -> None:
    """Ids a consumer is about to index an embedding with must lie in [0, vocab): for traces
    whose static audit names no vocabulary, replay checks against the drafter's."""
    arr = np.asarray(ids)
    if arr.size == 0:
        return
    bad = (arr < 0) | (arr >= vocab)
    if np.any(bad):
        i = int(np.argmax(bad.reshape(-1)))
        raise TraceError(
            f"{where}: {what} {int(arr.reshape(-1)[i])} at index {i} is outside the vocabulary "
            f"of {vocab} ids (corrupt trace, or a drafter for another target)"
        )
