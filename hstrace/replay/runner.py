"""The reference drafter as the evidence builders run it: batched step-0 forwards, config
variants with the same weights, and the draft context of a prefix-cache hit's cached span
rebuilt from what the trace recorded.

Not evidence itself: a tool the builders share. Its only state is memoisation of pure values
(the bf16 copy, the rebuilt cached spans), so calling it in any order gives the same answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from hstrace.reference.step0 import Step0Input, step0_logits
from hstrace.replay.serving import ServingRequest
from hstrace.replay.sides import Alignment


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
