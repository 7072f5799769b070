"""Reading a trace: read-only, lazy, and only ever the committed prefix.

Array shapes are capacities, not lengths (a killed writer leaves them ahead of the data), so
row counts come only from the rank's commit record, cross-checked against the offsets. Any
store that zarr cannot parse, or whose commit record disagrees with its arrays, is a
`TraceError` naming the path and what is wrong.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import zarr
from zarr.storage import LocalStore, ZipStore

from hstrace.errors import TraceError
from hstrace.trace.schema import (
    FORMAT_NAME,
    OFFSETS_ARRAY,
    OFFSETS_AXES_KEY,
    ROOT_KEY,
    SCALAR_STEP_COLUMNS,
    STEP_AXIS,
    SUPPORTED_SCHEMA_VERSIONS,
    column_array,
)


def open_trace(path: str | os.PathLike) -> Trace:
    return Trace(path)


class Trace:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise TraceError(f"{self.path}: no such trace")
        self._store: Any = None
        try:
            if self.path.is_dir():
                self._store = LocalStore(self.path, read_only=True)
            else:
                _check_zip(self.path)
                self._store = ZipStore(self.path, mode="r")
            self._root = zarr.open_group(self._store, mode="r", use_consolidated=False)
            attrs = dict(self._root.attrs)
        except TraceError:
            self.close()
            raise
        except Exception as exc:  # noqa: BLE001 - zarr raises many kinds for a bad store
            self.close()
            raise TraceError(
                f"{self.path}: not a readable Zarr v3 trace ({type(exc).__name__}: {exc})"
            ) from exc
        meta = attrs.get(ROOT_KEY)
        if not isinstance(meta, dict) or meta.get("format", FORMAT_NAME) != FORMAT_NAME:
            self.close()
            raise TraceError(f"{self.path}: not an hstrace trace (no '{ROOT_KEY}' root attributes)")
        version = meta.get("schema_version")
        if version not in SUPPORTED_SCHEMA_VERSIONS:
            self.close()
            raise TraceError(
                f"{self.path}: trace schema version {version!r} is not supported by this hstrace "
                f"(supported: {', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))})"
            )
        self.root_meta = meta
        try:
            names = [k for k, _ in self._root.groups()]
        except Exception as exc:  # noqa: BLE001
            self.close()
            raise TraceError(f"{self.path}: cannot list the rank groups ({exc})") from exc
        self.ranks: list[int] = sorted(
            int(n[4:]) for n in names if n.startswith("rank") and n[4:].isdigit()
        )
        self._ranks: dict[int, RankView] = {}

    @property
    def meta(self) -> dict[str, Any]:
        """Root metadata; `static` merges the root's audit with each rank's (lower ranks win)."""
        meta = dict(self.root_meta)
        static = dict(meta.get("static") or {})
        for r in self.ranks:
            for k, v in self.rank(r).static.items():
                static.setdefault(k, v)
        meta["static"] = static
        return meta

    def rank(self, r: int) -> RankView:
        if r not in self._ranks:
            if r not in self.ranks:
                raise TraceError(f"{self.path}: no rank {r} (ranks: {self.ranks})")
            self._ranks[r] = RankView(self, r)
        return self._ranks[r]

    def close(self) -> None:
        if isinstance(self._store, ZipStore):
            self._store.close()
        self._store = None

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_zip(path: Path) -> None:
    """A readable zip whose member names stay inside the archive (nothing is extracted)."""
    if not zipfile.is_zipfile(path):
        raise TraceError(
            f"{path}: neither a trace directory nor a zip file (truncated or corrupt?)"
        )
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except (zipfile.BadZipFile, OSError) as exc:
        raise TraceError(f"{path}: corrupt zip ({exc})") from exc
    for name in names:
        p = PurePosixPath(name)
        if p.is_absolute() or ".." in p.parts or "\\" in name:
            raise TraceError(
                f"{path}: zip member {name!r} points outside the archive; refusing to read it"
            )
    # Zip bombs (total size, inflation ratio), duplicate names, symlinks: judged from the
    # central directory before zarr decompresses anything (bundle room, hstrace.bundle.safezip).
    from hstrace.bundle.safezip import check_zip

    check_zip(path)


class RankView:
    def __init__(self, trace: Trace, rank: int) -> None:
        self.trace = trace
        self.rank = rank
        where = f"{trace.path}: rank{rank}"
        try:
            self._group = trace._root[f"rank{rank}"]
            meta = dict(self._group.attrs).get(ROOT_KEY)
        except Exception as exc:  # noqa: BLE001
            raise TraceError(f"{where}: unreadable group metadata ({exc})") from exc
        if not isinstance(meta, dict) or not isinstance(meta.get("commit"), dict):
            raise TraceError(f"{where}: no commit record (not written by hstrace, or corrupt)")
        self.meta = meta
        commit = meta["commit"]
        self.clean_close: bool = bool(commit.get("clean_close", False))
        self.dropped_steps: dict[str, int] = dict(commit.get("dropped_steps") or {})
        self.errors: list[dict] = list(meta.get("errors") or [])
        self.static: dict[str, Any] = dict(meta.get("static") or {})
        self._commit_tables: dict[str, dict] = dict(commit.get("tables") or {})
        self.tables: list[str] = sorted(self._commit_tables)
        self._views: dict[str, TableView] = {}

    def table(self, name: str) -> TableView | None:
        if name not in self._commit_tables:
            return None
        if name not in self._views:
            self._views[name] = TableView(self, name, self._commit_tables[name])
        return self._views[name]


class TableView:
    def __init__(self, rank: RankView, name: str, commit: dict) -> None:
        self.name = name
        self._where = f"{rank.trace.path}: rank{rank.rank}/{name}"
        try:
            self._group = rank._group[name]
            tmeta = dict(self._group.attrs)[ROOT_KEY]
            self.axes: list[str] = list(tmeta["axes"])
            self.columns: dict[str, list[str]] = {a: list(c) for a, c in tmeta["columns"].items()}
            self._arrays = {
                (a, c): self._group[column_array(a, c)]
                for a, cols in self.columns.items()
                for c in cols
            }
            off_axes = [a for a in self.axes if a != STEP_AXIS]
            off_arr = self._group[OFFSETS_ARRAY] if off_axes else None
            rows = {k: int(v) for k, v in commit["rows"].items()}
            steps = int(commit["steps"])
        except TraceError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise TraceError(
                f"{self._where}: table metadata is missing or corrupt ({type(exc).__name__}: {exc})"
            ) from exc
        if off_arr is not None:
            stored_axes = dict(off_arr.attrs).get(OFFSETS_AXES_KEY)
            if off_arr.ndim != 2 or stored_axes is None or sorted(stored_axes) != sorted(off_axes):
                raise TraceError(
                    f"{self._where}: offsets array {list(off_arr.shape)} with axes {stored_axes!r} "
                    f"does not match the table's axes {off_axes} (corrupt)"
                )
            off_axes = list(stored_axes)
        self._logical = {}
        for key, arr in self._arrays.items():
            committed = rows.get(f"{key[0]}/{key[1]}", 0)
            if arr.shape[0] < committed:
                raise TraceError(
                    f"{self._where}: column {key[0]}/{key[1]} holds {arr.shape[0]} rows, commit record says {committed}"
                )
            self._logical[key] = dict(arr.attrs).get("hstrace_dtype", str(arr.dtype))
            if key[0] == STEP_AXIS and key[1] in SCALAR_STEP_COLUMNS and arr.ndim != 1:
                raise TraceError(
                    f"{self._where}: column step/{key[1]} has shape {arr.shape}; schema v1 stores "
                    "one scalar per step (a producer bug: re-record with a fixed producer)"
                )
            if key[0] == STEP_AXIS:
                steps = min(steps, committed)
        if off_arr is not None:
            steps = min(steps, rows.get(OFFSETS_ARRAY, 0) - 1)
        steps = max(steps, 0)
        self._offsets: dict[str, np.ndarray] = {}
        # A writer killed before its first commit of data has not even the leading 0 on disk:
        # that is an empty table, not a corrupt one.
        table = np.zeros((1, len(off_axes)), np.int64)
        if off_arr is not None and steps > 0:
            table = self._read(off_arr, 0, steps + 1, OFFSETS_ARRAY)
            if (
                table.shape != (steps + 1, len(off_axes))
                or np.any(table[0] != 0)
                or np.any(np.diff(table, axis=0) < 0)
            ):
                raise TraceError(
                    f"{self._where}: the offsets array is not a valid CSR index (corrupt)"
                )
        for i, axis in enumerate(off_axes):
            off = np.ascontiguousarray(table[:, i])
            limit = min(
                (rows.get(f"{axis}/{c}", 0) for c in self.columns.get(axis, [])),
                default=int(off[-1]),
            )
            if off[-1] > limit:  # the commit record covers fewer rows than its steps: trust rows
                steps = int(np.searchsorted(off, limit, side="right")) - 1
            self._offsets[axis] = off
        self.num_steps: int = steps
        self._offsets = {a: o[: steps + 1] for a, o in self._offsets.items()}

    def _read(self, arr: zarr.Array, start: int, stop: int, what: str) -> np.ndarray:
        try:
            return np.asarray(arr[start:stop])
        except Exception as exc:  # noqa: BLE001 - codec / IO errors mean a corrupt store
            raise TraceError(
                f"{self._where}: cannot read {what} rows {start}:{stop} ({type(exc).__name__}: {exc})"
            ) from exc

    def offsets(self, axis: str) -> np.ndarray:
        if axis == STEP_AXIS:
            return np.arange(self.num_steps + 1, dtype=np.int64)
        if axis not in self._offsets:
            raise TraceError(f"{self._where}: no axis {axis!r} (axes: {self.axes})")
        return self._offsets[axis]

    def num_rows(self, axis: str) -> int:
        return int(self.offsets(axis)[-1])

    def column_attrs(self, axis: str, column: str) -> dict[str, Any]:
        """A column's attributes (`hstrace_dtype`, and producer-given ones like `layer_ids`)."""
        if (axis, column) not in self._arrays:
            raise TraceError(f"{self._where}: no column {axis}/{column} (columns: {self.columns})")
        return dict(self._arrays[(axis, column)].attrs)

    def logical_dtype(self, axis: str, column: str) -> str:
        return self._logical[(axis, column)]

    def column(
        self, axis: str, name: str, start: int | None = None, stop: int | None = None
    ) -> Any:
        """Committed rows [start, stop) of a column: numpy, or torch.bfloat16 for bf16 columns."""
        if (axis, name) not in self._arrays:
            raise TraceError(f"{self._where}: no column {axis}/{name} (columns: {self.columns})")
        n = self.num_rows(axis)
        lo, hi, _ = slice(start, stop).indices(n)
        data = self._read(self._arrays[(axis, name)], lo, max(lo, hi), f"{axis}/{name}")
        if self._logical[(axis, name)] == "bfloat16":
            import torch

            return torch.from_numpy(np.ascontiguousarray(data)).view(torch.bfloat16)
        return data

    def step(self, s: int) -> dict[str, dict[str, Any]]:
        if not 0 <= s < self.num_steps:
            raise TraceError(
                f"{self._where}: step {s} is outside the {self.num_steps} committed steps"
            )
        out: dict[str, dict[str, Any]] = {}
        for axis, cols in self.columns.items():
            off = self.offsets(axis)
            out[axis] = {c: self.column(axis, c, int(off[s]), int(off[s + 1])) for c in cols}
        return out
