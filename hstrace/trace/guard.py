"""A read-only store wrapper that refuses what a hostile or damaged trace could make zarr do.

zarr reads whatever a key names: a `zarr.json` that is a symlink to `/dev/zero` (endless), a FIFO
(blocks forever), a chunk that links to `/etc/passwd`, a sparse 8 GiB "chunk", and it reads a
missing chunk as its fill value (zeros) without a word. Every byte zarr reads from a trace goes
through `GuardedStore.get`, which checks, before reading:

* the key resolves inside the store (no link leaving it) to a regular file;
* metadata (`zarr.json`) is at most `META_MAX_BYTES`;
* a chunk (or shard) of a registered array is at most what that array can encode (its chunk's
  decoded size plus the codec's overhead), its Blosc header declares no more than that, and a
  chunk or shard that the commit record says holds committed rows exists, as does every inner
  chunk of a shard's index that holds committed rows.

Arrays are registered by the reader (`register`) once it knows their metadata and the commit
record; the checks cost one `stat` (or a zip directory look-up) per read, never a read of data.
"""

from __future__ import annotations

import itertools
import math
import os
import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from zarr.abc.store import SuffixByteRequest
from zarr.storage import WrapperStore

from hstrace.errors import TraceError
from hstrace.trace.liveshard import live_shard_bytes

# zarr.json of the biggest real trace is tens of KiB (the rank's static audit holds the
# checkpoint key list); 16 MiB leaves room for any audit and stops an endless file early.
META_MAX_BYTES = 16 << 20
META_NAME = "zarr.json"
_EMPTY = (1 << 64) - 1  # an empty inner chunk in a shard index
# Blosc 1 adds at most 16 bytes of header plus 4 bytes per block to a memcpy'd chunk.
_BLOSC_HEADER = 16


@dataclass(frozen=True)
class ArrayRule:
    """What the chunks of one array may be, from its metadata and the commit record."""

    name: str  # the array's key prefix in the store, e.g. "rank0/target/tok.input_ids"
    label: str  # how messages name it
    outer_rows: int  # rows per chunk (or per shard) along the first dimension
    grid: tuple[int, ...]  # number of chunks (or shards) along each dimension
    required: int  # chunks/shards along dim 0 that hold committed rows
    committed: int  # committed rows
    max_bytes: int  # largest file a chunk/shard of this array can be
    decoded_bytes: int  # decoded size of one (inner) chunk
    blosc: bool  # unsharded chunks are Blosc frames (header checked)
    inner_rows: int | None = None  # sharded: rows per inner chunk
    n_inner: int = 0  # sharded: inner chunks per shard
    index_bytes: int = 0  # sharded: size of the shard index at the end


