"""Stage read (entry `read_serving`): what serving did, per request, read back from a trace.

The first stage of the replay: read → align → compare → what-if → judge. The only trace I/O of
the replay side.

From the `target` table: the committed tokens by position and the aux hidden states the target
captured for them (a verify round commits its first 1 + accept_len rows; the rest were rejected
drafts). From `draft_extend`: what the drafter received per position (token ids, positions,
hidden input) and what it produced (top-k in draft and target space, log-probs).

The narrow columns (ids, positions, counts) are read whole to decide which rows each request
keeps; the wide ones (aux rows, the drafter's hidden input, its top-k) are then read only at
those rows, chunk by chunk (`hstrace.trace.rows.gather`): rejected drafts left on disk, and
never a whole wide column in memory.

The widest of them, the aux rows (or their sketches) and the drafter's hidden input, are not
held: `read_serving(trace, lazy=True)` keeps only where each request's rows are
(`WideReader`), and a request's wide tensors are read while a piece of evidence works on it
(`ServingData.holding`) and released after, so replay's memory follows the largest request,
not the whole trace. The top-k columns (k values a row) are read at the kept rows and held.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hstrace.errors import TraceError
from hstrace.trace.rows import LastWindow, gather
from hstrace.trace.schema import MODE_VERIFY, REQUEST_ROW_COUNTS


class WideReader:
    """The wide columns of one rank of an open trace, read at given table rows when asked.

    A request keeps only its table rows (`ServingRequest.target_rows`, `DraftRows.rows`); the
    tensors are read through `hstrace.trace.rows.gather` (whole stored chunks, a window at a
    time) while the trace is open. `reads` counts the rows read per kind (a second read of a
    row shows there)."""

    # kind -> (table, column) and whether the column is stored as float16/32 (sketches, stats)
    KINDS = {
        "aux": ("target", "aux_hidden", False),
        "aux_sketch": ("target", "aux_hidden_sketch", True),
        "aux_stats": ("target", "aux_hidden_stats", True),
        "hidden_in": ("draft_extend", "hidden_in", False),
    }

    def __init__(self, tables: dict[str, Any], present: dict[str, str]) -> None:
        self._tables = tables
        self.present = present  # kind -> column name, for the kinds this trace has
        self.reads: dict[str, int] = {}
        self.window = LastWindow()  # neighbouring requests share chunks: decoded once
        # (row width, dtype) of each kind, from an empty read (no rows decoded)
        self.shape: dict[str, tuple[int, torch.dtype]] = {}
        for kind in present:
            table, name, to_float = self.KINDS[kind]
            empty = _torch(tables[table].column("tok", name, 0, 0))  # no row decoded
            empty = empty.float() if to_float else empty
            self.shape[kind] = (int(empty.shape[-1]) if empty.dim() > 1 else 1, empty.dtype)

    def _read(self, kind: str, rows: np.ndarray) -> torch.Tensor:
        table, name, to_float = self.KINDS[kind]
        data = _torch(gather(self._tables[table], "tok", name, rows, self.window))
        self.reads[kind] = self.reads.get(kind, 0) + len(rows)
        return data.float() if to_float else data

    def read(self, kind: str, parts: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """The rows of each part (one read for all: requests of one batch share chunks)."""
        if not parts:
            return []
        data = self._read(kind, np.concatenate([np.asarray(p, np.int64) for p in parts]))
        bounds = np.cumsum([0, *(len(p) for p in parts)])
        return [data[int(a) : int(b)] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


class _Wide:
    """Wide tensors of one request or draft: held ones, else read from the trace at each access
    (the caller keeps what it needs; `ServingData.holding` holds them for a while)."""

    def _get(self, kind: str, stop: int | None = None) -> torch.Tensor | None:
        """The tensor (its first `stop` rows only, when given: only those are read)."""
        if kind in self.held:
            return self.held[kind] if stop is None else self.held[kind][:stop]
        if self.wide is None or kind not in self.wide.present:
            return None
        return self.wide.read(kind, [self._rows_of(kind)[:stop]])[0]

    def _set(self, kind: str, value: torch.Tensor | None) -> None:
        if value is None:
            self.held.pop(kind, None)
        else:
            self.held[kind] = value

    def has(self, kind: str) -> bool:
        return kind in self.held or (self.wide is not None and kind in self.wide.present)

    def width(self, kind: str) -> int | None:
        if kind in self.held:
            return int(self.held[kind].shape[-1])
        return self.wide.shape[kind][0] if self.has(kind) else None

    def dtype(self, kind: str) -> torch.dtype | None:
        if kind in self.held:
            return self.held[kind].dtype
        return self.wide.shape[kind][1] if self.has(kind) else None

    def _rows_of(self, kind: str) -> np.ndarray:
        raise NotImplementedError


@dataclass(eq=False)
class DraftRows(_Wide):
    """Draft-extend rows of one request, one per position, sorted by position."""

    positions: np.ndarray  # [R] int64, the positions the engine fed
    input_ids: np.ndarray  # [R] int64, the token ids the engine fed
    topk_draft_ids: torch.Tensor | None = None  # [R, k]
    topk_target_ids: torch.Tensor | None = None  # [R, k]
    topk_logprobs: torch.Tensor | None = None  # [R, k]
    # The committed sequence's index of each row (row r sits at sequence index index[r]).
    index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # The table step (the event on this rank, 0 = first) each row was recorded in.
    steps: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # The draft-extend table row of each row (where the wide columns were read from).
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    wide: WideReader | None = None
    held: dict[str, torch.Tensor] = field(default_factory=dict)

    def _rows_of(self, kind: str) -> np.ndarray:
        return self.rows

    @property
    def hidden_in(self) -> torch.Tensor | None:
        """[R, W] the drafter's hidden input (None: not recorded)."""
        return self._get("hidden_in")

    @hidden_in.setter
    def hidden_in(self, value: torch.Tensor | None) -> None:
        self._set("hidden_in", value)

    @property
    def has_hidden(self) -> bool:
        return self.has("hidden_in")


