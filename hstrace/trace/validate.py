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
# Counts and indices that are never negative. A position indexes the rotary embedding: an
# engine never feeds a negative one (the reference engine's position knob shifts forward only).
NONNEGATIVE = {
    ("tok", "positions"),
    ("req", "n_tok"),
    ("req", "n_prompt"),
    ("req", "rid_len"),
    ("req", "n_cached"),
    ("req", "accept_len"),
    ("req", "n_proposed"),
    ("req", "n_accepted"),
    ("step", "step_index"),
    ("step", "seq"),
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


INT64_MAX = (1 << 63) - 1


def expect_count(value: Any, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(
            f"{where}: {what} should be a whole number, found {_short(value)} (corrupt)"
        )
    if value < 0:
        raise TraceError(f"{where}: {what} is negative ({value}) (corrupt)")
    if value > INT64_MAX:
        raise TraceError(f"{where}: {what} {_short(value)} is beyond int64 (corrupt)")
    return value


def expect_int(value: Any, what: str, where: str, low: int = 0) -> int:
    """A whole number in [low, int64 max]: not a bool (JSON `true` is a Python int), float,
    NaN or string."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(
            f"{where}: {what} should be a whole number, found {type(value).__name__} "
            f"{_short(value)} (corrupt)"
        )
    if not low <= value <= INT64_MAX:
        raise TraceError(f"{where}: {what} {_short(value)} is outside [{low}, int64 max] (corrupt)")
    return value


def check_finite_json(meta: Any, what: str, where: str) -> None:
    """No NaN or infinity and no integer beyond int64 anywhere in a metadata object: JSON has
    neither, hstrace never writes them, and Python's json reads both without a word."""
    stack: list[tuple[Any, str]] = [(meta, what)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            stack.extend((v, f"{path}.{k}") for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
        elif isinstance(value, float) and not np.isfinite(value):
            raise TraceError(f"{where}: {path} is {value!r}, not a number hstrace writes (corrupt)")
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
            raise TraceError(f"{where}: {path} {_short(value)} is beyond int64 (corrupt)")


def check_schema_version(version: Any, supported: tuple[int, ...], where: str) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version not in supported:
        raise TraceError(
            f"{where}: trace schema version {version!r} is not supported by this hstrace "
            f"(supported: {', '.join(map(str, supported))})"
        )
    return version


# Numbers of the static audit that readers use (vocab bounds, widths, layer ids, spec): each,
# where present, a whole number (`None` where the engine had none). Paths into `static`.
STATIC_COUNTS = (
    ("target", "num_layers"),
    ("target", "hidden_size"),
    ("target", "vocab_size"),
    ("hot_token_id", "size"),
    ("draft_config", "draft_vocab_size"),
    ("draft_config", "vocab_size"),
    ("draft_config", "transformer_layer_config", "vocab_size"),
    ("draft_config", "transformer_layer_config", "hidden_size"),
    ("spec", "num_steps"),
    ("spec", "topk"),
    ("spec", "num_draft_tokens"),
    ("capture", "num_captures"),
    ("fc_width", "fc_in"),
    ("fc_width", "target_delivers"),
)
STATIC_ID_LISTS = (
    ("aux_layer_ids",),
    ("capture", "layers_to_capture"),
    ("capture", "capture_order"),
)


def check_static(static: Any, where: str, what: str = "static") -> None:
    static = expect_dict(static, f"attribute '{what}'", where)

    def lookup(path: tuple[str, ...]) -> Any:
        v: Any = static
        for p in path:
            if not isinstance(v, dict):
                return None
            v = v.get(p)
        return v

    for path in STATIC_COUNTS:
        value = lookup(path)
        if value is not None:
            expect_int(value, f"{what}.{'.'.join(path)}", where)
    for path in STATIC_ID_LISTS:
        value = lookup(path)
        if value is None:
            continue
        name = f"{what}.{'.'.join(path)}"
        if not isinstance(value, list):
            raise TraceError(
                f"{where}: {name} should be a list of layer ids, found {_short(value)} (corrupt)"
            )
        for i, item in enumerate(value):
            expect_int(item, f"{name}[{i}]", where, low=-1)


def check_root_meta(meta: dict, where: str) -> None:
    check_finite_json(meta, "root attribute", where)
    engine = expect_dict(meta.get("engine", {}), "root attribute 'engine'", where)
    if "name" in engine and not isinstance(engine["name"], str):
        raise TraceError(f"{where}: engine name {_short(engine['name'])} is not a string (corrupt)")
    check_static(meta.get("static") or {}, where, "root attribute 'static'")
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


def check_rank_meta(meta: dict, where: str, rank: int | None = None) -> None:
    check_finite_json(meta, "rank attribute", where)
    commit = expect_dict(meta["commit"], "the commit record", where)
    close = commit.get("clean_close", False)
    if not isinstance(close, bool):
        raise TraceError(
            f"{where}: commit record 'clean_close' should be true or false, found "
            f"{type(close).__name__} {_short(close)} (corrupt)"
        )
    if commit.get("updated_ns") is not None:
        expect_count(commit["updated_ns"], "commit record 'updated_ns'", where)
    if "rank" in meta:
        expect_int(meta["rank"], "rank attribute 'rank'", where)
        if rank is not None and meta["rank"] != rank:
            raise TraceError(
                f"{where}: rank attribute 'rank' is {meta['rank']}, the group is rank{rank} "
                "(corrupt)"
            )
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
    check_static(meta.get("static") or {}, where, "rank attribute 'static'")
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


def check_row_shape(axis: str, column: str, shape: tuple, spec: dict, where: str) -> None:
    """The array's row shape is what the table declares for the column (`row_shape`)."""
    declared = spec.get("row_shape")
    if declared is None:
        return
    if not isinstance(declared, list) or any(
        isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in declared
    ):
        raise TraceError(
            f"{where}: column {axis}/{column} declares row_shape {_short(declared)}, not a list "
            "of sizes (corrupt)"
        )
    if list(shape[1:]) != declared:
        raise TraceError(
            f"{where}: column {axis}/{column} stores rows of shape {list(shape[1:])} but the "
            f"table declares {declared} (corrupt)"
        )


def check_slot_layout(
    axis: str, column: str, shape: tuple, attrs: dict, target: Any, where: str
) -> None:
    """The capture column (`aux_hidden`) is whole slots of the target's hidden size: its
    width a multiple of `slot_width`, which is the target's `hidden_size` where the audit names
    it. How many slots arrived is evidence, not layout: an engine that skipped fc hands the
    drafter one slot under three layer ids (replay names that fault), so only a width that is
    no whole number of slots is corrupt."""
    name = f"column {axis}/{column}"
    ids = attrs.get("layer_ids")
    if not isinstance(ids, list) or not ids:
        raise TraceError(
            f"{where}: {name} has layer_ids {_short(ids)}, not a list of layer ids (corrupt)"
        )
    for i, item in enumerate(ids):
        expect_int(item, f"{name} layer_ids[{i}]", where, low=-1)
    width = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    hidden = target.get("hidden_size") if isinstance(target, dict) else None
    hidden = hidden if isinstance(hidden, int) and not isinstance(hidden, bool) else None
    slot = attrs.get("slot_width")
    if slot is not None:
        expect_int(slot, f"{name} slot_width", where, low=1)
        if hidden is not None and hidden != slot:
            raise TraceError(
                f"{where}: {name} slot_width {slot} differs from the target's hidden_size "
                f"{hidden} (corrupt)"
            )
    unit = slot if slot is not None else hidden
    if unit is not None and width % unit:
        raise TraceError(
            f"{where}: {name} is {width} wide, not a whole number of slots of {unit} "
            f"(slot_width; {len(ids)} layer ids): aux width is not slots x hidden (corrupt)"
        )


def check_clean_close(
    committed_steps: int,
    steps: int,
    rows: dict[str, int],
    columns: dict[str, list[str]],
    off_axes: list[str],
    offsets: dict[str, np.ndarray],
    where: str,
) -> None:
    """A cleanly closed table: its steps, offsets and rows agree exactly."""
    if steps != committed_steps:
        raise TraceError(
            f"{where}: closed cleanly with {committed_steps} steps, but its offsets and rows "
            f"cover {steps} (offsets run past the rows or back: corrupt)"
        )
    for c in columns.get("step", []):
        n = rows.get(f"step/{c}", 0)
        if n != steps:
            raise TraceError(
                f"{where}: closed cleanly with {steps} steps, but column step/{c} has {n} "
                "committed rows (corrupt)"
            )
    if off_axes and steps > 0 and rows.get("offsets", 0) != steps + 1:
        raise TraceError(
            f"{where}: closed cleanly with {steps} steps, but the offsets have "
            f"{rows.get('offsets', 0)} committed rows, not {steps + 1} (corrupt)"
        )
    for axis in off_axes:
        off = offsets.get(axis)
        if off is None:
            continue
        end = int(off[steps]) if len(off) > steps else int(off[-1])
        for c in columns.get(axis, []):
            n = rows.get(f"{axis}/{c}", 0)
            if n != end:
                raise TraceError(
                    f"{where}: closed cleanly, but the offsets end at {axis} row {end} while "
                    f"column {axis}/{c} has {n} committed rows (offsets run past the rows or "
                    "back: corrupt)"
                )


def check_sequence(column: str, data: np.ndarray, first_row: int, where: str) -> None:
    """`step/seq` numbers a rank's steps in commit order: strictly increasing in a table."""
    flat = data.reshape(-1)
    if flat.size < 2:
        return
    bad = np.diff(flat) <= 0
    if np.any(bad):
        i = int(np.argmax(bad)) + 1
        kind = "repeats" if flat[i] == flat[i - 1] else "goes back to"
        raise TraceError(
            f"{where}: step/{column} {kind} {int(flat[i])} at step {first_row + i} (after "
            f"{int(flat[i - 1])}): step sequence numbers are duplicate or not increasing (corrupt)"
        )


def check_serving_ids(where: str, request: Any, cfg: Any) -> None:
    """Every id of one request that replay feeds a drafter with or maps through its d2t, in
    its vocabulary (`cfg`: the drafter's config): the committed tokens, the draft-extend and
    chain input ids (target vocabulary), the engine's draft ids (draft vocabulary). Needed
    where the trace's static audit names no vocabulary for the reader to check against."""
    check_token_ids(where, request.tokens, cfg.vocab_size)
    draft = getattr(request, "draft", None)
    if draft is not None:
        check_token_ids(where, draft.input_ids, cfg.vocab_size, "draft_extend input id")
        if draft.topk_draft_ids is not None:
            ids = np.asarray(draft.topk_draft_ids)
            check_token_ids(where, ids[ids >= 0], cfg.draft_vocab_size, "draft_extend draft id")
    for chain in getattr(request, "chains", None) or ():
        check_token_ids(where, chain.input_ids, cfg.vocab_size, "draft_step input id")
        ids = np.asarray(chain.topk_draft_ids)
        check_token_ids(where, ids[ids >= 0], cfg.draft_vocab_size, "draft_step draft id")
