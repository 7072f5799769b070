"""A trace-store conformance suite any producer can run against its own traces.

As zarr-python ships its store tests for store authors, hstrace ships these checks for trace
producers (a vLLM fork, TensorRT-LLM, your own engine, hstrace's own writers)::

    from hstrace.testing import ProducedTrace, StoreConformance, record_writes

    class TestMyEngineTrace(StoreConformance):
        def make_trace(self, tmp_path):
            path = tmp_path / "run.zarr"
            with record_writes() as log:       # keeps a copy of every TraceWriter.write
                run_my_engine(path)
            return ProducedTrace(path, written=log.only())

pytest then runs every `test_*` method below on that trace (made once per class). Each is a
plain function too (`check_schema(path)`, ...), raising `ConformanceError` (an
AssertionError) that names the rank, table, column and row that is wrong.

What is checked, against docs/trace-format.md, with plain zarr where the format promises it:
the schema attributes (root, ranks, tables, columns), every table's CSR offsets and count
columns against the commit record, the committed prefix (hstrace's reader sees exactly the
committed rows; shapes trimmed on a clean close), a bit-exact round trip of what the producer
wrote (bf16 as its bits, NaN payloads included), the same values through plain zarr, one
`TraceError` line (never another exception) for a corrupted chunk, and `hstrace show`'s summary.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hstrace.errors import TraceError
from hstrace.trace.schema import (
    FORMAT_NAME,
    OFFSETS_ARRAY,
    OFFSETS_AXES_KEY,
    REQUEST_ROW_COUNTS,
    ROOT_KEY,
    STEP_AXIS,
    SUPPORTED_SCHEMA_VERSIONS,
    column_array,
)

# rank -> table -> steps in write order -> axis -> column -> (logical dtype, rows as numpy)
Written = dict[int, dict[str, list[dict[str, dict[str, tuple[str, np.ndarray]]]]]]


class ConformanceError(AssertionError):
    """A trace is not what docs/trace-format.md says; the message names where."""


@dataclass
class ProducedTrace:
    """What `make_trace` returns: the trace (a directory store or a zip of one) and, when the
    producer knows it, what it wrote (`record_writes().only()`), for the round trip."""

    path: Path
    written: Written | None = None
    clean_close: bool = True  # the producer closed every writer (shapes are then trimmed)


# --- recording what a producer wrote ---------------------------------------------------------


def _snapshot(value: Any) -> tuple[str, np.ndarray]:
    """A copy of one column as the producer handed it (it may reuse its buffers)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - hstrace's writer needs torch anyway
        torch = None
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        if t.dtype == torch.bfloat16:
            return "bfloat16", t.contiguous().view(torch.int16).numpy().copy()
        return str(t.dtype).removeprefix("torch."), t.numpy().copy()
    a = np.array(value, copy=True)
    return str(a.dtype), a


@dataclass
class WriteLog:
    """Every `TraceWriter.write` made while `record_writes()` was active, that was kept."""

    by_path: dict[str, Written] = field(default_factory=dict)

    def add(self, path: str, rank: int, table: str, axes: dict[str, dict[str, Any] | None]) -> None:
        step = {
            axis: {c: _snapshot(v) for c, v in cols.items()}
            for axis, cols in axes.items()
            if cols is not None
        }
        self.by_path.setdefault(path, {}).setdefault(rank, {}).setdefault(table, []).append(step)

    def only(self) -> Written:
        """What was written, when all of it went to one trace (the usual case)."""
        if len(self.by_path) != 1:
            raise ConformanceError(
                f"writes went to {len(self.by_path)} traces ({sorted(self.by_path)}); use "
                "by_path[path]"
            )
        return next(iter(self.by_path.values()))


@contextlib.contextmanager
def record_writes() -> Iterator[WriteLog]:
    """Wrap `TraceWriter.write` (every writer, any sink) to keep a copy of each kept step."""
    from hstrace.trace import TraceWriter

    log = WriteLog()
    original = TraceWriter.write

    def write(self, table, step=None, req=None, tok=None, column_attrs=None, **other_axes):
        kept = original(self, table, step, req, tok, column_attrs, **other_axes)
        if kept:
            log.add(
                str(Path(self.path).resolve()),
                self.rank,
                table,
                {STEP_AXIS: step, "req": req, "tok": tok, **other_axes},
            )
        return kept

    TraceWriter.write = write
    try:
        yield log
    finally:
        TraceWriter.write = original


