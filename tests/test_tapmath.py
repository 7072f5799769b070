"""The tap thread's native math (hstrace/engines/_tapmath.c) against the torch route it stands
in for: the same ids, argmax and gathers bit for bit, log-sum-exp and probabilities within a
few ulps, torch's NaN/inf semantics, and torch's route where a top-k meets a tie."""

from __future__ import annotations

import pytest
import torch

from hstrace.engines import tapmath
from hstrace.engines.vllm import taps

pytestmark = pytest.mark.skipif(tapmath.native() is None, reason="_tapmath not built")


@pytest.fixture(autouse=True, params=[4, 8], ids=["4-lanes", "8-lanes"])
def lanes(request):
    """Both kernels: 4 lanes (any x86-64) and 8 (AVX2 and FMA), where this CPU has them."""
    ext = tapmath.native()
    before = ext.lanes()
    if ext.lanes(request.param) != request.param:
        pytest.skip("this CPU has no AVX2 and FMA")
    yield request.param
    ext.lanes(before)


def _torch_topk(logits: torch.Tensor, targets: torch.Tensor | None, k: int) -> dict:
    draft = logits.index_select(1, targets) if targets is not None else logits
    lse = torch.logsumexp(draft, dim=-1)
    values, idx = draft.topk(k, dim=-1)
    return {
        "topk_draft_ids": idx,
        "topk_target_ids": targets.take(idx) if targets is not None else idx,
        "topk_logprobs": values - lse.unsqueeze(1),
        "lse": lse,
    }


def _close(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """Equal up to a few float32 ulps of the larger magnitude (or of `scale`: a difference's
    error is its larger operand's), NaN and infinities in place."""
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a.isnan(), b.isnan())
    assert torch.equal(a.isinf(), b.isinf()) and torch.equal(a[a.isinf()], b[b.isinf()])
    ok = ~(a.isnan() | a.isinf())
    big = torch.maximum(a.abs(), b.abs())
    if scale is not None:
        big = torch.maximum(big, scale.expand_as(a).nan_to_num(0, 0, 0).abs())
    tol = 4 * torch.finfo(torch.float32).eps * big[ok].clamp(min=1)
    assert bool(((a[ok] - b[ok]).abs() <= tol).all()), (a[ok] - b[ok]).abs().max()