@dataclass
class DraftChain:
    """One round's draft chain after step 0 (the `draft_step` rows, steps k = 1..K-1)."""

    rows: int  # the draft-extend rows the chain started from (the committed length T)
    step_index: np.ndarray  # [S] k of each recorded step
    input_ids: np.ndarray  # [S] the token the engine fed at step k (its step k-1 draft)
    topk_draft_ids: np.ndarray  # [S, k] what the engine drafted at step k
    topk_logprobs: np.ndarray | None = None  # [S, k] their log-probs


@dataclass(eq=False)
class ServingRequest(_Wide):
    key: int
    tokens: np.ndarray  # committed token ids, by sequence index
    position_base: int = 0  # the position of tokens[0]
    draft: DraftRows | None = None
    # The recorded chains (`draft_step`), in round order; empty when not recorded.
    chains: list[DraftChain] = field(default_factory=list)
    # Prefix caching: the first `aux_start` tokens were served from the cache (no target rows
    # for them; their ids come from the `requests` table's prompt). aux[i] is the capture of
    # sequence index aux_start + i.
    aux_start: int = 0
    # What the producer declared (`requests.n_cached`); None: not recorded.
    n_cached: int | None = None
    rid: str | None = None
    # Each prefill/extend target block of the request: (first position, last position + 1), in
    # order. More than one: chunked prefill (the seams are the ends of all but the last).
    prefill_chunks: list[tuple[int, int]] = field(default_factory=list)
    # The target step (event on this rank) each aux row was recorded in: the batch it rode in.
    aux_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # [[first, last], ...] positions that should have target rows and have none: gaps between
    # recorded rows, and cached-prefix rows beyond the declared `n_cached`. Rows after the
    # first gap are not part of the aligned sequence.
    missing: list[list[int]] = field(default_factory=list)
    # The target table row of each captured row (where the wide columns are read from).
    target_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    wide: WideReader | None = None
    held: dict[str, torch.Tensor] = field(default_factory=dict)

    def _rows_of(self, kind: str) -> np.ndarray:
        return self.target_rows

    # The wide tensors, read when asked unless held (`ServingData.holding`).
    @property
    def aux(self) -> torch.Tensor | None:
        """[P, K*H] target capture of the first P committed positions (None: not recorded)."""
        return self._get("aux")

    @aux.setter
    def aux(self, value: torch.Tensor | None) -> None:
        self._set("aux", value)

    @property
    def aux_sketch(self) -> torch.Tensor | None:
        """A `--redact hidden` bundle keeps, instead of aux, per-slot sketches [P, K*D] (seeded
        random projections, `hstrace.redaction.sketch_slots`), as float32."""
        return self._get("aux_sketch")

    @aux_sketch.setter
    def aux_sketch(self, value: torch.Tensor | None) -> None:
        self._set("aux_sketch", value)

    @property
    def aux_stats(self) -> torch.Tensor | None:
        """The bundle's per-slot stats [P, K*3], as float32."""
        return self._get("aux_stats")

    @aux_stats.setter
    def aux_stats(self, value: torch.Tensor | None) -> None:
        self._set("aux_stats", value)

    def aux_head(self, stop: int | None) -> torch.Tensor | None:
        """aux[:stop], reading only those rows when not held."""
        return self._get("aux", stop)

    def sketch_head(self, stop: int | None) -> torch.Tensor | None:
        """aux_sketch[:stop], reading only those rows when not held."""
        return self._get("aux_sketch", stop)

    @property
    def has_aux(self) -> bool:
        return self.has("aux")

    @property
    def has_sketch(self) -> bool:
        return self.has("aux_sketch")

    @property
    def aux_rows(self) -> int:
        """Rows with a recorded capture (full, or sketched)."""
        if "aux" in self.held:
            return len(self.held["aux"])
        if "aux_sketch" in self.held:
            return len(self.held["aux_sketch"])
        return len(self.target_rows) if self.has_aux or self.has_sketch else 0

    @property
    def aux_end(self) -> int:
        """Sequence index one past the last captured row (aux_start + aux_rows)."""
        return self.aux_start + self.aux_rows if self.aux_rows else 0

    @property
    def cache_hit(self) -> bool:
        return self.aux_start > 0 or bool(self.n_cached)

    @property
    def name(self) -> str:
        """How a report names the request: the engine's id if recorded, else the key."""
        return self.rid if self.rid is not None else f"req_key {self.key}"

    @property
    def seams(self) -> list[int]:
        """Chunked prefill: the last position of every non-final prefill chunk."""
        return [end - 1 for _start, end in self.prefill_chunks[:-1]]


