"""The reference drafter as stage compare's builders run it (after align, before the pieces):
`DrafterRunner`, and `CaptureScan`, the one read of every captured row that `Slots` and
`Step0Accuracy` share.

The reference drafter as the evidence builders run it: batched step-0 forwards, config
variants with the same weights, and the draft context of a prefix-cache hit's cached span
rebuilt from what the trace recorded.

Not evidence itself: a tool the builders share. Its only state is memoisation of pure values
(the bf16 copy, the rebuilt cached spans), so calling it in any order gives the same answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from hstrace.reference.step0 import DEFAULT_BATCH_TOKENS, Step0Input, plan_batches, step0_logits
from hstrace.replay.align import Alignment
from hstrace.replay.compare import SlotHealth, SlotHealthSum, agreement
from hstrace.replay.read import ServingRequest


# -- runner ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _CachedSpan:
    """A cache hit's cached span [stop, W]: the first rows of `source` (after the source's own
    cached span `head`, when it is a hit too), or rows of the aligned training sample."""

    stop: int
    label: str
    source: ServingRequest | None = None
    head: _CachedSpan | None = None
    training: torch.Tensor | None = None

    def rows(self) -> torch.Tensor:
        if self.source is None:
            return self.training
        o = self.source
        if self.head is None:
            return o.aux_head(self.stop)
        head = self.head.rows()
        return torch.cat([head.to(o.dtype("aux")), o.aux_head(self.stop - len(head))])[: self.stop]


class DrafterRunner:
    def __init__(
        self,
        drafter: torch.nn.Module | None,
        alignment: Alignment,
        load_report: Any = None,
        no_forward: str | None = None,
        progress: Callable[[str, int], None] | None = None,
    ) -> None:
        self.drafter = drafter.eval() if drafter is not None else None
        self.alignment = alignment
        self.load_report = load_report
        # Why the drafter must not be run (e.g. its embedding is missing): its static
        # checks still apply, its outputs would be those of random weights.
        self.no_forward = no_forward
        self._progress = progress
        self._cached_aux_memo: dict[int, _CachedSpan | None] = {}

    @property
    def cfg(self) -> Any:
        return self.drafter.cfg if self.drafter is not None else None

    @property
    def can_run(self) -> bool:
        return self.drafter is not None and not self.no_forward

    def tick(self, label: str, n: int) -> None:
        if self._progress is not None:
            self._progress(label, n)

    def run(
        self, model: torch.nn.Module, items: list[Step0Input], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Concatenated step-0 logits [R, Vd] of `model` on `items`."""
        if self.no_forward:
            raise RuntimeError(f"the drafter cannot run: {self.no_forward}")
        logits = step0_logits(model, items, dtype=dtype, on_batch=lambda n: self.tick("drafter", n))
        return torch.cat(logits) if logits else torch.zeros(0, 0)

    def variant(self, **changes: Any) -> torch.nn.Module:
        """A copy of the drafter with config changes (flags, rope, window), same weights: the
        weight tensors are shared, not copied (the what-if search holds a dozen variants while
        it walks the recorded rows), so a variant must replace a weight, never write into it."""
        from hstrace.drafter import Eagle3Drafter

        cfg = dataclasses.replace(self.drafter.cfg, **changes)
        model = Eagle3Drafter(cfg)
        state = self.drafter.state_dict()
        shared = all(t.is_contiguous() for t in state.values())
        model.load_state_dict(state, strict=False, assign=shared)
        return model.eval()

    def run_items(
        self, model: torch.nn.Module, items: list[Step0Input], dtype: torch.dtype = torch.float32
    ) -> list[torch.Tensor]:
        """`run`, split per item (each item's logits [T_i, Vd])."""
        logits = self.run(model, items, dtype=dtype)
        out, start = [], 0
        for it in items:
            n = len(it.input_ids)
            out.append(logits[start : start + n])
            start += n
        return out

    @cached_property
    def bf16(self) -> torch.nn.Module:
        return self.variant().to(torch.bfloat16)

    def map_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.drafter.draft_to_target(draft_ids)

    # -- prefix-cache hits -----------------------------------------------------------------------
    @cached_property
    def _prefix_sources(self) -> list[ServingRequest]:
        return [r for r in self.alignment.serving.requests if r.has_aux]

    def cached_span(self, r: ServingRequest) -> _CachedSpan | None:
        """Where a cache hit's cached span is rebuilt from (`cached_aux`), decided without
        reading a row: memoised, so every caller gets the same source."""
        if r.key not in self._cached_aux_memo:
            self._cached_aux_memo[r.key] = self._find_cached_span(r)
        return self._cached_aux_memo[r.key]

    def cached_aux(self, r: ServingRequest) -> tuple[torch.Tensor, str] | None:
        """[c, W] the capture of a cache hit's cached span (c = r.aux_start), rebuilt from what
        was recorded: the rows of another request of the trace with the same leading tokens
        (what the engine's cache was filled from; itself a cache hit with a shorter cached
        span is rebuilt the same way), else the aligned training sample's rows. None when
        neither holds them (the drafter's context for the hit is then unknown). Read when
        asked (only the span's rows of the source) and not kept."""
        span = self.cached_span(r)
        return (span.rows(), span.label) if span is not None else None

    def _find_cached_span(self, r: ServingRequest) -> _CachedSpan | None:
        c = r.aux_start
        if c == 0:
            return _CachedSpan(c, "none", training=torch.zeros(0, 0))
        want = np.asarray(r.tokens[:c])
        # Each cached row is fed the request's own successor token (`prefix_of`): SGLang's
        # EAGLE radix cache reuses position i only when tokens i and i+1 both match (bigram
        # keys) and vLLM drops the last matched block, so a right cache holds exactly that.
        for o in self._prefix_sources:
            if o is r or o.aux_start >= c or o.aux_end < c or len(o.tokens) < c:
                continue
            if not np.array_equal(np.asarray(o.tokens[:c]), want):
                continue
            if o.aux_start == 0:
                return _CachedSpan(c, f"recorded capture of {o.name}", source=o)
            head = self.cached_span(o)  # strictly shorter span: the recursion ends
            if head is not None:
                label = f"recorded capture of {o.name} (its cached span: {head.label})"
                return _CachedSpan(c, label, source=o, head=head)
        fc_in = self.alignment.fc_in
        for a in self.alignment.aligned:
            if a.serving is r:
                aux = a.sample.aux_concat if hasattr(a.sample, "aux_concat") else None
                if aux is not None and a.n >= c and aux.shape[-1] == fc_in:
                    dtype = r.dtype("aux") if r.has_aux else aux.dtype
                    return _CachedSpan(c, "training sample", training=aux[:c].to(dtype))
        return None

    def prefix_of(self, r: ServingRequest, read: bool = True) -> Step0Input | None:
        """The drafter's context over a cache hit's cached span: aux rows rebuilt by
        `cached_aux`, each fed its successor token, at the engine's positions. read=False:
        the same without its rows (aux None), to plan batches before anything is read."""
        c = r.aux_start
        if c == 0 or r.draft is None or not len(r.draft.positions):
            return None
        span = self.cached_span(r)
        if span is None:
            return None
        offset = int(r.draft.positions[0]) - int(r.draft.index[0])
        tok = torch.as_tensor(r.tokens).long()
        return Step0Input(tok[1 : c + 1], span.rows() if read else None, torch.arange(c) + offset)