# --- opening a store with plain zarr ----------------------------------------------------------


@contextlib.contextmanager
def _plain(path: Path) -> Iterator[Any]:
    """The root group through zarr alone (no hstrace code), as a third party reads it."""
    import zarr
    from zarr.storage import ZipStore

    store = None
    try:
        if path.is_dir():
            root = zarr.open_group(str(path), mode="r", use_consolidated=False, zarr_format=3)
        else:
            store = ZipStore(path, mode="r")
            root = zarr.open_group(store, mode="r", use_consolidated=False, zarr_format=3)
        yield root
    except ConformanceError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever zarr raises, it is not readable
        raise ConformanceError(
            f"{path}: plain zarr cannot open it ({type(exc).__name__}: {exc})"
        ) from exc
    finally:
        if store is not None:
            store.close()


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise ConformanceError(message)


def _ranks(root: Any, where: str) -> list[int]:
    import zarr

    ranks = []
    for name, node in root.members():
        if name.startswith("rank") and name[4:].isdigit():
            _expect(isinstance(node, zarr.Group), f"{where}: {name} is not a group")
            ranks.append(int(name[4:]))
    _expect(bool(ranks), f"{where}: no rank{{r}} group")
    return sorted(ranks)


def _tables(root: Any, r: int) -> dict[str, dict]:
    return dict(root[f"rank{r}"].attrs[ROOT_KEY]["commit"]["tables"])


# --- the checks --------------------------------------------------------------------------------


def check_schema(path: Path) -> None:
    """Root, rank, table and column attributes as docs/trace-format.md lists them."""
    import zarr

    path = Path(path)
    with _plain(path) as root:
        meta = root.attrs.get(ROOT_KEY)
        _expect(isinstance(meta, dict), f"{path}: no attributes['{ROOT_KEY}'] on the root group")
        _expect(meta.get("format") == FORMAT_NAME, f"{path}: format is {meta.get('format')!r}")
        _expect(
            meta.get("schema_version") in SUPPORTED_SCHEMA_VERSIONS,
            f"{path}: schema_version {meta.get('schema_version')!r}",
        )
        for key, kind in (
            ("hstrace_version", str),
            ("engine", dict),
            ("command_line", list),
            ("created", str),
            ("host", dict),
            ("static", dict),
        ):
            _expect(isinstance(meta.get(key), kind), f"{path}: root {key} is not a {kind.__name__}")
        _expect(isinstance(meta["engine"].get("name"), str), f"{path}: engine has no name")
        _expect(
            all(isinstance(a, str) for a in meta["command_line"]),
            f"{path}: command_line holds a non-string",
        )
        for r in _ranks(root, str(path)):
            where = f"{path}: rank{r}"
            rmeta = root[f"rank{r}"].attrs.get(ROOT_KEY)
            _expect(isinstance(rmeta, dict), f"{where}: no attributes['{ROOT_KEY}']")
            _expect(rmeta.get("rank") == r, f"{where}: attributes say rank {rmeta.get('rank')!r}")
            commit = rmeta.get("commit")
            _expect(isinstance(commit, dict), f"{where}: no commit record")
            _expect(isinstance(commit.get("tables"), dict), f"{where}: commit has no tables")
            _expect(
                isinstance(commit.get("clean_close", False), bool),
                f"{where}: clean_close is not a bool",
            )
            for table, c in commit["tables"].items():
                tw = f"{where}/{table}"
                _expect(isinstance(c.get("steps"), int) and c["steps"] >= 0, f"{tw}: commit steps")
                _expect(isinstance(c.get("rows"), dict), f"{tw}: commit rows")
                group = root[f"rank{r}"][table]
                _expect(isinstance(group, zarr.Group), f"{tw}: not a group")
                tmeta = group.attrs.get(ROOT_KEY) or {}
                axes, columns = tmeta.get("axes"), tmeta.get("columns")
                _expect(isinstance(axes, list) and STEP_AXIS in axes, f"{tw}: axes {axes!r}")
                _expect(isinstance(columns, dict), f"{tw}: no columns attribute")
                _expect(set(columns) <= set(axes), f"{tw}: columns on axes {sorted(columns)}")
                for axis, cols in columns.items():
                    for col, spec in cols.items():
                        cw = f"{tw}: column {axis}/{col}"
                        arr = group[column_array(axis, col)]
                        _expect(isinstance(arr, zarr.Array), f"{cw}: no array")
                        _expect(str(arr.dtype) == spec.get("dtype"), f"{cw}: dtype {arr.dtype}")
                        logical = arr.attrs.get("hstrace_dtype", str(arr.dtype))
                        _expect(
                            logical == spec.get("logical_dtype"),
                            f"{cw}: hstrace_dtype {logical!r} vs {spec.get('logical_dtype')!r}",
                        )
                        if logical == "bfloat16":
                            _expect(str(arr.dtype) == "uint16", f"{cw}: bf16 not stored as uint16")
                        _expect(
                            list(arr.shape[1:]) == list(spec.get("row_shape", [])),
                            f"{cw}: row shape {list(arr.shape[1:])} vs {spec.get('row_shape')}",
                        )