# What `ServingData.holding` reads by default: every wide tensor a request has.
WIDE_KINDS = ("aux", "aux_sketch", "aux_stats", "hidden_in")


# The verify columns the rejection rule reads (`verify.req.*`, `verify.proposed.*`).
RULE_PARAMS = (
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)
RULE_TOKEN_COLUMNS = (
    "p_target",
    "q_draft",
    "logit_raw",
    "logit_pen",
    "logit_proc",
    "target_argmax",
    "seen_prompt",
    "n_out",
)


@dataclass(frozen=True)
class VerifyRound:
    """One request's verify as its rule saw it: the drafts, how many were accepted, the rule
    (`verify.req.rule`: 0 greedy, 1 one-hot draft, 2 draft probabilities, 3 synthetic, -1 not
    recorded), the sampling parameters, and per drafted token the rule's inputs."""

    step: int
    key: int
    accepted: int
    drafts: np.ndarray
    rule: int
    params: dict[str, float]
    tokens: dict[str, np.ndarray]


def _verify_rounds(verify: Any) -> list[VerifyRound]:
    if verify is None or verify.num_steps == 0 or "rule" not in verify.columns.get("req", []):
        return []
    off = verify.offsets("req")
    off_p = verify.offsets("proposed")
    keys = _np(verify.column("req", "req_key")).astype(np.int64)
    acc = _np(verify.column("req", "accept_len")).astype(np.int64)
    nprop = _np(verify.column("req", "n_proposed")).astype(np.int64)
    rule = _np(verify.column("req", "rule")).astype(np.int64)
    params = {k: _np(verify.column("req", k)).astype(np.float64) for k in RULE_PARAMS}
    ids = _np(verify.column("proposed", "ids")).astype(np.int64)
    cols = {k: _np(verify.column("proposed", k)) for k in RULE_TOKEN_COLUMNS}
    out = []
    for s in range(verify.num_steps):
        start = int(off_p[s])
        for r in range(int(off[s]), int(off[s + 1])):
            n = int(nprop[r])
            sl = slice(start, start + n)
            out.append(
                VerifyRound(
                    step=s,
                    key=int(keys[r]),
                    accepted=int(acc[r]),
                    drafts=ids[sl],
                    rule=int(rule[r]),
                    params={k: float(v[r]) for k, v in params.items()},
                    tokens={k: v[sl] for k, v in cols.items()},
                )
            )
            start += n
    return out


