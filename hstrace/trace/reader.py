"""Reading a trace: read-only, lazy, and only ever the committed prefix.

Array shapes are capacities, not lengths (a killed writer leaves them ahead of the data), so
row counts come only from the rank's commit record, cross-checked against the offsets. Any
store that zarr cannot parse, or whose commit record disagrees with its arrays, is a
`TraceError` naming the path and what is wrong.
"""

from __future__ import annotations

import os
import warnings
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import zarr
from zarr.storage import LocalStore, ZipStore

from hstrace.errors import TraceError
from hstrace.trace import chunkread
from hstrace.trace import validate as v
from hstrace.trace.guard import GuardedStore, array_rule
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
        if self.path.is_dir() and not os.path.lexists(self.path / "zarr.json"):
            # Say what it is not in the user's terms, not zarr's ("No group found in store").
            raise TraceError(
                f"{self.path}: not a trace: a directory without zarr.json (a trace is the "
                "directory `hstrace record --out` made, or a bundle .zip)"
            )
        # HSTRACE_PLANES / HSTRACE_PREFETCH, as this reader is built (chunkread's fast path)
        self.read_flags = chunkread.ReadFlags.from_env()
        self._store: Any = None
        try:
            # Every read goes through the guard: no link leaving the store, no endless or
            # huge metadata, no missing or oversized chunk (hstrace/trace/guard.py).
            if self.path.is_dir():
                self._store = GuardedStore(
                    LocalStore(self.path, read_only=True), str(self.path), root=self.path
                )
            else:
                _check_zip(self.path)
                self._store = GuardedStore(
                    ZipStore(self.path, mode="r"), str(self.path), zip_path=self.path
                )
            self._root = zarr.open_group(
                self._store, mode="r", use_consolidated=False, zarr_format=3
            )
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
        try:
            # `true` is a Python int equal to 1: the type is checked, not only the value.
            v.check_schema_version(
                meta.get("schema_version"), SUPPORTED_SCHEMA_VERSIONS, str(self.path)
            )
            v.check_root_meta(meta, str(self.path))
        except TraceError:
            self.close()
            raise
        self.root_meta = meta
        try:
            # A stray file in the store (a note, a bundle's extra) is not ours to warn about.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                members = list(self._root.members())
        except TraceError:
            self.close()
            raise
        except Exception as exc:  # noqa: BLE001
            self.close()
            raise TraceError(f"{self.path}: cannot list the rank groups ({exc})") from exc
        names = []
        for name, node in members:
            if not (name.startswith("rank") and name[4:].isdigit()):
                continue
            if not isinstance(node, zarr.Group):
                self.close()
                raise TraceError(
                    f"{self.path}: {name} is an array, not a rank group (corrupt trace)"
                )
            names.append(name)
        unlisted = _unlisted_rank_groups(self.path, names)
        if unlisted:
            self.close()
            raise TraceError(
                f"{self.path}: {unlisted[0]} has no readable group metadata "
                f"({unlisted[0]}/zarr.json is a broken link or not a file; corrupt trace)"
            )
        self.ranks: list[int] = sorted(int(n[4:]) for n in names)
        self._ranks: dict[int, RankView] = {}

    @property
    def meta(self) -> dict[str, Any]:
        """Root metadata; `static` merges the root's audit with each rank's (lower ranks win)."""
        meta = dict(self.root_meta)
        static = dict(meta.get("static") or {})
        for r in self.ranks:
            for k, item in self.rank(r).static.items():
                static.setdefault(k, item)
        meta["static"] = static
        return meta

    def rank(self, r: int) -> RankView:
        if r not in self._ranks:
            if r not in self.ranks:
                raise TraceError(f"{self.path}: no rank {r} (ranks: {self.ranks})")
            self._ranks[r] = RankView(self, r)
        return self._ranks[r]

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
        self._store = None

    @property
    def ids_redacted(self) -> bool:
        """Token ids are salted hashes (a bundle made with `--redact ids`): no vocab checks."""
        bundle = (self.root_meta.get("static") or {}).get("bundle") or {}
        red = bundle.get("redaction") if isinstance(bundle, dict) else None
        return isinstance(red, dict) and "ids" in (red.get("modes") or ())

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unlisted_rank_groups(path: Path, listed: list[str]) -> list[str]:
    """Rank directories of a directory trace that zarr did not list as groups although their
    `zarr.json` is there: a link that does not resolve to a file (a symlink loop, a dangling
    link) or not a regular file. Without this they read as "ranks: none". A rank directory
    with no `zarr.json` at all is a writer's claim (recorder.py) whose group is not written
    yet, which a reader of a trace still recording may see: not a rank yet."""
    if not path.is_dir():
        return []
    try:
        unlisted = []
        with os.scandir(path) as entries:
            rank_dirs = [e for e in entries if e.name.startswith("rank") and e.name[4:].isdigit()]
        for e in rank_dirs:
            meta = os.path.join(e.path, "zarr.json")
            if e.name not in listed and e.is_dir() and os.path.lexists(meta):
                if not os.path.isfile(meta):
                    unlisted.append(e.name)
    except OSError as exc:
        raise TraceError(f"{path}: cannot list the rank groups ({exc.strerror})") from exc
    return sorted(unlisted)


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
    # central directory before zarr decompresses anything (hstrace.trace.safezip).
    from hstrace.trace.safezip import check_zip

    check_zip(path)


