"""The one schema check of a step's columns, shared by the producer (`TraceWriter`) and the
recorder underneath it (`RankRecorder`): the column spec of a step, its row counts per axis,
and how a spec is named in an error.

Imports no torch (the writer process uses it): a tensor is read through its `dtype` and
`shape` only, bf16 is stored as its uint16 bits.
"""

from __future__ import annotations

from typing import Any

from hstrace.errors import TraceError
from hstrace.trace.schema import STEP_AXIS, check_name

# {axis: {column: (storage dtype name, logical dtype name, row_shape)}}, in write order.
ColumnSpec = dict[str, dict[str, tuple[str, str, tuple[int, ...]]]]
# {axis: {column: rows on dim 0}}: numpy arrays, or tensors on CUDA.
AxisRows = dict[str, dict[str, Any]]


def storage_of(a: Any) -> tuple[str, str]:
    """(storage dtype name, logical dtype name) of a numpy array or a torch tensor."""
    name = str(a.dtype).removeprefix("torch.")
    if name == "bfloat16":
        return "uint16", "bfloat16"
    return name, name


def spec_of(axis_rows: AxisRows, logical: dict[str, str] | None = None) -> ColumnSpec:
    """The spec of one step's rows; `logical` names the logical dtype of a column where it
    differs from its storage dtype ({"axis/column": "bfloat16"} for bf16 stored as uint16)."""
    logical = logical or {}
    spec: ColumnSpec = {}
    for axis, cols in axis_rows.items():
        spec[axis] = {}
        for c, a in cols.items():
            storage, ld = storage_of(a)
            spec[axis][c] = (
                storage,
                logical.get(f"{axis}/{c}", ld),
                tuple(int(x) for x in a.shape[1:]),
            )
    return spec


def row_counts(table: str, axis_rows: AxisRows) -> dict[str, int]:
    """Rows per axis of one step: every column of an axis has the same rows, the step axis one."""
    counts: dict[str, int] = {}
    for axis, cols in axis_rows.items():
        lens = {c: int(a.shape[0]) for c, a in cols.items()}
        if len(set(lens.values())) > 1:
            raise TraceError(
                f"table {table!r}: columns on axis {axis!r} have different row counts {lens}"
            )
        counts[axis] = next(iter(lens.values()), 0)
    if counts.get(STEP_AXIS) != 1:
        raise TraceError(
            f"table {table!r}: a step has exactly one row on the '{STEP_AXIS}' axis, "
            f"got {counts.get(STEP_AXIS)}"
        )
    return counts


def check_names(table: str, spec: ColumnSpec) -> None:
    """Table, axis and column names are identifiers (they become store keys)."""
    check_name("table", table)
    for axis, cols in spec.items():
        check_name("axis", axis)
        for col in cols:
            check_name("column", col)


def describe(spec: ColumnSpec) -> str:
    """`{axis/column:logical[row_shape], ...}`, as errors name a table's columns."""
    return (
        "{"
        + ", ".join(
            f"{a}/{c}:{ld}{list(rs)}" for a, cols in spec.items() for c, (_, ld, rs) in cols.items()
        )
        + "}"
    )