@dataclass
class ServingData:
    requests: list[ServingRequest]
    meta: dict[str, Any]
    aux_attrs: dict[str, Any] = field(default_factory=dict)
    accept_lens: list[int] = field(default_factory=list)
    # Attributes of `aux_hidden_sketch` (slot_width, sketch_dim, sketch_seed) in a redacted bundle.
    sketch_attrs: dict[str, Any] = field(default_factory=dict)
    # Streams or columns the trace lacks (not recorded, or redacted by `hstrace bundle`).
    missing: dict[str, str] = field(default_factory=dict)
    # Batch composition: the req_keys of every target step, and of every draft-extend step.
    target_batches: list[list[int]] = field(default_factory=list)
    draft_batches: list[list[int]] = field(default_factory=list)
    # Per req_key, the accept_len of each of its verify rounds (in order), and the batch size
    # of the verify step each came from.
    accept_by_key: dict[int, list[int]] = field(default_factory=dict)
    verify_batch_sizes: dict[int, list[int]] = field(default_factory=dict)
    # Where the wide tensors are read from (None: all held, or none recorded).
    wide: WideReader | None = None
    # Every verify's rule inputs, in trace order (empty: the engine's verify tap recorded none).
    verify_rounds: list[VerifyRound] = field(default_factory=list)

    def by_key(self) -> dict[int, ServingRequest]:
        return {r.key: r for r in self.requests}

    @property
    def static(self) -> dict[str, Any]:
        return self.meta.get("static") or {}

    @contextlib.contextmanager
    def holding(
        self, requests: Sequence[ServingRequest], kinds: Sequence[str] = WIDE_KINDS
    ) -> Iterator[list[ServingRequest]]:
        """Hold the wide tensors of `requests` (one read per kind for all of them) while the
        block runs; released after, except those already held before."""
        added: list[tuple[Any, str]] = []
        if self.wide is not None:
            for kind in kinds:
                owners = [
                    (r.draft if kind == "hidden_in" else r)
                    for r in requests
                    if (r.draft if kind == "hidden_in" else r) is not None
                ]
                owners = [o for o in dict.fromkeys(owners) if kind not in o.held and o.has(kind)]
                got = self.wide.read(kind, [o._rows_of(kind) for o in owners])
                for o, x in zip(owners, got, strict=True):
                    o.held[kind] = x
                    added.append((o, kind))
        try:
            yield list(requests)
        finally:
            for o, kind in added:
                o.held.pop(kind, None)
            if added:
                _give_back_freed()

    def rows_of(
        self, kind: str, parts: Sequence[tuple[ServingRequest, np.ndarray]]
    ) -> list[torch.Tensor]:
        """Some rows of some requests' `kind` tensors ((request, local row indices) each), held
        ones indexed, the others read together in one windowed read."""
        out: list[torch.Tensor | None] = [None] * len(parts)
        todo = []
        for i, (r, rows) in enumerate(parts):
            if kind in r.held:
                out[i] = r.held[kind][torch.as_tensor(np.asarray(rows, np.int64))]
            else:
                todo.append(i)
        if todo:
            got = self.wide.read(kind, [parts[i][0].target_rows[parts[i][1]] for i in todo])
            for i, x in zip(todo, got, strict=True):
                out[i] = x
        return out

    def hold_all(self) -> None:
        """Read every request's wide tensors now and keep them (the trace may then close)."""
        with self.holding(self.requests) as reqs:
            pinned = [(o, dict(o.held)) for r in reqs for o in (r, r.draft) if o is not None]
        for o, held in pinned:
            o.held.update(held)
        if self.wide is not None:
            self.wide.window.clear()
        self.wide = None
        for r in self.requests:
            r.wide = None
            if r.draft is not None:
                r.draft.wide = None


# Freed heap bytes kept before they are given back: trimming costs the next batch its page
# faults, so a fixed amount stays.
KEEP_FREED = 256 << 20


def _give_back_freed() -> None:
    """Return freed heap pages to the OS (glibc `malloc_trim`) once more than KEEP_FREED are
    free. glibc raises its mmap threshold to the size of each freed large block (up to 32
    MiB), so a batch's rows and activations land on the heap, and the heap keeps what a batch
    freed: without this, peak RSS grows with the number of batches walked although nothing
    stays allocated (bench/replay_rows.py --requests). No-op without glibc."""
    global _LIBC
    if _LIBC is None:
        _LIBC = _glibc()
    if _LIBC and _LIBC.mallinfo2().fordblks > KEEP_FREED:
        _LIBC.malloc_trim(0)


def _glibc() -> Any:
    try:
        import ctypes

        class MallInfo2(ctypes.Structure):
            _fields_ = [
                (name, ctypes.c_size_t)
                for name in (
                    "arena", "ordblks", "smblks", "hblks", "hblkhd",
                    "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
                )
            ]  # fmt: skip

        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return False


_LIBC: Any = None


def _col(table: Any, axis: str, name: str) -> Any:
    cols = table.columns.get(axis, [])
    return table.column(axis, name) if name in cols else None


def _np(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.numpy()
    return np.asarray(x)


def _torch(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))


def _per_request_blocks(table: Any, count_col: str | None = None):
    """Yield (step, req_key, tok_start, tok_stop) for every request block of every step; the
    rows a request owns on the tok axis are counted by the schema's REQUEST_ROW_COUNTS."""
    count_col = count_col or REQUEST_ROW_COUNTS[(table.name, "tok")]
    off_req = table.offsets("req")
    off_tok = table.offsets("tok")
    keys = _np(table.column("req", "req_key")).astype(np.int64)
    counts = _np(table.column("req", count_col)).astype(np.int64)
    for s in range(table.num_steps):
        start = int(off_tok[s])
        for r in range(int(off_req[s]), int(off_req[s + 1])):
            yield s, int(keys[r]), start, start + int(counts[r])
            start += int(counts[r])


