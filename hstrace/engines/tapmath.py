"""The vLLM tap thread's per-row math through the optional native module (`_tapmath.c`), and
three of the serving thread's copies through it (`gather_rows`, `gather_at`, `snapshot_head`:
bytes, made tensors by `tensor_of` on the tap thread).

Each function returns the columns the torch route (`hstrace.engines.vllm.taps`) computes, or
None where it does not take the inputs (not built, `HSTRACE_NATIVE=0`, a CUDA tensor, another
dtype, rows not contiguous, a tie in a top-k): the caller then takes the torch route, which is
also the reference the native route is tested against (tests/test_tapmath.py). Inputs are
checked here (device, dtype, strides, shapes) before an address reaches C; outputs are fresh
tensors.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_UNSET: Any = object()
_ext: Any = _UNSET


def native() -> Any:
    """The built module, or None (not built, or HSTRACE_NATIVE=0 at the first call)."""
    global _ext
    if _ext is _UNSET:
        ext = None
        if os.environ.get("HSTRACE_NATIVE", "1") != "0":
            try:
                from hstrace.engines import _tapmath as ext
            except ImportError:
                ext = None
        _ext = ext
    return _ext


def _rows_of(t: torch.Tensor) -> bool:
    """A CPU float32 matrix whose rows are each contiguous (any row stride)."""
    return t.is_cpu and t.dtype is torch.float32 and t.dim() == 2 and t.stride(1) == 1


def topk_into(
    logits: torch.Tensor,
    targets: torch.Tensor | None,
    k: int,
    dest: list[int] | None = None,
    n_out: int | None = None,
) -> dict[str, torch.Tensor] | None:
    """`taps.draft_topk`'s columns of `logits` ([R, C], R >= 1) read through `targets` (int64
    [n]: the columns that are the draft vocabulary; None: all C), k <= n: topk_draft_ids,
    topk_target_ids, topk_logprobs ([rows, k]) and lse ([rows]). With `dest` (R distinct rows
    of `n_out`), row r lands at dest[r] and every other row is the empty row (ids -1,
    log-probs -inf, lse NaN), as `taps._expand_topk` writes a draft extend."""
    ext = native()
    if ext is None or not _rows_of(logits):
        return None
    rows, cols = logits.shape
    if targets is not None:
        if not (targets.is_cpu and targets.dtype is torch.int64 and targets.dim() == 1):
            return None
        if not targets.is_contiguous():
            return None
        n, map_ptr = int(targets.shape[0]), targets.data_ptr()
    else:
        n, map_ptr = int(cols), 0
    if not 1 <= k <= n or rows < 1:
        return None
    if dest is None:
        n_out = rows
    elif n_out is None or len(dest) != rows or len(set(dest)) != rows:
        return None
    ids = torch.empty((n_out, k), dtype=torch.int64)
    tids = torch.empty((n_out, k), dtype=torch.int64)
    lps = torch.empty((n_out, k), dtype=torch.float32)
    lse = torch.empty((n_out,), dtype=torch.float32)
    tie = ext.topk_into(
        logits.data_ptr(), rows, logits.stride(0), cols, map_ptr, n, k, dest, n_out,
        ids.data_ptr(), tids.data_ptr(), lps.data_ptr(), lse.data_ptr(),
    )  # fmt: skip
    if tie:  # torch's order among equal values is torch's: its route
        return None
    return {"topk_draft_ids": ids, "topk_target_ids": tids, "topk_logprobs": lps, "lse": lse}


def verify_into(
    proc: torch.Tensor, raw: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`taps.verify_probs`' per-token columns over [N, V] rows: p(token) under the processed
    rows, the processed and the raw logit at the token, and the processed rows' argmax (`ids`,
    int64 [N], clamped to the vocabulary as the gathers index)."""
    ext = native()
    if ext is None or not (_rows_of(proc) and _rows_of(raw)) or proc.shape != raw.shape:
        return None
    if not (ids.is_cpu and ids.dtype is torch.int64 and ids.is_contiguous()):
        return None
    rows, vocab = proc.shape
    if ids.numel() != rows or rows < 1:
        return None
    p = torch.empty(rows, dtype=torch.float32)
    zp = torch.empty(rows, dtype=torch.float32)
    z = torch.empty(rows, dtype=torch.float32)
    amax = torch.empty(rows, dtype=torch.int64)
    ext.verify_into(
        proc.data_ptr(), proc.stride(0), raw.data_ptr(), raw.stride(0), rows, vocab,
        ids.data_ptr(), p.data_ptr(), zp.data_ptr(), z.data_ptr(), amax.data_ptr(),
    )  # fmt: skip
    return p, zp, z, amax


