"""Schema v1 of a trace: names, versions, tables and their axes, storage rules.

The store layout (documented for users in docs/trace-format.md):

    <root>/zarr.json                attrs["hstrace"] = run metadata (ROOT_KEY)
    <root>/rank{r}/zarr.json        attrs["hstrace"] = rank metadata and the commit record
    <root>/rank{r}/<table>/offsets          int64 [S+1, A] CSR offsets, one column per non-step
                                            axis (attrs["axes"] names them, in order)
    <root>/rank{r}/<table>/<axis>.<column>  flat row-major array, one row per axis row

Flat on purpose: every group and array costs a zarr.json and every array at least one data
file, so no per-axis subgroups and one offsets array per table (bench/README.md, files).
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = (1,)
FORMAT_NAME = "hstrace-trace"
# Attribute key under which hstrace keeps its metadata, at the root and in each rank group.
ROOT_KEY = "hstrace"

# The axis with one row per event; it needs no offsets (step s is row s).
STEP_AXIS = "step"
# The axis with one row per request in an event.
REQ_AXIS = "req"
# A table's CSR offsets array: int64 [S+1, len(axes)], its attribute OFFSETS_AXES_KEY lists
# the non-step axes in column order.
OFFSETS_ARRAY = "offsets"
OFFSETS_AXES_KEY = "axes"

# Tables of schema v1 and their axes (docs/internal-api.md). Producers may add tables; these
# are the ones readers can rely on. Columns are fixed by each trace's first write.
V1_TABLES: dict[str, tuple[str, ...]] = {
    "target": ("step", "req", "tok"),
    "draft_extend": ("step", "req", "tok"),
    "draft_step": ("step", "req", "tok"),
    "verify": ("step", "req", "proposed", "accepted"),
    "requests": ("step", "req", "tok", "rid"),
}

# (table, axis) -> the req-axis column counting that axis' rows per request: which rows of
# each axis a request owns (bundle subsets, diff streams and replay's request blocks read it).
REQUEST_ROW_COUNTS: dict[tuple[str, str], str] = {
    ("target", "tok"): "n_tok",
    ("draft_extend", "tok"): "n_tok",
    ("draft_step", "tok"): "n_tok",
    ("verify", "proposed"): "n_proposed",
    ("verify", "accepted"): "n_accepted",
    ("requests", "tok"): "n_prompt",
    ("requests", "rid"): "rid_len",
}

# The `requests` table's optional per-request metadata (docs/trace-format.md, "Request
# metadata"): the sampling parameters as the engine resolved them. Real-valued ones are NaN
# when unknown, the others -1 (not set); float64 and int64.
SAMPLING_FLOAT = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)
SAMPLING_INT = ("top_k", "seed", "max_tokens")
SAMPLING_COLUMNS = (*SAMPLING_FLOAT, *SAMPLING_INT)
SAMPLING_UNSET = -1
# A request's penalties when none is in force (the engines' SamplingParams defaults): what a
# verify's rule used then (`verify.req.*_penalty`), and what the replay reads them as.
NO_PENALTY = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}

# Step-axis columns the writer fills in when the producer does not give them.
AUTO_STEP_COLUMNS = ("seq", "t_ns")
# Step-axis columns of schema v1 that hold one scalar per step (a 1-element list is accepted
# and stored as that scalar; anything wider is refused by the writer and the reader).
SCALAR_STEP_COLUMNS = (*AUTO_STEP_COLUMNS, "mode", "step_index")

# `target.mode` values.
MODE_PREFILL = 0
MODE_VERIFY = 1

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Chunk and shard sizing (reference/trace-storage.md §3-4): ~4 MiB chunks, whole-shard
# writes of up to ~128 MiB for wide rows (hidden states, full logits), plain chunks otherwise.
# 128 rather than 64 MiB halves the shard files (the ≤60 files per 1000 steps target); the
# price is the writer's RAM: it stages one whole shard per wide column (bench/README.md).
CHUNK_TARGET_BYTES = 4 << 20
SHARD_TARGET_BYTES = 128 << 20
MAX_CHUNK_ROWS = 65536
SHARD_MIN_ROW_BYTES = 16 << 10


def check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{kind} name {name!r} must be an identifier (letters, digits, _)")
    return name


def column_array(axis: str, column: str) -> str:
    """Name of a column's array inside its table group: `<axis>.<column>` (no subgroups)."""
    return f"{axis}.{column}"


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def unit_rows(row_bytes: int) -> tuple[int, int | None]:
    """(chunk_rows, shard_rows or None) for a column whose rows are `row_bytes` wide."""
    row_bytes = max(1, row_bytes)
    chunk = min(MAX_CHUNK_ROWS, _pow2_floor(CHUNK_TARGET_BYTES // row_bytes))
    if row_bytes < SHARD_MIN_ROW_BYTES:
        return chunk, None
    shard = _pow2_floor(SHARD_TARGET_BYTES // row_bytes)
    return (chunk, shard) if shard >= 2 * chunk else (chunk, None)


def request_key(rid: str) -> int:
    """Stable 63-bit key of an engine request id (first 8 bytes of blake2b, top bit cleared),
    so it fits a non-negative int64 and is the same in every process and Python version."""
    digest = hashlib.blake2b(rid.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def storage_dtype(logical: str) -> np.dtype:
    """The numpy dtype a logical dtype is stored as (bf16 travels as its uint16 bits)."""
    if logical == "bfloat16":
        return np.dtype(np.uint16)
    return np.dtype(logical)