def check_offsets(path: Path) -> None:
    """Per table: offsets int64 [S+1, A] with the axes attribute, starting at 0 and
    non-decreasing, covered by the committed rows; count columns sum to the rows they count;
    hstrace's reader takes the same S and row counts."""
    from hstrace.trace import open_trace

    path = Path(path)
    seen: dict[tuple[int, str], tuple[int, dict[str, int]]] = {}
    with _plain(path) as root:
        for r in _ranks(root, str(path)):
            for table, c in _tables(root, r).items():
                tw = f"{path}: rank{r}/{table}"
                S, rows = int(c["steps"]), {k: int(n) for k, n in c["rows"].items()}
                group = root[f"rank{r}"][table]
                tmeta = group.attrs[ROOT_KEY]
                axes = [a for a in tmeta["axes"] if a != STEP_AXIS]
                for col in tmeta["columns"].get(STEP_AXIS, {}):
                    n = rows.get(f"{STEP_AXIS}/{col}", 0)
                    _expect(n >= S, f"{tw}: step/{col} has {n} committed rows for {S} steps")
                counts: dict[str, int] = {}
                off = np.zeros((1, 0), np.int64)
                if axes:
                    arr = group[OFFSETS_ARRAY]
                    _expect(str(arr.dtype) == "int64", f"{tw}: offsets are {arr.dtype}")
                    _expect(arr.ndim == 2, f"{tw}: offsets have {arr.ndim} dimensions")
                    stored = arr.attrs.get(OFFSETS_AXES_KEY)
                    _expect(
                        isinstance(stored, list) and sorted(stored) == sorted(axes),
                        f"{tw}: offsets axes {stored!r} vs the table's {axes}",
                    )
                    axes = list(stored)
                    n = rows.get(OFFSETS_ARRAY, 0)
                    _expect(n >= S + 1, f"{tw}: {n} committed offsets rows for {S} steps")
                    off = np.asarray(arr[: S + 1])
                    _expect(off.shape == (S + 1, len(axes)), f"{tw}: offsets shape {off.shape}")
                    _expect(bool(np.all(off[0] == 0)), f"{tw}: offsets[0] = {off[0].tolist()}")
                    step = np.diff(off, axis=0)
                    if np.any(step < 0):
                        s, i = (int(x) for x in np.argwhere(step < 0)[0])
                        raise ConformanceError(
                            f"{tw}: offsets of axis {axes[i]} decrease at step {s} "
                            f"({int(off[s, i])} -> {int(off[s + 1, i])})"
                        )
                    for i, axis in enumerate(axes):
                        counts[axis] = int(off[S, i])
                        for col in tmeta["columns"].get(axis, {}):
                            n = rows.get(f"{axis}/{col}", 0)
                            _expect(
                                n >= counts[axis],
                                f"{tw}: {axis}/{col} has {n} committed rows, offsets say "
                                f"{counts[axis]}",
                            )
                    for (t, counted), col in REQUEST_ROW_COUNTS.items():
                        if t != table or counted not in axes or "req" not in axes:
                            continue
                        if col not in tmeta["columns"].get("req", {}):
                            continue
                        ri, ci = axes.index("req"), axes.index(counted)
                        vals = np.asarray(group[column_array("req", col)][: counts["req"]])
                        for s in range(S):
                            got = int(vals[off[s, ri] : off[s + 1, ri]].sum())
                            want = int(off[s + 1, ci] - off[s, ci])
                            _expect(
                                got == want,
                                f"{tw}: step {s}: req/{col} sums to {got}, the offsets give "
                                f"{want} {counted} rows",
                            )
                seen[(r, table)] = (S, counts)
    try:
        with open_trace(path) as tr:
            _expect(sorted(tr.ranks) == sorted({r for r, _ in seen}), f"{path}: ranks {tr.ranks}")
            for (r, table), (S, counts) in seen.items():
                t = tr.rank(r).table(table)
                tw = f"{path}: rank{r}/{table}"
                _expect(t is not None, f"{tw}: hstrace's reader does not see the table")
                _expect(
                    t.num_steps == S,
                    f"{tw}: hstrace's reader takes {t.num_steps} steps, the commit says {S}",
                )
                for axis, n in counts.items():
                    _expect(
                        t.num_rows(axis) == n, f"{tw}: reader has {t.num_rows(axis)} {axis} rows"
                    )
    except TraceError as exc:
        raise ConformanceError(f"hstrace's reader refuses the trace: {exc}") from exc