def read_serving(trace: Any, rank: int = 0, lazy: bool = False) -> ServingData:
    """Per-request serving data of one rank of an open trace (`hstrace.trace.open_trace`).

    lazy: the wide tensors (aux rows, sketches, the drafter's hidden input) stay on disk and
    are read while the trace is open, request by request (`ServingData.holding`); else they
    are all read now (one windowed read per column) and held, and the trace may be closed."""
    if rank not in trace.ranks:
        raise TraceError(f"trace has no rank {rank} (ranks: {trace.ranks})")
    view = trace.rank(rank)
    target = view.table("target")
    if target is None or target.num_steps == 0:
        raise TraceError("trace has no target steps: nothing was served or the target tap was off")
    ext = view.table("draft_extend")
    accept = _accept_lens(view.table("verify"))
    present, missing = _wide_columns(trace.meta, target, ext)
    committed = _committed_rows(target, accept)
    drafts = _draft_rows(ext)
    chains = _draft_chains(ext, view.table("draft_step"))
    prompts = _prompts(view.table("requests"))
    requests = []
    for key, by_pos in committed.rows.items():
        req = _request(key, by_pos, committed, prompts.get(key, {}))
        if key in drafts:
            req.draft = _index_draft(drafts[key], req)
            req.chains = chains.get(key, [])
        requests.append(req)
    wide = WideReader({"target": target, "draft_extend": ext}, present) if present else None
    for req in requests:
        req.wide = wide
        if req.draft is not None:
            req.draft.wide = wide
    if ext is not None:
        _fill_draft_columns(ext, [r.draft for r in requests])
    data = ServingData(
        requests=requests,
        meta=dict(trace.meta),
        aux_attrs=_aux_attrs(target),
        accept_lens=[a for v in accept.values() for a in v],
        sketch_attrs=dict(target.column_attrs("tok", "aux_hidden_sketch"))
        if "aux_sketch" in present
        else {},
        missing=missing,
        target_batches=_batches(target),
        draft_batches=_batches(ext) if ext is not None else [],
        accept_by_key=accept,
        verify_batch_sizes=_verify_batch_sizes(view.table("verify")),
        wide=wide,
        verify_rounds=_verify_rounds(view.table("verify")),
    )
    if not lazy:
        data.hold_all()
    return data


def _wide_columns(
    meta: dict[str, Any], target: Any, ext: Any
) -> tuple[dict[str, str], dict[str, str]]:
    """The wide columns the trace has ({kind: column}: `aux`, or for a `--redact hidden`
    bundle `aux_sketch` and `aux_stats`; `hidden_in`), and what is missing and why. They are
    read later, only at the committed rows (`WideReader`): not the rejected drafts, and never
    the whole column at once."""
    tok_cols = target.columns.get("tok", [])
    aux_name = "aux_hidden" if "aux_hidden" in tok_cols else None
    sketch_name = (
        "aux_hidden_sketch" if aux_name is None and "aux_hidden_sketch" in tok_cols else None
    )
    stats_name = "aux_hidden_stats" if aux_name is None and "aux_hidden_stats" in tok_cols else None
    redacted = "hidden" in (
        ((meta.get("static") or {}).get("bundle") or {}).get("redaction") or {}
    ).get("modes", ())
    why = "redacted by `hstrace bundle --redact hidden`" if redacted else "absent (not recorded)"
    missing: dict[str, str] = {}
    if aux_name is None:
        missing["target.aux_hidden"] = why + (
            ": slot checks use the kept per-slot sketches (cosines approximate)"
            if sketch_name is not None
            else ": no slot checks"
        )
    if ext is None or ext.num_steps == 0:
        missing["draft_extend"] = "absent: no engine-vs-reference comparison"
    elif "hidden_in" not in ext.columns.get("tok", []):
        missing["draft_extend.hidden_in"] = (
            f"{why}: no engine-vs-reference comparison and no what-if search (the drafter "
            "needs the hidden input itself)"
        )
    present = {
        kind: name
        for kind, name in (
            ("aux", aux_name),
            ("aux_sketch", sketch_name),
            ("aux_stats", stats_name),
        )
        if name is not None
    }
    if ext is not None and "hidden_in" in ext.columns.get("tok", []):
        present["hidden_in"] = "hidden_in"
    return present, missing


@dataclass
class _Committed:
    """The target table's narrow columns, and per request the row committed at each position
    (a verify round commits its first 1 + accept_len rows; the rest were rejected drafts)."""

    ids: np.ndarray  # tok: input_ids
    rows: dict[int, dict[int, int]]  # key -> position -> tok row (the committed one)
    chunks: dict[int, list[tuple[int, int]]]  # key -> prefill chunks [start, end)
    step_of_row: np.ndarray  # tok row -> target step