@pytest.mark.parametrize("seed", range(40))
def test_topk_matches_torch(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(1, 40, (1,), generator=g))
    cols = int(torch.randint(9, 700, (1,), generator=g))
    logits = torch.randn(rows, cols, generator=g) * float(torch.rand(1, generator=g) * 20)
    targets = None
    if seed % 2:  # a draft vocabulary read through the map, as vLLM scatters it
        n = int(torch.randint(8, cols + 1, (1,), generator=g))
        targets = torch.randperm(cols, generator=g)[:n].sort().values
    if seed % 5 == 0:  # -inf entries (masked ids), a whole row at -inf
        logits[logits < -1] = float("-inf")
        logits[0] = float("-inf") if seed % 10 == 0 else logits[0]
    if seed % 7 == 0:  # a +inf and a NaN row
        logits[rows // 2, 3] = float("inf")
        logits[-1, -1] = float("nan")
    if seed % 3 == 0 and rows > 1:  # a row stride wider than the row (a column slice)
        logits = torch.randn(rows, cols + 5, generator=g)[:, 2 : cols + 2]
    n = cols if targets is None else int(targets.shape[0])
    k = min(8, n)
    got = tapmath.topk_into(logits, targets, k)
    want = _torch_topk(logits, targets, k)
    if got is None:  # a tie: the caller's torch route (an all -inf row is all ties)
        draft = logits.index_select(1, targets) if targets is not None else logits
        top = draft.topk(min(k + 1, n), dim=-1).values
        assert bool((top[:, 1:] == top[:, :-1]).any() | top.isnan().any())
        return
    for name in ("topk_draft_ids", "topk_target_ids"):
        assert torch.equal(got[name], want[name]), name
    _close(got["lse"], want["lse"])
    _close(got["topk_logprobs"], want["topk_logprobs"], want["lse"].unsqueeze(1))


def test_topk_into_rows_of_an_extend() -> None:
    """With `dest`, each input row lands at its output row and the rest are the empty rows
    `taps._expand_topk` writes (ids -1, log-probs -inf, lse NaN)."""
    g = torch.Generator().manual_seed(1)
    logits, targets = torch.randn(3, 64, generator=g), torch.arange(0, 64, 2)
    dest = [2, 5, 9]
    got = tapmath.topk_into(logits, targets, 8, dest, 12)
    assert got is not None
    per_row = _torch_topk(logits, targets, 8)
    want = taps._expand_topk(per_row, 12, dest, 8)
    for name in ("topk_draft_ids", "topk_target_ids"):
        assert torch.equal(got[name], want[name])
    _close(got["lse"], want["lse"])
    _close(got["topk_logprobs"], want["topk_logprobs"], want["lse"].unsqueeze(1))
    assert got["lse"].isnan().sum() == 9 and bool((got["topk_draft_ids"][0] == -1).all())
    assert tapmath.topk_into(logits, targets, 8, [2, 2, 9], 12) is None  # not distinct
    with pytest.raises(ValueError, match="out of range"):
        tapmath.topk_into(logits, targets, 8, [2, 5, 12], 12)


def test_topk_tie_takes_torch_route() -> None:
    logits = torch.zeros(2, 32)  # a drafter whose hidden state is zero: every logit equal
    assert tapmath.topk_into(logits, None, 8) is None
    logits = torch.arange(64, dtype=torch.float32).repeat(2, 1)
    logits[1, 50] = logits[1, 63]  # equal values inside the top 8
    assert tapmath.topk_into(logits[:1], None, 8) is not None
    assert tapmath.topk_into(logits, None, 8) is None
    logits = torch.arange(64, dtype=torch.float32).unsqueeze(0).clone()
    logits[0, 0] = logits[0, 56]  # the 8th value, equalled outside the top 8
    assert tapmath.topk_into(logits, None, 8) is None


@pytest.mark.parametrize("seed", range(30))
def test_verify_matches_torch(seed: int) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    rows = int(torch.randint(1, 50, (1,), generator=g))
    vocab = int(torch.randint(1, 900, (1,), generator=g))
    raw = torch.randn(rows, vocab, generator=g) * 5
    proc = raw / float(torch.rand(1, generator=g) + 0.1)
    if seed % 4 == 0:  # top-k / top-p masking: -inf outside the kept set
        proc[proc < 0] = float("-inf")
    if seed % 6 == 0:
        proc[0] = float("-inf")
        proc[-1, vocab // 2] = float("nan")
    if seed % 9 == 0:
        proc[rows // 2, 0] = float("inf")
    if seed % 5 == 0 and vocab > 3:  # equal maxima: the first one
        proc[:, 1] = proc[:, 2] = 1e4
    ids = torch.randint(-3, vocab + 3, (rows,), generator=g)  # clamped, as the gathers are
    got = tapmath.verify_into(proc, raw, ids)
    assert got is not None
    p, zp, z, amax = got
    at = ids.clamp(0, vocab - 1).reshape(-1, 1)
    assert torch.equal(z, raw.gather(1, at).view(-1))
    want_zp = proc.gather(1, at).view(-1)
    assert torch.equal(zp.isnan(), want_zp.isnan())
    assert torch.equal(zp[~zp.isnan()], want_zp[~want_zp.isnan()])
    assert torch.equal(amax, proc.argmax(dim=-1))
    _close(p, (want_zp - torch.logsumexp(proc, dim=-1)).exp())


def test_not_taken() -> None:
    """What the native route does not take goes back to torch's (None), never wrong columns."""
    x = torch.randn(4, 16)
    assert tapmath.topk_into(x.double(), None, 8) is None
    assert tapmath.topk_into(x.t(), None, 8) is None  # columns not contiguous
    assert tapmath.topk_into(x, None, 17) is None
    assert tapmath.verify_into(x, x[:3], torch.zeros(4, dtype=torch.int64)) is None
    assert tapmath.verify_into(x, x, torch.zeros(4, dtype=torch.int32)) is None


def _decode_step(seed: int, batch: int = 4, k: int = 3, vocab: int = 96, vd: int = 40):
    """A decode step as vLLM's tap hands it over: every request verifies k drafts, the
    drafter's first pass samples one row per request, k-1 chain passes; logits kept for the
    tap thread in the target vocabulary (-inf outside the draft's ids)."""
    g = torch.Generator().manual_seed(seed)
    n_tok = batch * (k + 1)
    targets = torch.randperm(vocab, generator=g)[:vd].sort().values
    d2t = targets - torch.arange(vd)

    def logits(rows: int) -> torch.Tensor:
        out = torch.full((rows, vocab), float("-inf"))
        out[:, targets] = torch.randn(rows, vd, generator=g) * 3
        return out

    step = taps.Step(
        req_ids=[f"r{i}" for i in range(batch)],
        num_draft_tokens=[k] * batch,
        draft_token_ids=torch.randint(0, vocab, (batch * k,), generator=g),
        sampled=[[int(t) for t in torch.randint(0, vocab, (k + 1,), generator=g)]] * batch,
        target_ids=torch.randint(0, vocab, (n_tok,), generator=g),
        target_positions=torch.arange(n_tok),
        target_aux=torch.randn(n_tok, 3 * 8, generator=g),
        query_start=[i * (k + 1) for i in range(batch + 1)],
        sample_rows=[i * (k + 1) + k for i in range(batch)],
    )
    for j in range(k):
        rows = n_tok if j == 0 else batch
        call = taps.DraftCall(
            torch.randint(0, vocab, (rows,), generator=g),
            torch.arange(rows),
            None if j == 0 else torch.randn(batch, 8, generator=g),
        )
        call.logits, call.d2t = logits(batch), d2t
        step.calls.append(call)
    raw = torch.randn(batch * k, vocab, generator=g)
    proc = raw / 0.7
    proc[proc < -1] = float("-inf")  # a top-p cut
    step.verify_probs = taps.verify_probs(
        step.draft_token_ids, [k] * batch, raw, None, proc, None,
        {"temperature": torch.full((batch,), 0.7)}, taps.RULE_ONE_HOT,
    )  # fmt: skip
    return step


def _columns(writes) -> list[tuple[str, str, torch.Tensor]]:
    out = []
    for w in writes:
        for axis, cols in (("step", w.step or {}), ("req", w.req or {}), ("tok", w.tok or {})):
            out += [(f"{w.table}/{axis}", n, v) for n, v in cols.items()]
        for axis, cols in (w.other or {}).items():
            out += [(f"{w.table}/{axis}", n, v) for n, v in cols.items()]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_a_steps_rows_natively_equal_torchs(seed: int, monkeypatch) -> None:
    """A decode step's every table, built the way the tap thread builds it (top-k finished
    with the first call's rows placed in its extend, then `step_rows`), natively and through
    torch alone: the same tables, columns, ids and dtypes; the floats within a few ulps."""

    def rows(native: bool):
        monkeypatch.setattr(tapmath, "_ext", tapmath._UNSET if native else None)
        step = _decode_step(seed)
        taps.finish_topk(step, expand=True)
        assert step.calls[0].expanded is native
        return _columns(taps.step_rows(step, [1, 2, 3]))

    torch_cols, native_cols = rows(False), rows(True)
    assert [(t, n) for t, n, _ in native_cols] == [(t, n) for t, n, _ in torch_cols]
    for (table, name, got), (_, _, want) in zip(native_cols, torch_cols, strict=True):
        if not isinstance(got, torch.Tensor):
            assert got == want, (table, name)
        elif got.dtype.is_floating_point:
            scale = None
            if name == "topk_logprobs":  # value - lse: the lse's rounding
                lse = dict((n, v) for t, n, v in torch_cols if t == table)["lse"]
                scale = lse.unsqueeze(1)
            _close(got, want, scale)
        else:
            assert torch.equal(got, want), (table, name)


# ---- the serving thread's copies (snapshot, gather_rows, gather_at) --------------------------


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool],
)
@pytest.mark.parametrize(("length", "n"), [(0, 0), (5, 0), (7, 7), (9, 4)])
def test_a_snapshot_head_is_the_first_values_and_no_later_write_reaches_it(
    dtype, length, n
) -> None:
    g = torch.Generator().manual_seed(3)
    src = (torch.randn(length, generator=g) * 50).to(dtype)
    want = src[:n].clone()
    snap = tapmath.snapshot_head(src, n)
    assert snap is not None and not snap.is_cuda and snap.is_cpu
    src.fill_(1)  # the engine writes its persistent batch again
    got = tapmath.tensor_of(snap)
    assert got.dtype == dtype and got.shape == (n,)
    assert torch.equal(got, want)


def test_a_snapshot_head_refuses_what_its_bytes_do_not_describe() -> None:
    m = torch.arange(12.0).reshape(3, 4)
    assert tapmath.snapshot_head(m, 2) is None  # not 1-D: the caller copies through torch
    assert tapmath.snapshot_head(m[:, 1], 2) is None  # strided
    assert tapmath.snapshot_head(torch.arange(3), 4) is None  # shorter than the batch
    assert tapmath.tensor_of(m) is m and tapmath.tensor_of(None) is None


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_is_index_select_bit_for_bit(idx_dtype, dtype) -> None:
    g = torch.Generator().manual_seed(5)
    src = torch.randn(9, 40, generator=g).to(dtype)
    src[2, 3], src[4, 0] = float("nan"), float("-inf")
    for m in (src, src[:, 5:29]):  # rows contiguous, any row stride
        idx = torch.tensor([4, 0, 8, 4, 2], dtype=idx_dtype)
        got = tapmath.gather_rows(m, idx)
        want = m.index_select(0, idx)
        rows = tapmath.tensor_of(got)
        assert rows.shape == want.shape and rows.dtype == dtype
        assert torch.equal(rows.view(torch.uint8), want.view(torch.uint8))  # NaN included
    empty = tapmath.gather_rows(src, torch.zeros(0, dtype=idx_dtype))
    assert tapmath.tensor_of(empty).shape == (0, 40)


def test_gather_rows_leaves_what_it_does_not_take_to_torch() -> None:
    src = torch.randn(6, 8)
    assert tapmath.gather_rows(src, torch.tensor([6])) is None  # out of range: torch raises
    assert tapmath.gather_rows(src, torch.tensor([-1])) is None
    assert tapmath.gather_rows(src.t(), torch.tensor([0])) is None  # columns strided
    assert tapmath.gather_rows(src, torch.tensor([0, 1, 2])[::2]) is None
    assert tapmath.gather_rows(src, torch.tensor([0], dtype=torch.int16)) is None
    assert tapmath.gather_rows(src[0], torch.tensor([0])) is None  # not a matrix


@pytest.mark.parametrize("col_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("row_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_at_is_the_clamped_gather_bit_for_bit(row_dtype, col_dtype, dtype) -> None:
    g = torch.Generator().manual_seed(6)
    src = torch.randn(9, 40, generator=g).to(dtype)
    src[2, 3], src[4, 0], src[8, 39] = float("nan"), float("-inf"), float("inf")
    for m in (src, src[:, 5:29]):  # rows contiguous, any row stride
        rows = torch.tensor([4, 0, 8, 4, 2, 8], dtype=row_dtype)
        cols = torch.tensor([0, 7, 99, -5, 3, 23], dtype=col_dtype)  # clamped, as the gathers
        safe = cols.long().clamp(0, m.shape[1] - 1)
        want = m[rows.long(), safe]
        got = tapmath.tensor_of(tapmath.gather_at(m, rows, cols))
        assert got.shape == want.shape and got.dtype == dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # NaN, inf included
    empty = tapmath.gather_at(src, torch.zeros(0, dtype=row_dtype), torch.zeros(0, dtype=col_dtype))
    assert tapmath.tensor_of(empty).shape == (0,)


def test_gather_at_copies_and_leaves_what_it_does_not_take_to_torch() -> None:
    src = torch.randn(6, 8)
    rows, cols = torch.tensor([1, 5]), torch.tensor([2, 7])
    want = src[rows, cols].clone()
    snap = tapmath.gather_at(src, rows, cols)
    src.fill_(0.0)  # the engine updates its logits in place after the snapshot
    assert torch.equal(tapmath.tensor_of(snap), want)
    one = torch.tensor([0])
    assert tapmath.gather_at(src, torch.tensor([6]), one) is None  # a row out of range
    assert tapmath.gather_at(src, torch.tensor([-1]), one) is None
    assert tapmath.gather_at(src.t(), one, one) is None  # columns strided
    assert tapmath.gather_at(src, torch.tensor([0, 1, 2])[::2], torch.tensor([0, 1])) is None
    assert tapmath.gather_at(src, torch.tensor([0], dtype=torch.int16), one) is None
    assert tapmath.gather_at(src, torch.tensor([0, 1]), one) is None  # lengths differ
    assert tapmath.gather_at(src[0], one, one) is None  # not a matrix