class Snap:
    """Bytes of a CPU tensor, copied on the serving thread (`gather_rows`, `snapshot_head`)
    into a bytearray the engine cannot reach; `tensor_of` makes them a tensor (on the tap
    thread: a view of those bytes, no second copy). Read as a tensor's `is_cuda` / `is_cpu`."""

    __slots__ = ("buf", "dtype", "shape")
    is_cuda = False
    is_cpu = True

    def __init__(self, buf: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.buf, self.dtype, self.shape = buf, dtype, shape

    def tensor(self) -> torch.Tensor:
        if not self.buf:  # frombuffer refuses an empty buffer
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(self.buf, dtype=self.dtype).view(self.shape)


def snapshot_head(t: torch.Tensor, n: int) -> Snap | None:
    """A copy of the first `n` values of a contiguous 1-D CPU tensor (a persistent batch's
    column, longer than the step's requests) in one native call, where torch takes a reshape,
    a slice and a stack; None (not built, HSTRACE_NATIVE=0, on a device, strided, short): the
    caller copies through torch."""
    ext = native()
    if ext is None or not t.is_cpu or t.dim() != 1 or t.shape[0] < n or t.stride(0) != 1:
        return None
    return Snap(ext.copy_out(t.data_ptr(), n * t.element_size()), t.dtype, (n,))


def _index(t: torch.Tensor) -> bool:
    """A contiguous 1-D CPU int32 or int64 tensor (an index a native call may read)."""
    return (
        t.is_cpu
        and t.dim() == 1
        and t.is_contiguous()
        and t.dtype is (torch.int64 if t.element_size() == 8 else torch.int32)
    )


def gather_rows(src: torch.Tensor, idx: torch.Tensor) -> Snap | None:
    """`src.index_select(0, idx)`'s bytes ([len(idx), C]) in one native call, for a CPU matrix
    whose rows are each contiguous and CPU int32/int64 indices; None where it does not take
    them (or an index is out of range: torch's route then raises as the engine would). Cold,
    on the serving thread after the engine's sampler, vLLM's int32 indices made int64 and an
    index_select cost 25-35 us; this about 15 (bench/README.md, nineteenth pass)."""
    ext = native()
    if ext is None or not src.is_cpu or src.dim() != 2 or src.stride(1) != 1 or not _index(idx):
        return None
    isz = idx.element_size()
    rows, cols = src.shape
    es, n = src.element_size(), idx.shape[0]
    buf = ext.gather_rows(
        src.data_ptr(), rows, src.stride(0) * es, cols * es, idx.data_ptr(), isz, n
    )
    return None if buf is None else Snap(buf, src.dtype, (n, cols))


def gather_at(src: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> Snap | None:
    """`src[rows[i], cols[i].clamp(0, C - 1)]` for each i ([n] values of `src`'s dtype) in one
    native call, for a CPU matrix whose rows are each contiguous and CPU int32/int64 `rows` and
    `cols` of equal length (the columns clamped as the verify's gathers clamp a drafted id);
    None where it does not take them (or a row is out of range: torch's route then raises as
    the engine would). A verify's raw logit at each drafted token: n values copied where the
    drafted rows whole were n rows of the vocabulary (bench/README.md, thirty-second pass)."""
    ext = native()
    if ext is None or not src.is_cpu or src.dim() != 2 or src.stride(1) != 1:
        return None
    if not (_index(rows) and _index(cols)) or rows.shape != cols.shape:
        return None
    n_rows, n_cols = src.shape
    if n_cols < 1:
        return None
    es, n = src.element_size(), rows.shape[0]
    buf = ext.gather_at(
        src.data_ptr(), n_rows, src.stride(0) * es, n_cols, es,
        rows.data_ptr(), rows.element_size(), cols.data_ptr(), cols.element_size(), n,
    )  # fmt: skip
    return None if buf is None else Snap(buf, src.dtype, (n,))


def tensor_of(x: Any) -> Any:
    """A `Snap` as a tensor; anything else as it is."""
    return x.tensor() if type(x) is Snap else x