def _committed_rows(target: Any, accept: dict[int, list[int]]) -> _Committed:
    modes = _np(target.column("step", "mode")).astype(np.int64)
    ids = _np(target.column("tok", "input_ids")).astype(np.int64)
    pos = _np(target.column("tok", "positions")).astype(np.int64)
    rows: dict[int, dict[int, int]] = {}
    seen_verify: dict[int, int] = {}
    chunks: dict[int, list[tuple[int, int]]] = {}
    step_of_row = np.zeros(len(pos), dtype=np.int64)
    for s, key, a, b in _per_request_blocks(target):
        step_of_row[a:b] = s
        if modes[s] != MODE_VERIFY and b > a:
            chunks.setdefault(key, []).append((int(pos[a]), int(pos[b - 1]) + 1))
        n_keep = b - a
        if modes[s] == MODE_VERIFY and key in accept:
            i = seen_verify.get(key, 0)
            seen_verify[key] = i + 1
            if i < len(accept[key]):
                n_keep = min(n_keep, 1 + accept[key][i])
        by_pos = rows.setdefault(key, {})
        for row in range(a, a + n_keep):
            by_pos[int(pos[row])] = row
    return _Committed(ids, rows, chunks, step_of_row)


def _request(
    key: int, by_pos: dict[int, int], committed: _Committed, info: dict[str, Any]
) -> ServingRequest:
    """One request's committed sequence: the contiguous run from its first target row, with a
    prefix-cache hit's cached prompt prefix put back in front (it has no target rows)."""
    positions = np.array(sorted(by_pos), dtype=np.int64)
    # Positions between the first and the last target row that have none: a capture that
    # missed them (named by replay), not a cached prefix.
    gaps = [
        [int(positions[i]) + 1, int(positions[i + 1]) - 1]
        for i in np.flatnonzero(np.diff(positions) != 1)
    ]
    # Only the contiguous run from the first position is a sequence we can align.
    contiguous = np.flatnonzero(np.diff(positions) != 1)
    if contiguous.size:
        positions = positions[: contiguous[0] + 1]
    idx = np.array([by_pos[p] for p in positions], dtype=np.int64)
    tokens, base, start = committed.ids[idx], int(positions[0]) if len(positions) else 0, 0
    prompt = info.get("prompt")
    if base > 0 and prompt is not None and _continues(prompt, base, tokens):
        # A prefix-cache hit: the target ran on the suffix only, at its true positions.
        # The cached prefix is the prompt's first `base` ids; it has no target rows.
        tokens, start, base = np.concatenate([prompt[:base], tokens]), base, 0
    n_cached = info.get("n_cached")
    if start and n_cached is not None and n_cached < start:
        gaps.insert(0, [int(n_cached), start - 1])  # declared cached: fewer than skipped
    return ServingRequest(
        key=key,
        tokens=tokens,
        position_base=base,
        aux_start=start,
        n_cached=info.get("n_cached"),
        rid=info.get("rid"),
        prefill_chunks=committed.chunks.get(key, []),
        aux_steps=committed.step_of_row[idx],
        missing=gaps,
        target_rows=idx,
    )


def _aux_attrs(target: Any) -> dict[str, Any]:
    if not hasattr(target, "column_attrs"):
        return {}
    try:
        return dict(target.column_attrs("tok", "aux_hidden"))
    except (KeyError, TraceError):
        return {}


def accept_len_by_rank(trace: Any) -> dict[str, dict[str, float | int]]:
    """{rank: {verify_rows, mean_accept_len}} over every rank's `verify` table (accept_len
    excludes the bonus): with DP attention each rank serves its own requests, and an
    acceptance that depends on the rank points at a rank-coupled gather (sglang#16274)."""
    out: dict[str, dict[str, float | int]] = {}
    for r in trace.ranks:
        verify = trace.rank(r).table("verify")
        if verify is None or verify.num_steps == 0:
            continue
        lens = _np(verify.column("req", "accept_len")).astype(np.int64)
        if len(lens):
            out[str(r)] = {
                "verify_rows": len(lens),
                "mean_accept_len": round(float(lens.mean()), 4),
            }
    return out


def _verify_batch_sizes(verify: Any) -> dict[int, list[int]]:
    if verify is None or verify.num_steps == 0:
        return {}
    out: dict[int, list[int]] = {}
    for keys in _batches(verify):
        for k in keys:
            out.setdefault(k, []).append(len(keys))
    return out