def _attrs(node: Any, where: str, what: str) -> dict[str, Any]:
    """A node's attributes as a dict; TraceError when its metadata holds something else."""
    try:
        attrs = node.metadata.attributes
        if not isinstance(attrs, dict):
            raise TypeError(type(attrs).__name__)
        return dict(attrs)
    except Exception as exc:  # noqa: BLE001 - zarr keeps whatever JSON the file held
        raise TraceError(
            f"{where}: attributes of {what} are not a JSON object (corrupt metadata)"
        ) from exc


class RankView:
    def __init__(self, trace: Trace, rank: int) -> None:
        self.trace = trace
        self.rank = rank
        where = f"{trace.path}: rank{rank}"
        try:
            self._group = trace._root[f"rank{rank}"]
            meta = dict(self._group.attrs).get(ROOT_KEY)
        except TraceError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise TraceError(f"{where}: unreadable group metadata ({exc})") from exc
        if not isinstance(self._group, zarr.Group):
            raise TraceError(f"{where}: is an array, not a rank group (corrupt trace)")
        if not isinstance(meta, dict) or "commit" not in meta:
            raise TraceError(f"{where}: no commit record (not written by hstrace, or corrupt)")
        v.check_rank_meta(meta, where, rank)
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
            vocab, draft = (None, None)
            if not self.trace.ids_redacted:
                vocab, draft = v.static_vocab(self.trace.meta.get("static") or {})
            self._views[name] = TableView(self, name, self._commit_tables[name], vocab, draft)
        return self._views[name]