def array_rule(label: str, arr: Any, committed: int, name: str) -> ArrayRule:
    """The rule for a zarr array of a trace (the writer's layout: default chunk keys, bytes +
    Blosc codecs, optionally sharded); TraceError for any other layout."""
    md = arr.metadata
    enc = getattr(md, "chunk_key_encoding", None)
    if type(enc).__name__ != "DefaultChunkKeyEncoding" or getattr(enc, "separator", "/") != "/":
        raise TraceError(
            f"{label}: chunk key encoding {enc!r} was not written by hstrace (corrupt)"
        )
    shape = tuple(int(x) for x in arr.shape)
    inner = tuple(int(x) for x in arr.chunks)
    shards = arr.shards
    outer = tuple(int(x) for x in shards) if shards is not None else inner
    if not shape or len(outer) != len(shape) or min(outer) < 1 or min(inner) < 1:
        raise TraceError(f"{label}: array shape {list(shape)} / chunks {list(outer)} (corrupt)")
    itemsize = int(arr.dtype.itemsize)
    decoded = math.prod(inner) * itemsize
    grid = tuple(max(1, -(-s // c)) for s, c in zip(shape, outer, strict=True))
    codec_names = [type(c).__name__ for c in md.codecs]
    _check_codecs(label, _plain(md.to_dict().get("codecs")))
    per_chunk_max = decoded + decoded // 64 + _BLOSC_HEADER + 1024
    if shards is None:
        return ArrayRule(
            name,
            label,
            outer[0],
            grid,
            -(-committed // outer[0]),
            committed,
            per_chunk_max,
            decoded,
            blosc="BloscCodec" in codec_names,
        )
    sharding = next(c for c in md.codecs if type(c).__name__ == "ShardingCodec")
    per_shard = tuple(o // i for o, i in zip(outer, inner, strict=True))
    n_inner = math.prod(per_shard)
    index_bytes = int(sharding._shard_index_size(per_shard))
    return ArrayRule(
        name,
        label,
        outer[0],
        grid,
        -(-committed // outer[0]),
        committed,
        # or a shard the writer left live at its key (a tail flush, then no close): sparse,
        # with room for every chunk, two tail slots and the index (liveshard.py).
        max(n_inner * per_chunk_max + index_bytes, live_shard_bytes(n_inner, decoded)),
        decoded,
        blosc=False,
        inner_rows=inner[0],
        n_inner=n_inner,
        index_bytes=index_bytes,
    )


def _plain(value: Any) -> Any:
    """zarr's metadata dict with its tuples as lists (as the JSON file holds them)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _is_chain(codecs: Any) -> bool:
    """bytes + blosc: the one chunk codec chain schema v1 writes (rowlog.COMPRESSORS)."""
    return (
        isinstance(codecs, list)
        and [c.get("name") if isinstance(c, dict) else None for c in codecs] == ["bytes", "blosc"]
        and (codecs[0].get("configuration") or {}).get("endian", "little") in ("little", "big")
    )


def _check_codecs(label: str, codecs: Any) -> None:
    """An array's codecs must be the schema's chain, or that chain inside the sharding codec
    with a crc32c'd index at the end: any other codec (an inserted transpose) would decode
    its chunks into other rows than were written, and read as data."""
    ok = _is_chain(codecs)
    if not ok and isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict):
        c = codecs[0]
        cfg = c.get("configuration") or {}
        ok = (
            c.get("name") == "sharding_indexed"
            and _is_chain(cfg.get("codecs"))
            and [i.get("name") for i in cfg.get("index_codecs") or [] if isinstance(i, dict)]
            == ["bytes", "crc32c"]
            and cfg.get("index_location", "end") == "end"
        )
    if not ok:
        names = (
            [c.get("name") if isinstance(c, dict) else c for c in codecs]
            if isinstance(codecs, list)
            else codecs
        )
        raise TraceError(
            f"{label}: codecs {names} are not the schema's chain (bytes + blosc, optionally "
            "sharded); refusing to decode them as data (corrupt)"
        )


def index_overlap(index: np.ndarray) -> int | None:
    """The first inner chunk (by position in the file) whose byte range overlaps another's in
    a shard index of (offset, nbytes) rows, or None: two entries aliasing one range would read
    one chunk's bytes as another's rows."""
    used = index[:, 0] != _EMPTY
    if int(used.sum()) < 2:
        return None
    offs = index[used, 0].astype(np.uint64)
    ends = offs + index[used, 1].astype(np.uint64)
    order = np.argsort(offs, kind="stable")
    bad = ends[order][:-1] > offs[order][1:]
    if not np.any(bad):
        return None
    return int(np.flatnonzero(used)[order][int(np.argmax(bad)) + 1])


def _bytes_view(data: Any) -> np.ndarray:
    """The bytes of a zarr Buffer as a flat uint8 array (a view for CPU buffers)."""
    try:
        return np.asarray(data.as_numpy_array()).reshape(-1).view(np.uint8)
    except (AttributeError, ValueError, TypeError):
        return np.frombuffer(data.to_bytes(), np.uint8)


class GuardedStore(WrapperStore):
    """Wraps the read-only LocalStore or ZipStore of a trace (see the module docstring)."""

    def __init__(self, store: Any, where: str, root: Path | None = None, zip_path=None) -> None:
        super().__init__(store)
        self._where = where
        self._root = os.path.realpath(root) if root is not None else None
        self._zip_infos: dict[str, zipfile.ZipInfo] | None = None
        if zip_path is not None:
            with zipfile.ZipFile(zip_path) as zf:
                self._zip_infos = {i.filename: i for i in zf.infolist()}
        self._rules: dict[str, ArrayRule] = {}

    def register(self, rule: ArrayRule) -> None:
        """Adopt an array's rule and check, by `stat` only, that every chunk (or shard) holding
        committed rows is there and is a regular file inside the store of a possible size."""
        self._rules[rule.name] = rule
        others = [range(n) for n in rule.grid[1:]]
        for i in range(rule.required):
            for rest in itertools.product(*others):
                key = "/".join((rule.name, "c", str(i), *map(str, rest)))
                self._check_before(key, self._size(key))

    # --- what a key is, before zarr reads it ----------------------------------------------
    def _size(self, key: str) -> int | None:
        """Size of the file behind `key`, None if there is none; TraceError if it is a link
        leaving the store or not a regular file."""
        if self._zip_infos is not None:
            info = self._zip_infos.get(key)
            return None if info is None or info.is_dir() else int(info.file_size)
        assert self._root is not None
        path = os.path.join(self._root, key)
        try:
            lst = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        real = os.path.realpath(path)
        if stat.S_ISLNK(lst.st_mode) or real != os.path.normpath(path):
            if not (real + os.sep).startswith(self._root + os.sep):
                raise TraceError(
                    f"{self._where}: {key} is a link leaving the trace (to {real}); refusing to "
                    "read it"
                )
        try:
            st = os.stat(real)
        except FileNotFoundError:
            return None  # a dangling link: as missing (a required chunk is named as such)
        except OSError as exc:  # a symlink loop, no permission: there, but unreadable
            raise TraceError(
                f"{self._where}: {key} cannot be read ({exc.strerror}); corrupt trace"
            ) from None
        if stat.S_ISDIR(st.st_mode):
            return None
        if not stat.S_ISREG(st.st_mode):
            raise TraceError(
                f"{self._where}: {key} is not a regular file (a device, FIFO or socket); "
                "refusing to read it"
            )
        return int(st.st_size)

    def _rule_of(self, key: str) -> tuple[ArrayRule, tuple[int, ...]] | None:
        prefix, sep, coords = key.rpartition("/c/")
        if not sep or prefix not in self._rules:
            return None
        rule = self._rules[prefix]
        try:
            idx = tuple(int(x) for x in coords.split("/"))
        except ValueError:
            return None
        return rule, idx

    def _required(self, rule: ArrayRule, idx: tuple[int, ...]) -> bool:
        return (
            len(idx) == len(rule.grid)
            and 0 <= idx[0] < rule.required
            and all(0 <= i < n for i, n in zip(idx[1:], rule.grid[1:], strict=True))
        )

    def _check_before(self, key: str, size: int | None) -> tuple[ArrayRule, tuple] | None:
        if key.endswith(META_NAME) and size is not None and size > META_MAX_BYTES:
            raise TraceError(
                f"{self._where}: {key} is {size} bytes of metadata (limit {META_MAX_BYTES} "
                "bytes); refusing to read it"
            )
        hit = self._rule_of(key)
        if hit is None:
            return None
        rule, idx = hit
        if size is None:
            if self._required(rule, idx):
                raise TraceError(
                    f"{self._where}: chunk {key} is missing, but the commit record says it "
                    f"holds committed rows of {rule.label} ({rule.committed} rows; corrupt or "
                    "partly deleted trace)"
                )
            return None
        if size > rule.max_bytes:
            raise TraceError(
                f"{self._where}: chunk {key} is {size} bytes, more than the {rule.max_bytes} "
                f"bytes a chunk of {rule.label} can hold; refusing to read it"
            )
        return hit

    def _check_after(self, key: str, hit, data: Any, byte_range: Any) -> None:
        rule, idx = hit
        if data is None:
            if self._required(rule, idx):
                raise TraceError(f"{self._where}: chunk {key} is missing (corrupt)")
            return
        # A view, not a copy (a shard read whole is up to 128 MiB): only its head/tail is read.
        raw = _bytes_view(data) if byte_range is None or rule.inner_rows else None
        if rule.inner_rows is None:
            if rule.blosc and raw is not None and len(raw) >= _BLOSC_HEADER:
                nbytes = int.from_bytes(bytes(raw[4:8]), "little")
                if nbytes > rule.decoded_bytes:
                    raise TraceError(
                        f"{self._where}: chunk {key} declares {nbytes} decoded bytes, more than "
                        f"the {rule.decoded_bytes} of a chunk of {rule.label} (corrupt)"
                    )
                # A frame cut short (a truncated zip member): numcodecs' Blosc decoder reads
                # the header's cbytes past the buffer's end and crashes the process.
                cbytes = int.from_bytes(bytes(raw[12:16]), "little")
                if cbytes > len(raw):
                    raise TraceError(
                        f"{self._where}: chunk {key} is {len(raw)} bytes, its Blosc header "
                        f"says {cbytes} (truncated or corrupt)"
                    )
            elif rule.blosc and raw is not None and 0 < len(raw):
                raise TraceError(f"{self._where}: chunk {key} is {len(raw)} bytes (truncated)")
            return
        if byte_range is not None and not isinstance(byte_range, SuffixByteRequest):
            return  # an inner chunk read; the index was checked when it was read
        if raw is None or len(raw) < rule.index_bytes:
            raise TraceError(f"{self._where}: shard {key} is shorter than its index (corrupt)")
        tail = bytes(
            raw[len(raw) - rule.index_bytes : len(raw) - rule.index_bytes + 16 * rule.n_inner]
        )
        index = np.frombuffer(tail, "<u8")
        index = index.reshape(rule.n_inner, 2)
        alias = index_overlap(index)
        if alias is not None:
            raise TraceError(
                f"{self._where}: shard {key} indexes inner chunk {alias} over another chunk's "
                f"bytes (overlapping ranges; corrupt)"
            )
        # Inner chunks are in C order; along dim 0 the j-th row of inner chunks starts at row
        # shard_start + j * inner_rows.
        rows_of = rule.outer_rows // rule.inner_rows
        per_j = rule.n_inner // rows_of
        start = idx[0] * rule.outer_rows
        for j in range(rows_of):
            if start + j * rule.inner_rows >= rule.committed:
                break
            block = index[j * per_j : (j + 1) * per_j]
            if np.any(block[:, 0] == _EMPTY):
                raise TraceError(
                    f"{self._where}: shard {key} has no inner chunk for committed rows "
                    f"{start + j * rule.inner_rows}.. of {rule.label} (corrupt)"
                )
            if np.any(block[:, 1] > rule.decoded_bytes + rule.decoded_bytes // 64 + 1040):
                raise TraceError(
                    f"{self._where}: shard {key} indexes an inner chunk larger than a chunk of "
                    f"{rule.label} can be (corrupt)"
                )

    # --- the store interface --------------------------------------------------------------
    async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
        size = self._size(key)
        hit = self._check_before(key, size)
        if size is None and hit is None:
            return None
        data = await self._store.get(key, prototype, byte_range)
        if hit is not None:
            self._check_after(key, hit, data, byte_range)
        return data

    async def get_partial_values(self, prototype: Any, key_ranges: Any) -> list[Any]:
        return [await self.get(k, prototype, r) for k, r in key_ranges]

    async def exists(self, key: str) -> bool:
        return self._size(key) is not None