def _batches(table: Any) -> list[list[int]]:
    """The req_keys of every step (the batch composition the producer recorded)."""
    off_req = table.offsets("req")
    keys = _np(table.column("req", "req_key")).astype(np.int64)
    return [
        [int(k) for k in keys[int(off_req[s]) : int(off_req[s + 1])]]
        for s in range(table.num_steps)
    ]


def _continues(prompt: np.ndarray, base: int, tokens: np.ndarray) -> bool:
    """The recorded suffix starting at position `base` is the prompt's continuation there."""
    n = min(len(prompt) - base, len(tokens))
    return len(prompt) >= base and n > 0 and bool((prompt[base : base + n] == tokens[:n]).all())


def _prompts(table: Any) -> dict[int, dict[str, Any]]:
    """Per req_key: the prompt ids, the engine's request id, and the cached prompt length when
    the producer recorded it (`requests.n_cached`, optional)."""
    if table is None or table.num_steps == 0:
        return {}
    cols = table.columns
    if "prompt_ids" not in cols.get("tok", []):
        return {}
    keys = _np(table.column("req", "req_key")).astype(np.int64)
    n_prompt = _np(table.column("req", "n_prompt")).astype(np.int64)
    prompt_ids = _np(table.column("tok", "prompt_ids")).astype(np.int64)
    cached = _col(table, "req", "n_cached")
    cached = _np(cached).astype(np.int64) if cached is not None else None
    rid_bytes, rid_len = None, None
    if "rid" in table.axes and "bytes" in cols.get("rid", []) and "rid_len" in cols.get("req", []):
        rid_bytes = _np(table.column("rid", "bytes")).astype(np.uint8)
        rid_len = _np(table.column("req", "rid_len")).astype(np.int64)
    off_req, off_tok = table.offsets("req"), table.offsets("tok")
    off_rid = table.offsets("rid") if rid_bytes is not None else None
    out: dict[int, dict[str, Any]] = {}
    for s in range(table.num_steps):
        tok = int(off_tok[s])
        rb = int(off_rid[s]) if off_rid is not None else 0
        for r in range(int(off_req[s]), int(off_req[s + 1])):
            n = int(n_prompt[r])
            info: dict[str, Any] = {"prompt": prompt_ids[tok : tok + n]}
            tok += n
            if cached is not None:
                info["n_cached"] = int(cached[r])
            if rid_bytes is not None:
                m = int(rid_len[r])
                info["rid"] = bytes(rid_bytes[rb : rb + m]).decode("utf-8", "replace")
                rb += m
            out.setdefault(int(keys[r]), info)
    return out


def _accept_lens(verify: Any) -> dict[int, list[int]]:
    if verify is None or verify.num_steps == 0:
        return {}
    off_req = verify.offsets("req")
    keys = _np(verify.column("req", "req_key")).astype(np.int64)
    lens = _np(verify.column("req", "accept_len")).astype(np.int64)
    out: dict[int, list[int]] = {}
    for s in range(verify.num_steps):
        for r in range(int(off_req[s]), int(off_req[s + 1])):
            out.setdefault(int(keys[r]), []).append(int(lens[r]))
    return out


def _draft_rows(table: Any) -> dict[int, dict[str, Any]]:
    if table is None or table.num_steps == 0:
        return {}
    # The per-row columns only: the wide ones (DRAFT_WIDE) are read at the rows kept
    # (`_fill_draft_columns`).
    cols = {name: _col(table, "tok", name) for name in ("input_ids", "positions")}
    if cols["positions"] is None or cols["input_ids"] is None:
        return {}
    positions = _np(cols["positions"]).astype(np.int64)
    step_of_row = np.zeros(len(positions), dtype=np.int64)
    per_key: dict[int, dict[int, int]] = {}
    for s, key, a, b in _per_request_blocks(table):
        by_pos = per_key.setdefault(key, {})
        step_of_row[a:b] = s
        for row in range(a, b):
            by_pos[int(positions[row])] = row  # a later extend of the same position wins
    out = {}
    for key, by_pos in per_key.items():
        idx = np.array([by_pos[p] for p in sorted(by_pos)], dtype=np.int64)
        out[key] = {n: c[idx] for n, c in cols.items()}
        out[key]["steps"] = step_of_row[idx]
        out[key]["rows"] = idx
    return out


# Draft-extend columns read at the rows a request keeps (one per position, within the committed
# sequence), after `_index_draft` has cut them, and held: k values a row. `hidden_in` is read
# later, request by request (`WideReader`).
DRAFT_TOPK = ("topk_draft_ids", "topk_target_ids", "topk_logprobs")