def check_committed_prefix(path: Path, clean_close: bool = True) -> None:
    """Shapes are capacities: never below the committed rows; after a clean close, equal."""
    path = Path(path)
    with _plain(path) as root:
        for r in _ranks(root, str(path)):
            commit = root[f"rank{r}"].attrs[ROOT_KEY]["commit"]
            if clean_close:
                _expect(commit.get("clean_close") is True, f"{path}: rank{r} not closed cleanly")
            for table, c in commit["tables"].items():
                group = root[f"rank{r}"][table]
                for key, n in c["rows"].items():
                    name = OFFSETS_ARRAY if key == OFFSETS_ARRAY else key.replace("/", ".", 1)
                    arr = group[name]
                    where = f"{path}: rank{r}/{table}/{key}"
                    _expect(
                        arr.shape[0] >= n, f"{where}: {arr.shape[0]} rows stored, {n} committed"
                    )
                    if clean_close:
                        _expect(
                            arr.shape[0] == n,
                            f"{where}: shape {arr.shape[0]} after a clean close, {n} committed",
                        )


def _bits(logical: str, a: Any) -> np.ndarray:
    """Comparable bits: bf16 (torch) as int16, floats as unsigned ints of their width."""
    if logical == "bfloat16":
        import torch

        _expect(
            isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16,
            f"a bf16 column read back as {getattr(a, 'dtype', type(a))}",
        )
        return a.contiguous().view(torch.int16).numpy()
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "f" else a