# -- scan --------------------------------------------------------------------------------------
# One read of every request's captured rows, for the evidence that needs them all.
#
# `Slots` (per-slot health over every captured row, the rows that cannot be hidden states) and
# `Step0Accuracy` (the reference drafter's step-0 accuracy on the serving capture) each look at
# every captured row of every request. Holding all of them at once is what made replay's memory grow
# with the trace (a mostly-prefill trace is almost all aux rows), so both are computed in one
# walk here: the requests go in the batches the drafter runs them in (`plan_batches`), each
# batch's rows are read, used by both, and released; only per-row numbers (norms, predictions)
# and per-request results are kept. Requests the drafter does not run follow, a few at a time.
#
# Computed on first use and memoised (a pure value of the alignment), so whichever piece asks
# first, the answers are the same; a failure inside one part is raised to the piece that asks
# for that part (its `Unavailable` notes it), never to the other.


@dataclass
class _Part:
    """One part's result, or the exception it raised (re-raised to whoever asks)."""

    value: Any = None
    error: BaseException | None = None

    def get(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


@dataclass
class _Acc0:
    items: list[Step0Input] = field(default_factory=list)  # narrow: no aux, no prefix rows
    requests: list[ServingRequest] = field(default_factory=list)
    labels: list[torch.Tensor] = field(default_factory=list)
    with_prefix: list[bool] = field(default_factory=list)


class CaptureScan:
    def __init__(self, runner: Any) -> None:  # runner: hstrace.replay.runner.DrafterRunner
        self.runner = runner
        self.al: Alignment = runner.alignment

    # -- what the pieces read -------------------------------------------------------------------
    def health(self) -> list[SlotHealth] | None:
        return self._walk["health"].get()

    def dead_rows(self) -> list[dict[str, Any]]:
        return self._walk["dead"].get()

    def serving_acc0(self) -> tuple[float | None, bool]:
        """(acc0_serving, whether any request could be run); only when the drafter runs."""
        return self._walk["acc0"].get()

    # -- the walk ------------------------------------------------------------------------------
    def _views(self) -> tuple[bool, bool]:
        """(health from these rows, dead rows from these rows): as `Slots` and the checks
        always decided them (raw rows need a serving width that is a multiple of the slot)."""
        al = self.al
        ht = al.slot_width
        fits = not (ht is None or al.serving_width is None or al.serving_width % ht)
        reqs = al.serving.requests
        if al.sketched:
            return any(r.aux_rows for r in reqs), fits
        return fits and any(r.has_aux for r in reqs), fits

    def _acc0_plan(self) -> _Acc0 | None:
        """The step-0 items `Step0Accuracy` runs on the serving capture (the same ones, in the same
        order, as it always ran), without their rows yet."""
        runner, al = self.runner, self.al
        if not (runner.can_run and al.fc_in is not None):
            return None
        plan = _Acc0()
        for r in al.serving.requests:
            if not r.has_aux or r.width("aux") != al.fc_in:
                continue
            c = r.aux_start
            prefix = None
            if c:
                if runner.cached_span(r) is None:
                    continue  # the cached span's context is unknown
                tok = torch.as_tensor(r.tokens).long()
                prefix = Step0Input(tok[1 : c + 1], None, torch.arange(c))
            n = min(r.aux_rows, len(r.tokens) - 2 - c)
            if n <= 0:
                continue
            tok = torch.as_tensor(r.tokens).long()
            rows = torch.arange(c, c + n)
            plan.items.append(Step0Input(tok[rows + 1], None, rows, prefix=prefix))
            plan.requests.append(r)
            plan.labels.append(tok[rows + 2])
        return plan

    @cached_property
    def _walk(self) -> dict[str, _Part]:
        al, runner = self.al, self.runner
        serving = al.serving
        parts = {"health": _Part(), "dead": _Part(), "acc0": _Part()}
        plan = None
        try:
            plan = self._acc0_plan()
        except Exception as exc:  # noqa: BLE001 -- re-raised to Step0Accuracy, which notes it
            parts["acc0"].error = exc
        batches: list[list[ServingRequest]] = []
        if plan is not None and plan.items:
            for group in plan_batches(plan.items):
                batches.append([plan.requests[i] for i in group])
        done = {id(r) for b in batches for r in b}
        rest, rows = [], 0
        for r in serving.requests:  # the others, a few at a time (neighbours share chunks)
            if id(r) in done or not r.aux_rows:
                continue
            if rest and rows + r.aux_rows > DEFAULT_BATCH_TOKENS:
                batches.append(rest)
                rest, rows = [], 0
            rest.append(r)
            rows += r.aux_rows
        if rest:
            batches.append(rest)

        want_health, want_dead = self._views()
        health, first = None, None
        if want_health:
            # The spread is measured from the first captured row (in request order): its
            # request's batch goes first (the batches' order changes no result).
            first = next((r for r in serving.requests if r.aux_rows), None)
            if first is not None:
                at = next(i for i, b in enumerate(batches) if any(r is first for r in b))
                batches.insert(0, batches.pop(at))
            k = 0 if al.sketched else al.serving_width // al.slot_width
            health = SlotHealthSum(None, k)  # the first row (and a sketch's k): batch 0
        dead: dict[int, dict[str, Any]] = {}
        preds: dict[int, torch.Tensor] = {}
        kinds = ("aux_sketch",) if al.sketched else ("aux",)
        index = {id(r): i for i, r in enumerate(plan.requests)} if plan is not None else {}
        order = {id(r): i for i, r in enumerate(serving.requests)}
        for b, batch in enumerate(batches):
            with serving.holding(batch, kinds):
                if b == 0 and first is not None:
                    try:
                        row0 = al.serving_slots_of(first, first.aux_start + 1)[0]
                        health.first, health.slots = row0.float(), int(row0.shape[0])
                    except Exception as exc:  # noqa: BLE001 -- re-raised to Slots
                        parts["health"].error = exc
                for r in batch:
                    self._per_request(r, order[id(r)], health, dead if want_dead else None, parts)
                if parts["acc0"].error is None and plan is not None and id(batch[0]) in index:
                    try:
                        self._acc0_batch(plan, [index[id(r)] for r in batch], preds)
                    except Exception as exc:  # noqa: BLE001 -- re-raised to Step0Accuracy
                        parts["acc0"].error = exc
        if parts["health"].error is None:
            parts["health"].value = health.result() if health is not None else None
        if parts["dead"].error is None and want_dead:
            out = [dead[id(r)] for r in serving.requests if id(r) in dead]
            parts["dead"].value = out + _missing_rows(serving.requests)
        elif parts["dead"].error is None:
            parts["dead"].value = []
        if parts["acc0"].error is None and plan is not None:
            if not plan.items:
                parts["acc0"].value = (None, False)
            else:
                got = torch.cat([preds[i] for i in range(len(plan.items))])
                pred = runner.map_to_target(got)
                parts["acc0"].value = (agreement(pred, torch.cat(plan.labels)), True)
        return parts

    def _per_request(
        self,
        r: ServingRequest,
        order: int,
        health: SlotHealthSum | None,
        dead: dict[int, dict[str, Any]] | None,
        parts: dict[str, _Part],
    ) -> None:
        todo = [
            (name, acc)
            for name, acc in (("health", health), ("dead", dead))
            if acc is not None and parts[name].error is None
        ]
        if not todo or not r.aux_rows and (health is None or not r.has_aux):
            return
        try:
            x = self.al.serving_slots_of(r)
        except Exception as exc:  # noqa: BLE001 -- re-raised to Slots, which notes it
            for name, _acc in todo:
                parts[name].error = exc
            return
        for name, acc in todo:
            try:
                if name == "health":
                    acc.add(order, x)
                elif r.aux_rows:
                    item = _dead_in(r, x)
                    if item is not None:
                        acc[id(r)] = item
            except Exception as exc:  # noqa: BLE001
                parts[name].error = exc

    def _acc0_batch(self, plan: _Acc0, group: list[int], preds: dict[int, torch.Tensor]) -> None:
        runner = self.runner
        items = []
        for i in group:
            it, r = plan.items[i], plan.requests[i]
            prefix = it.prefix
            if prefix is not None:
                prefix = Step0Input(prefix.input_ids, runner.cached_aux(r)[0], prefix.positions)
            items.append(Step0Input(it.input_ids, r.aux[: len(it.input_ids)], it.positions, prefix))
        logits = runner.run(runner.drafter, items)
        start = 0
        for i, it in zip(group, items, strict=True):
            n = len(it.input_ids)
            preds[i] = logits[start : start + n].argmax(-1)
            start += n


def _spans(positions: list[int]) -> list[list[int]]:
    """[[first, last], ...] runs of consecutive positions."""
    out: list[list[int]] = []
    for p in positions:
        if out and p == out[-1][1] + 1:
            out[-1][1] = p
        else:
            out.append([p, p])
    return out


def _dead_in(r: ServingRequest, x: torch.Tensor) -> dict[str, Any] | None:
    """The request's captured rows that cannot be hidden states: a slot exactly zero or not
    finite (a real residual stream is never exactly zero, so even a few such rows, e.g. the
    cached prompt part zero-filled, are named row by row)."""
    zero = (x == 0).all(-1)  # [rows, K]
    bad = ~torch.isfinite(x).all(-1)
    is_dead = (zero | bad).any(-1)
    if not is_dead.any():
        return None
    idx = torch.nonzero(is_dead).flatten()
    positions = (idx + r.aux_start + r.position_base).tolist()
    slots = sorted({int(k) for k in torch.nonzero((zero | bad)[idx]).T[1].tolist()})
    item: dict[str, Any] = {
        "request": r.name,
        "positions": _spans(positions),
        "rows": int(is_dead.sum()),
        "of_rows": int(r.aux_rows),
        "slots": slots,
        "kind": "non-finite" if bool(bad[idx].any()) else "all-zero",
    }
    if r.n_cached:
        item["n_cached"] = r.n_cached
        item["within_cached_prefix"] = bool(max(positions) < r.n_cached)
    return item


def _missing_rows(requests: list[ServingRequest]) -> list[dict[str, Any]]:
    """The positions that have no target row although they should (`ServingRequest.missing`:
    a gap, or cached rows beyond the declared `n_cached`)."""
    return [
        {
            "request": r.name,
            "positions": [list(m) for m in r.missing],
            "rows": sum(b - a + 1 for a, b in r.missing),
            "of_rows": int(r.aux_rows),
            "kind": "missing",
            **({"n_cached": r.n_cached} if r.n_cached is not None else {}),
        }
        for r in requests
        if r.missing
    ]