def _fill_draft_columns(table: Any, drafts: list[DraftRows | None]) -> None:
    kept = [d for d in drafts if d is not None]
    have = table.columns.get("tok", [])
    if not kept:
        return
    bounds = np.cumsum([0, *(len(d.rows) for d in kept)])
    for name in DRAFT_TOPK:
        if name in have:
            data = _torch(gather(table, "tok", name, np.concatenate([d.rows for d in kept])))
            for d, a, b in zip(kept, bounds[:-1], bounds[1:], strict=True):
                setattr(d, name, data[int(a) : int(b)])


def _draft_chains(ext: Any, steps: Any) -> dict[int, list[DraftChain]]:
    """Per request, each chain of `draft_step` rows (a new one starts at k = 1) paired with the
    request's last draft-extend event before it (by `seq`): the chain drafts from that event's
    top-k row. Not every extend is followed by a chain: a chunked prefill's non-final chunks
    are not (SGLang drafts only after the last chunk)."""
    if ext is None or steps is None or steps.num_steps == 0 or ext.num_steps == 0:
        return {}
    cols = steps.columns.get("tok", [])
    if not {"input_ids", "topk_draft_ids"} <= set(cols) or "step_index" not in steps.columns.get(
        "step", []
    ):
        return {}
    ext_pos = _np(ext.column("tok", "positions")).astype(np.int64)
    # The chain drafts from the extend row that produced the step-0 top-k: the last accepted
    # row. SGLang's draft extend after a verify runs all num_draft_tokens rows (the rejected
    # ones too) and records a top-k only on that row (-1 elsewhere), so it is not the block's
    # last row whenever a draft was rejected.
    ext_top = (
        _np(ext.column("tok", "topk_draft_ids")).astype(np.int64).reshape(len(ext_pos), -1)[:, 0]
        if "topk_draft_ids" in ext.columns.get("tok", [])
        else None
    )
    ext_seq = _np(ext.column("step", "seq")).astype(np.int64).reshape(-1)
    extents: dict[int, list[tuple[int, int]]] = {}  # key -> (seq, rows covered) per extend
    first: dict[int, int] = {}
    for s, key, a, b in _per_request_blocks(ext):
        if b > a:
            first.setdefault(key, int(ext_pos[a]))
            drafted = np.nonzero(ext_top[a:b] >= 0)[0] if ext_top is not None else []
            last = a + int(drafted[-1]) if len(drafted) else b - 1
            extents.setdefault(key, []).append(
                (int(ext_seq[s]), int(ext_pos[last]) - first[key] + 1)
            )
    k_of = _np(steps.column("step", "step_index")).astype(np.int64).reshape(-1)
    ids = _np(steps.column("tok", "input_ids")).astype(np.int64)
    top = _np(steps.column("tok", "topk_draft_ids")).astype(np.int64)
    lps = _col(steps, "tok", "topk_logprobs")
    lps = _np(lps).astype(np.float32) if lps is not None else None
    step_seq = _np(steps.column("step", "seq")).astype(np.int64).reshape(-1)
    raw: dict[int, list[list[tuple[int, int]]]] = {}  # key -> chains -> (k, tok row)
    starts: dict[int, list[int]] = {}  # key -> seq of each chain's first step
    for s, key, a, b in _per_request_blocks(steps):
        if b <= a:
            continue
        chains = raw.setdefault(key, [])
        if int(k_of[s]) == 1 or not chains:
            chains.append([])
            starts.setdefault(key, []).append(int(step_seq[s]))
        chains[-1].append((int(k_of[s]), a))
    out: dict[int, list[DraftChain]] = {}
    for key, chains in raw.items():
        events = extents.get(key, [])
        for chain, start in zip(chains, starts[key], strict=True):
            before = [n for q, n in events if q < start]
            if not before:
                continue
            rows = np.array([r for _k, r in chain], dtype=np.int64)
            out.setdefault(key, []).append(
                DraftChain(
                    rows=before[-1],
                    step_index=np.array([k for k, _r in chain], dtype=np.int64),
                    input_ids=ids[rows],
                    topk_draft_ids=top[rows],
                    topk_logprobs=lps[rows] if lps is not None else None,
                )
            )
    return out


def _index_draft(cols: dict[str, Any], req: ServingRequest) -> DraftRows:
    """Draft rows whose position lies within the committed sequence (the engine's own positions
    may be shifted; the sequence index is the row's rank among the request's draft rows, after
    the cached prefix: a cache hit's draft extend starts where its target rows start)."""
    n = max(0, min(len(cols["positions"]), len(req.tokens) - req.aux_start))
    return DraftRows(
        positions=_np(cols["positions"][:n]).astype(np.int64),
        input_ids=_np(cols["input_ids"][:n]).astype(np.int64),
        index=req.aux_start + np.arange(n, dtype=np.int64),
        steps=_np(cols["steps"][:n]).astype(np.int64),
        rows=np.asarray(cols["rows"][:n], dtype=np.int64),
    )
