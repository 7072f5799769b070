"""One read of every request's captured rows, for the evidence that needs them all.

`Slots` (per-slot health over every captured row, the rows that cannot be hidden states) and
`Accuracy` (the reference drafter's step-0 accuracy on the serving capture) each look at every
captured row of every request. Holding all of them at once is what made replay's memory grow
with the trace (a mostly-prefill trace is almost all aux rows), so both are computed in one
walk here: the requests go in the batches the drafter runs them in (`plan_batches`), each
batch's rows are read, used by both, and released; only per-row numbers (norms, predictions)
and per-request results are kept. Requests the drafter does not run follow, a few at a time.

Computed on first use and memoised (a pure value of the alignment), so whichever piece asks
first, the answers are the same; a failure inside one part is raised to the piece that asks
for that part (its `Unavailable` notes it), never to the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from hstrace.reference.step0 import DEFAULT_BATCH_TOKENS, Step0Input, plan_batches
from hstrace.replay.compare import agreement
from hstrace.replay.fingerprint import SlotHealth, SlotHealthSum
from hstrace.replay.serving import ServingRequest
from hstrace.replay.sides import Alignment


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
        """The step-0 items `Accuracy` runs on the serving capture (the same ones, in the same
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
        except Exception as exc:  # noqa: BLE001 -- re-raised to Accuracy, which notes it
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
                    except Exception as exc:  # noqa: BLE001 -- re-raised to Accuracy
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