def _comparable(
    where: str, stored: str, logical: str, have: Any, want: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(read, written) as arrays whose equality is bit-exactness for floats."""
    if logical == "bfloat16" or stored == "bfloat16":
        _expect(stored == logical, f"{where}: written as {logical}, stored as {stored}")
        return _bits("bfloat16", have), want
    have = np.asarray(have)
    if want.dtype.kind == "f":
        _expect(have.dtype == want.dtype, f"{where}: read as {have.dtype}, written {want.dtype}")
        return _bits("", have), _bits("", want)
    return have.astype(np.int64), want.astype(np.int64)


def check_round_trip(path: Path, written: Written) -> None:
    """hstrace's reader gives back, step by step, exactly what the producer wrote: same
    dtypes, same bits (bf16 and float NaN payloads too), same row shapes."""
    from hstrace.trace import open_trace

    path = Path(path)
    try:
        with open_trace(path) as tr:
            for r, tables in written.items():
                for table, steps in tables.items():
                    tw = f"{path}: rank{r}/{table}"
                    t = tr.rank(r).table(table)
                    _expect(t is not None, f"{tw}: written but not in the trace")
                    _expect(
                        t.num_steps == len(steps),
                        f"{tw}: {len(steps)} steps written, {t.num_steps} read back",
                    )
                    for s, step in enumerate(steps):
                        got = t.step(s)
                        for axis, cols in step.items():
                            for col, (logical, want) in cols.items():
                                cw = f"{tw}: step {s} {axis}/{col}"
                                _expect(col in got.get(axis, {}), f"{cw}: not read back")
                                have = got[axis][col]
                                stored = t.logical_dtype(axis, col)
                                if axis == STEP_AXIS:  # a scalar per step, one row back
                                    want = np.asarray(want).reshape(-1)
                                    have = np.asarray(have).reshape(-1)
                                _expect(
                                    tuple(have.shape) == tuple(want.shape),
                                    f"{cw}: shape {tuple(have.shape)}, written {want.shape}",
                                )
                                a, b = _comparable(cw, stored, logical, have, want)
                                if not np.array_equal(a, b):
                                    first = np.argwhere(a != b)[0].tolist()
                                    raise ConformanceError(
                                        f"{cw}: read back differs from what was written "
                                        f"(first at index {first})"
                                    )
    except TraceError as exc:
        raise ConformanceError(f"hstrace's reader refuses the trace: {exc}") from exc


def check_plain_zarr(path: Path) -> None:
    """Every committed column read with plain zarr equals what hstrace's reader returns
    (bf16: zarr gives the uint16 bits, hstrace the same bits as torch.bfloat16)."""
    from hstrace.trace import open_trace

    path = Path(path)
    try:
        with _plain(path) as root, open_trace(path) as tr:
            for r in _ranks(root, str(path)):
                for table in _tables(root, r):
                    group = root[f"rank{r}"][table]
                    t = tr.rank(r).table(table)
                    for axis, cols in t.columns.items():
                        n = t.num_rows(axis)
                        for col in cols:
                            cw = f"{path}: rank{r}/{table}: column {axis}/{col}"
                            plain = np.asarray(group[column_array(axis, col)][:n])
                            ours = t.column(axis, col)
                            if t.logical_dtype(axis, col) == "bfloat16":
                                ours = _bits("bfloat16", ours).view(np.uint16)
                            _expect(
                                plain.shape == np.asarray(ours).shape
                                and np.array_equal(_bits("", plain), _bits("", np.asarray(ours))),
                                f"{cw}: plain zarr and hstrace read different values",
                            )
    except TraceError as exc:
        raise ConformanceError(f"hstrace's reader refuses the trace: {exc}") from exc


def _widest_column(path: Path) -> tuple[int, str, str]:
    """(rank, table, array name) of the committed column with the most bytes: the one a
    corrupted chunk hurts most (hidden states, when the trace has them)."""
    best: tuple[int, tuple[int, str, str]] | None = None
    with _plain(path) as root:
        for r in _ranks(root, str(path)):
            for table, c in _tables(root, r).items():
                group = root[f"rank{r}"][table]
                for key, n in c["rows"].items():
                    if key == OFFSETS_ARRAY or n <= 0:
                        continue
                    name = key.replace("/", ".", 1)
                    arr = group[name]
                    size = n * int(np.prod(arr.shape[1:], dtype=np.int64)) * arr.dtype.itemsize
                    if best is None or size > best[0]:
                        best = (size, (r, table, name))
    _expect(best is not None, f"{path}: no committed rows at all")
    return best[1]


def _corrupt_copy(path: Path, workdir: Path) -> tuple[Path, str]:
    """A copy of the trace with the first chunk of its widest column cut to half its bytes."""
    r, table, name = _widest_column(path)
    prefix = f"rank{r}/{table}/{name}/c/"
    workdir.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        copy = workdir / path.name
        shutil.copytree(path, copy)
        chunks = sorted(p for p in (copy / prefix).rglob("*") if p.is_file())
        _expect(bool(chunks), f"{path}: {prefix} has committed rows but no chunk file")
        data = chunks[0].read_bytes()
        chunks[0].write_bytes(data[: len(data) // 2])
        return copy, str(chunks[0].relative_to(copy))
    copy = workdir / path.name
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(copy, "w", zipfile.ZIP_STORED) as dst:
        names = [i.filename for i in src.infolist()]
        victim = next((n for n in sorted(names) if n.startswith(prefix)), None)
        _expect(victim is not None, f"{path}: {prefix} has committed rows but no chunk member")
        for n in names:
            data = src.read(n)
            dst.writestr(n, data[: len(data) // 2] if n == victim else data)
    return copy, victim


def check_corrupt_chunk(path: Path, workdir: Path) -> None:
    """A copy with one chunk cut short: reading it is a `TraceError` of one line that names
    the trace (what a user sees as `hstrace: error: ...`), never another exception."""
    path = Path(path)
    from hstrace.trace import open_trace

    copy, victim = _corrupt_copy(path, Path(workdir))
    try:
        with open_trace(copy) as tr:
            for r in tr.ranks:
                view = tr.rank(r)
                for table in view.tables:
                    t = view.table(table)
                    for axis, cols in t.columns.items():
                        for col in cols:
                            t.column(axis, col)
    except TraceError as exc:
        msg = str(exc)
        _expect("\n" not in msg.strip(), f"{copy}: the error is not one line: {msg!r}")
        _expect(str(copy) in msg, f"{copy}: the error does not name the trace: {msg!r}")
        return
    except Exception as exc:  # noqa: BLE001 - exactly what the check is for
        raise ConformanceError(
            f"{copy}: chunk {victim} cut short raised {type(exc).__name__}: {exc} (expected "
            "a TraceError)"
        ) from exc
    raise ConformanceError(f"{copy}: chunk {victim} cut short, and every column still read")


def check_summary(path: Path) -> None:
    """`hstrace show`'s summary (`summarize`, and its terminal rendering at 80 columns) of
    the trace: the steps and tokens the commit records hold."""
    from hstrace.report import render_summary_terminal
    from hstrace.trace import open_trace, summarize

    path = Path(path)
    steps: dict[str, int] = {}
    tokens = 0
    with _plain(path) as root:
        ranks = _ranks(root, str(path))
        engine = root.attrs[ROOT_KEY]["engine"]["name"]
        for r in ranks:
            for table, c in _tables(root, r).items():
                steps[table] = steps.get(table, 0) + int(c["steps"])
                if table == "target" and int(c["steps"]) > 0:
                    group = root[f"rank{r}"][table]
                    axes = group[OFFSETS_ARRAY].attrs[OFFSETS_AXES_KEY]
                    if "tok" in axes:
                        tokens += int(group[OFFSETS_ARRAY][int(c["steps"]), axes.index("tok")])
    try:
        with open_trace(path) as tr:
            s = summarize(tr)
    except TraceError as exc:
        raise ConformanceError(f"hstrace show refuses the trace: {exc}") from exc
    _expect(s["ranks"] == ranks, f"{path}: show lists ranks {s['ranks']}, the store has {ranks}")
    _expect(s["steps"] == steps, f"{path}: show counts steps {s['steps']}, commits say {steps}")
    _expect(
        s["tokens"]["total"] == tokens,
        f"{path}: show counts {s['tokens']['total']} target tokens, the offsets {tokens}",
    )
    from rich.console import Console

    out = io.StringIO()
    render_summary_terminal(s, console=Console(file=out, width=80))
    _expect(engine in out.getvalue(), f"{path}: show's table does not name the engine {engine}")


def check_trace(produced: ProducedTrace, workdir: Path) -> None:
    """Every check on one produced trace (what the StoreConformance methods run one by one)."""
    check_schema(produced.path)
    check_offsets(produced.path)
    check_committed_prefix(produced.path, produced.clean_close)
    if produced.written is not None:
        check_round_trip(produced.path, produced.written)
    check_plain_zarr(produced.path)
    check_corrupt_chunk(produced.path, workdir)
    check_summary(produced.path)


# --- the pytest base class ----------------------------------------------------------------------


class StoreConformance:
    """Subclass with a `make_trace(self, tmp_path) -> ProducedTrace`; pytest runs each check
    below as a test of the subclass, on one trace made per class (tests must not change it:
    the corrupt-chunk test works on a copy)."""

    def make_trace(self, tmp_path: Path) -> ProducedTrace:
        raise NotImplementedError("a StoreConformance subclass gives make_trace(tmp_path)")

    @pytest.fixture(scope="class")
    def produced(self, tmp_path_factory: pytest.TempPathFactory) -> ProducedTrace:
        made = self.make_trace(tmp_path_factory.mktemp(type(self).__name__))
        if not isinstance(made, ProducedTrace):  # a bare path is fine
            made = ProducedTrace(Path(made))
        return made

    def test_schema_attributes(self, produced: ProducedTrace) -> None:
        check_schema(produced.path)

    def test_offsets_are_consistent_csr(self, produced: ProducedTrace) -> None:
        check_offsets(produced.path)

    def test_committed_prefix(self, produced: ProducedTrace) -> None:
        check_committed_prefix(produced.path, produced.clean_close)

    def test_round_trip_is_bit_exact(self, produced: ProducedTrace) -> None:
        if produced.written is None:
            pytest.skip("make_trace gave no `written` (record_writes) to compare against")
        check_round_trip(produced.path, produced.written)

    def test_plain_zarr_reads_the_same(self, produced: ProducedTrace) -> None:
        check_plain_zarr(produced.path)

    def test_corrupt_chunk_is_one_trace_error(
        self, produced: ProducedTrace, tmp_path: Path
    ) -> None:
        check_corrupt_chunk(produced.path, tmp_path)

    def test_show_summarises_it(self, produced: ProducedTrace) -> None:
        check_summary(produced.path)