class TableView:
    def __init__(
        self,
        rank: RankView,
        name: str,
        commit: dict,
        vocab: int | None = None,
        draft_vocab: int | None = None,
    ) -> None:
        self.name = name
        self._where = f"{rank.trace.path}: rank{rank.rank}/{name}"
        self._read_flags = rank.trace.read_flags
        # Token ids are checked against these where known (the trace's static audit).
        self._vocab, self._draft_vocab = vocab, draft_vocab
        self._check_ids = not rank.trace.ids_redacted
        self._req_checked = False
        try:
            self._group = rank._group[name]
            if not isinstance(self._group, zarr.Group):
                raise TraceError(f"{self._where}: is an array, not a table group (corrupt)")
            self.axes, spec = v.check_table_meta(dict(self._group.attrs).get(ROOT_KEY), self._where)
            self._spec = spec
            self.columns: dict[str, list[str]] = {a: list(c) for a, c in spec.items()}
            self._arrays = {
                (a, c): self._group[column_array(a, c)]
                for a, cols in self.columns.items()
                for c in cols
            }
            off_axes = [a for a in self.axes if a != STEP_AXIS]
            off_arr = self._group[OFFSETS_ARRAY] if off_axes else None
            for key, arr in [*self._arrays.items(), ((OFFSETS_ARRAY, ""), off_arr)]:
                if arr is not None and not isinstance(arr, zarr.Array):
                    raise TraceError(
                        f"{self._where}: {'/'.join(key).rstrip('/')} is a group, not an array "
                        "(corrupt)"
                    )
            rows = {k: int(n) for k, n in commit["rows"].items()}
            steps = committed_steps = int(commit["steps"])
        except TraceError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise TraceError(
                f"{self._where}: table metadata is missing or corrupt ({type(exc).__name__}: {exc})"
            ) from exc
        if off_arr is not None and str(off_arr.dtype) != "int64":
            raise TraceError(
                f"{self._where}: the offsets array is {off_arr.dtype}, schema v1 stores int64 "
                "(corrupt)"
            )
        if off_arr is not None:
            stored_axes = _attrs(off_arr, self._where, OFFSETS_ARRAY).get(OFFSETS_AXES_KEY)
            if (
                off_arr.ndim != 2
                or not isinstance(stored_axes, list)
                or not all(isinstance(a, str) for a in stored_axes)
                or sorted(stored_axes) != sorted(off_axes)
            ):
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
            self._logical[key] = _attrs(arr, self._where, "/".join(key)).get(
                "hstrace_dtype", str(arr.dtype)
            )
            if not isinstance(self._logical[key], str):
                raise TraceError(
                    f"{self._where}: column {key[0]}/{key[1]} has hstrace_dtype "
                    f"{self._logical[key]!r}, not a dtype name (corrupt)"
                )
            v.check_dtype(
                key[0],
                key[1],
                str(arr.dtype),
                self._spec[key[0]][key[1]],
                self._logical[key],
                self._where,
            )
            if key[0] == STEP_AXIS and key[1] in SCALAR_STEP_COLUMNS and arr.ndim != 1:
                raise TraceError(
                    f"{self._where}: column step/{key[1]} has shape {arr.shape}; schema v1 stores "
                    "one scalar per step (a producer bug: re-record with a fixed producer)"
                )
            v.check_row_shape(key[0], key[1], arr.shape, self._spec[key[0]][key[1]], self._where)
            if key[0] == STEP_AXIS:
                steps = min(steps, committed)
            # The capture column (a redacted bundle keeps its attributes on a stats column,
            # `aux_hidden_stats`, of another width).
            attrs = _attrs(arr, self._where, "/".join(key)) if key[1] == "aux_hidden" else {}
            if "layer_ids" in attrs:
                target = (rank.trace.root_meta.get("static") or {}).get("target")
                v.check_slot_layout(key[0], key[1], arr.shape, attrs, target, self._where)
        if off_arr is not None:
            steps = min(steps, rows.get(OFFSETS_ARRAY, 0) - 1)
        steps = max(steps, 0)
        for key, arr in [*self._arrays.items(), ((OFFSETS_ARRAY, ""), off_arr)]:
            if arr is None:
                continue
            label = OFFSETS_ARRAY if key[0] == OFFSETS_ARRAY else f"{key[0]}/{key[1]}"
            # Before any data is read: which chunks must exist and how big they may be.
            rank.trace._store.register(array_rule(label, arr, rows.get(label, 0), arr.path))
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
        if rank.clean_close:
            # Lowering the step count to what the rows cover is crash recovery (a writer killed
            # between a column's flush and the commit). A clean close committed every row: there,
            # any disagreement between steps, offsets and rows is corruption, not a crash.
            v.check_clean_close(
                committed_steps, steps, rows, self.columns, off_axes, self._offsets, self._where
            )
        self.num_steps: int = steps
        self._offsets = {a: o[: steps + 1] for a, o in self._offsets.items()}
        # The step sequence numbers (8 bytes a step), read and checked once at open: every
        # command then sees a table whose steps are in order, whether it reads them or not.
        self._seq: np.ndarray | None = None
        seq_arr = self._arrays.get((STEP_AXIS, "seq"))
        if seq_arr is not None and steps > 0 and seq_arr.ndim == 1:
            seq = self._read(seq_arr, 0, steps, "step/seq")
            self._validate(STEP_AXIS, "seq", seq, 0, steps)
            self._seq = seq

    def _read(self, arr: zarr.Array, start: int, stop: int, what: str) -> np.ndarray:
        try:
            # hstrace's own layout straight from its files (several times zarr's speed); None:
            # another layout or a zip, which zarr reads (writer room, bench/README.md).
            rows = chunkread.read_rows(arr, start, stop, self._read_flags)
            if rows is not None:
                return rows
            return np.asarray(arr[start:stop])
        except TraceError:
            raise
        except MemoryError as exc:
            raise TraceError(
                f"{self._where}: reading {what} rows {start}:{stop} needs more memory than is "
                "available"
            ) from exc
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
        return _attrs(self._arrays[(axis, column)], self._where, f"{axis}/{column}")

    def read_unit(self, axis: str, column: str) -> int:
        """Rows per stored chunk of a column: rows of one chunk are decoded together (rows.py)."""
        return int(self._arrays[(axis, column)].chunks[0])

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
        if (axis, name) == (STEP_AXIS, "seq") and self._seq is not None:
            return self._seq[lo : max(lo, hi)].copy()  # read and checked at open
        data = self._read(self._arrays[(axis, name)], lo, max(lo, hi), f"{axis}/{name}")
        self._validate(axis, name, data, lo, n)
        if self._logical[(axis, name)] == "bfloat16":
            import torch

            return torch.from_numpy(np.ascontiguousarray(data)).view(torch.bfloat16)
        return data

    def _validate(self, axis: str, name: str, data: np.ndarray, lo: int, n: int) -> None:
        """Range checks on the rows just read (hstrace/trace/validate.py): token ids, counts,
        and, on a whole-column read, counts against the offsets."""
        key = (axis, name)
        if data.size == 0 or data.dtype.kind not in "iu":
            return
        if self._check_ids or key not in v.TARGET_ID_COLUMNS | v.DRAFT_ID_COLUMNS:
            v.check_values(axis, name, data, lo, self._where, self._vocab, self._draft_vocab)
        if key == (STEP_AXIS, "seq"):
            v.check_sequence(name, data, lo, self._where)
        bound = v.BOUNDED_BY.get(key)
        if bound is not None and (axis, bound) in self._arrays:
            limit = self._read(self._arrays[(axis, bound)], lo, lo + len(data), f"{axis}/{bound}")
            v.check_bounded(axis, name, data, bound, limit, lo, self._where)
        if axis == "req" and lo == 0 and len(data) == n and not self._req_checked:
            self._check_req_counts()

    def _check_req_counts(self) -> None:
        """Once per table, on its first whole read of a `req` column: every count column of
        the axis (one row per request: small) sums, per step, to the rows it counts."""
        self._req_checked = True
        n = self.num_rows("req")
        for col in self.columns.get("req", []):
            counted = v.COUNTS_OF.get(col)
            if counted not in self._offsets:
                continue
            data = self._read(self._arrays[("req", col)], 0, n, f"req/{col}")
            v.check_values("req", col, data, 0, self._where, None, None)
            v.check_counts_match(
                col, data, self._offsets["req"], self._offsets[counted], counted, self._where
            )
            for (_, bounded), bound in v.BOUNDED_BY.items():
                if bound == col and bounded in self.columns["req"]:
                    other = self._read(self._arrays[("req", bounded)], 0, n, f"req/{bounded}")
                    v.check_bounded("req", bounded, other, col, data, 0, self._where)

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
