"""The replay context: aligned serving/training tensors, the drafter, the static audit, and the
evidence computed from them once and shared by every check (`hstrace.diagnose`).

Every piece of evidence is a lazily computed property; a check that needs what is missing
(no target model, no draft rows, widths that do not fit the drafter) gets `None` and records
why in `skipped`, so the report says what it could not check.
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
from hstrace.reference.target import ReferenceTarget
from hstrace.replay.align import Coverage, Match
from hstrace.replay.compare import LogitAgreement, agreement, agreement_by_step, compare_topk
from hstrace.replay.fingerprint import (
    LayerFingerprint,
    SlotHealth,
    SlotMatrix,
    layer_fingerprint,
    rows_of_other_requests,
    slot_health,
    slot_matrix,
)
from hstrace.replay.serving import ServingData, ServingRequest


@dataclass
class Aligned:
    serving: ServingRequest
    sample: Any  # hstrace.training.TrainingSample
    n: int  # aligned positions 0..n-1 (the tokens agree on all of them)
    # Positions start..n-1 have a serving capture (start > 0: a prefix-cache hit, the cached
    # span has none); slot comparisons use these rows only.
    start: int = 0


@dataclass
class EngineRows:
    """Every recorded draft-extend row that the reference can replay, concatenated."""

    items: list[Step0Input]  # per request, as recorded
    expected_ids: list[torch.Tensor]  # per request: committed token t+1 for row t (-1: unknown)
    topk_draft_ids: torch.Tensor  # [R, k]
    topk_target_ids: torch.Tensor | None
    topk_logprobs: torch.Tensor | None
    positions: torch.Tensor  # [R] recorded positions
    index: torch.Tensor  # [R] the row's sequence index
    steps: torch.Tensor | None = None  # [R] the draft_extend step each row was recorded in
    request: torch.Tensor | None = None  # [R] the row's request (index into engine_requests)


class ReplayContext:
    def __init__(
        self,
        serving: ServingData,
        samples: list[Any],
        matches: list[Match],
        coverage: Coverage,
        drafter: torch.nn.Module | None,
        load_report: Any = None,
        target: ReferenceTarget | None = None,
        training_kind: str = "training",
        progress: Callable[[str, int], None] | None = None,
        no_forward: str | None = None,
    ) -> None:
        self.serving = serving
        self.samples = samples
        self.matches = matches
        self.coverage = coverage
        self.drafter = drafter.eval() if drafter is not None else None
        self.load_report = load_report
        self.target = target
        self.training_kind = training_kind
        self.skipped: dict[str, str] = {}
        self.metrics: dict[str, Any] = {}
        self._progress = progress
        self._cached_aux_memo: dict[int, tuple[torch.Tensor, str] | None] = {}
        # Why the drafter must not be run (e.g. its embedding is missing): its static
        # checks still apply, its outputs would be those of random weights.
        self.no_forward = no_forward
        if no_forward:
            self.skip("drafter forward", no_forward)

    # -- basics -----------------------------------------------------------------------------
    @property
    def static(self) -> dict[str, Any]:
        return self.serving.static

    @property
    def cfg(self) -> Any:
        return self.drafter.cfg if self.drafter is not None else None

    @property
    def slot_width(self) -> int | None:
        if self.cfg is not None:
            return int(self.cfg.aux_width)
        if self.samples:
            return int(self.samples[0].aux.shape[-1])
        return None

    @property
    def fc_in(self) -> int | None:
        return int(self.cfg.num_aux * self.cfg.aux_width) if self.cfg is not None else None

    def skip(self, what: str, why: str) -> None:
        self.skipped.setdefault(what, why)

    def tick(self, label: str, n: int) -> None:
        if self._progress is not None:
            self._progress(label, n)

    # -- alignment ----------------------------------------------------------------------------
    @cached_property
    def aligned(self) -> list[Aligned]:
        out = []
        for m in self.matches:
            req, sample = self.serving.requests[m.serving], self.samples[m.training]
            n = min(m.length, req.aux_end, int(sample.aux.shape[0]))
            if n > req.aux_start:
                out.append(Aligned(req, sample, n, start=req.aux_start))
        return out

    @cached_property
    def sketched(self) -> bool:
        """Serving hidden states were redacted; per-slot sketches stand in for them."""
        reqs = self.serving.requests
        return (
            bool(reqs)
            and all(r.aux is None for r in reqs)
            and any(r.aux_sketch is not None for r in reqs)
        )

    @cached_property
    def sketch_slot_width(self) -> int | None:
        """The width of the slots the serving sketches were projected from."""
        w = self.serving.sketch_attrs.get("slot_width")
        return int(w) if w else None

    @cached_property
    def serving_width(self) -> int | None:
        """Width of the recorded capture (for a sketched bundle: the width before redaction)."""
        if self.sketched:
            from hstrace.redaction import SKETCH_DIM

            dim = int(self.serving.sketch_attrs.get("sketch_dim") or SKETCH_DIM)
            widths = {
                int(r.aux_sketch.shape[-1]) // dim
                for r in self.serving.requests
                if r.aux_sketch is not None
            }
            ht = self.sketch_slot_width
            return widths.pop() * ht if len(widths) == 1 and ht else None
        widths = {int(r.aux.shape[-1]) for r in self.serving.requests if r.aux is not None}
        return widths.pop() if len(widths) == 1 else None

    def serving_slots_of(self, r: ServingRequest, n: int | None = None) -> torch.Tensor:
        """[m, K, Ht] serving slots of one request up to sequence index n (its captured rows:
        from r.aux_start on), or [m, K, D] sketches when redacted."""
        stop = None if n is None else max(0, n - r.aux_start)
        if self.sketched:
            x = r.aux_sketch[:stop]
            return x.reshape(len(x), -1, int(self.serving.sketch_attrs.get("sketch_dim", 32)))
        x = r.aux[:stop].float()
        return x.reshape(len(x), -1, self.slot_width)

    def training_slots_of(self, a: Aligned) -> torch.Tensor:
        """[m, Kt, Ht] training slots on the aligned, captured tokens, sketched like serving if
        needed."""
        t = a.sample.aux[a.start : a.n].float()
        return self.sketch(t) if self.sketched else t

    def sketch(self, slots: torch.Tensor) -> torch.Tensor:
        """[N, K, W] -> [N, K, D]: the same seeded projection `hstrace bundle` applied."""
        from hstrace.redaction import sketch_slots

        return sketch_slots(slots).reshape(slots.shape[0], slots.shape[1], -1)

    @cached_property
    def slots(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(serving [N, Ks, Ht], training [N, Kt, Ht]) over all aligned tokens; for a bundle
        with hidden states redacted, both sides as sketches [N, K, D]."""
        ht = self.slot_width
        if not self.aligned or ht is None or self.serving_width is None:
            self.skip("slot fingerprints", "no aligned tokens with recorded aux hidden states")
            return None
        if self.sketched:
            tw = int(self.aligned[0].sample.aux.shape[-1])
            if self.sketch_slot_width != tw:
                self.skip(
                    "slot fingerprints",
                    f"serving slots were sketched from width {self.sketch_slot_width}, training "
                    f"slots are {tw} wide: sketches of different widths do not compare",
                )
                return None
        elif self.serving_width % ht:
            self.skip(
                "slot fingerprints",
                f"serving aux width {self.serving_width} is not a multiple of the slot width {ht}",
            )
            return None
        s = torch.cat([self.serving_slots_of(a.serving, a.n) for a in self.aligned])
        t = torch.cat([self.training_slots_of(a) for a in self.aligned])
        return s, t

    @cached_property
    def slot_matrix(self) -> SlotMatrix | None:
        return slot_matrix(*self.slots) if self.slots is not None else None

    @cached_property
    def serving_health(self) -> list[SlotHealth] | None:
        ht = self.slot_width
        if self.sketched:  # a zero slot sketches to zero, identical rows to identical sketches
            rows = [self.serving_slots_of(r) for r in self.serving.requests if r.aux_rows]
            return slot_health(torch.cat(rows)) if rows else None
        rows = [r.aux.float() for r in self.serving.requests if r.aux is not None]
        if not rows or ht is None or self.serving_width is None or self.serving_width % ht:
            return None
        x = torch.cat(rows)
        return slot_health(x.reshape(len(x), -1, ht))

    @cached_property
    def crossed_requests(self) -> list[tuple[int, int, float]]:
        ht = self.slot_width
        if self.slots is None or ht is None:
            return []
        s = [self.serving_slots_of(a.serving, a.n) for a in self.aligned]
        t = [self.training_slots_of(a) for a in self.aligned]
        if s and s[0].shape[1] != t[0].shape[1]:
            return []
        return rows_of_other_requests(s, t)

    @cached_property
    def target_layers(self) -> torch.Tensor | None:
        """[N, L+1, Ht] reference target forward on the aligned tokens."""
        if self.target is None:
            self.skip("layer fingerprints", "no target model (give --target DIR)")
            return None
        if not self.aligned:
            return None
        out = []
        for a in self.aligned:
            layers = self.target.forward(torch.as_tensor(a.sample.input_ids[: a.n]).long()).layers
            layers = layers[a.start :]
            out.append(self.sketch(layers.float()) if self.sketched else layers)
            self.tick("target forward", a.n)
        return torch.cat(out)

    @cached_property
    def layer_fingerprints(self) -> tuple[LayerFingerprint, LayerFingerprint] | None:
        """(serving slots, training slots) each matched to a target layer."""
        if self.slots is None or self.target_layers is None:
            return None
        if self.slots[0].shape[-1] != self.target_layers.shape[-1]:
            self.skip("layer fingerprints", "slot width differs from the target's hidden size")
            return None
        return (
            layer_fingerprint(self.slots[0], self.target_layers),
            layer_fingerprint(self.slots[1], self.target_layers),
        )

    @cached_property
    def serving_dtype(self) -> torch.dtype:
        """The dtype the target was served in, as the recorded aux rows carry it (a producer
        writes them as served, docs/trace-format.md); bf16 when nothing says (a bundle's
        sketches, no aux rows): what engines serve in."""
        if not self.sketched:
            for r in self.serving.requests:
                if r.aux is not None and r.aux.dtype.is_floating_point:
                    return r.aux.dtype
        return torch.bfloat16

    @cached_property
    def target_own_cos(self) -> list[float] | None:
        """Per serving slot: mean per-token cos(target forward in the serving dtype, fp32
        forward) at the HF layer the slot holds, on the aligned rows the slots use: how far the
        target moves from its fp32 self in that dtype alone (bf16 MoE routing flips)."""
        fps = self.layer_fingerprints
        if fps is None or self.target is None:
            return None
        if self.serving_dtype == torch.float32:
            return [1.0] * len(fps[0].layer)
        out = []
        for a in self.aligned:
            ids = torch.as_tensor(a.sample.input_ids[: a.n]).long()
            layers = self.target.layers_in(ids, self.serving_dtype)[a.start :]
            out.append(self.sketch(layers.float()) if self.sketched else layers)
            self.tick("target forward (serving dtype)", a.n)
        lowp, ref = torch.cat(out), self.target_layers
        cos = []
        for layer in fps[0].layer:
            x, y = lowp[:, layer], ref[:, layer]
            c = (x * y).sum(-1) / (x.norm(dim=-1) * y.norm(dim=-1)).clamp_min(1e-12)
            cos.append(float(c.mean()))
        return cos

    # -- the drafter on recorded inputs ----------------------------------------------------------
    @cached_property
    def engine_requests(self) -> list[ServingRequest]:
        reqs = [
            r
            for r in self.serving.requests
            if r.draft is not None and r.draft.topk_draft_ids is not None
        ]
        left = {r.key for r in self.unreplayable_hits}
        if left:
            self.skip(
                "engine vs reference (cache hits)",
                f"{len(left)} prefix-cache hit(s) left out: no recorded capture covers their "
                "cached span (no earlier request of the trace, no aligned training sample)",
            )
        holes = {r.key for r in reqs if r.missing}
        if holes:
            self.skip(
                "engine vs reference (missing rows)",
                f"{len(holes)} request(s) left out: target rows missing inside the request "
                "(hidden-corrupt names them), so their draft rows cannot be placed",
            )
        return [r for r in reqs if r.key not in left | holes]

    @cached_property
    def training_layers(self) -> list[int] | None:
        """HF indices of the training slots: fingerprinted when the target is at hand, else as
        the data or the drafter config says."""
        if self.layer_fingerprints is not None:
            return list(self.layer_fingerprints[1].layer)
        from hstrace.training.conventions import BEFORE_LAYER, hf_index

        if self.samples and self.samples[0].slot_layer_ids:
            conv = (self.samples[0].provenance or {}).get("layer_id_convention", BEFORE_LAYER)
            return [hf_index(i, conv) for i in self.samples[0].slot_layer_ids]
        if self.cfg is not None and self.cfg.aux_layer_ids:
            from hstrace.check import DIALECT_CONVENTION

            dialect = str(getattr(self.load_report, "dialect", ""))
            conv = DIALECT_CONVENTION.get(dialect, BEFORE_LAYER)
            return [hf_index(i, conv) for i in self.cfg.aux_layer_ids]
        return None

    # -- prefix-cache hits -----------------------------------------------------------------------
    @cached_property
    def _prefix_sources(self) -> list[ServingRequest]:
        return [r for r in self.serving.requests if r.aux is not None]

    def cached_aux(self, r: ServingRequest) -> tuple[torch.Tensor, str] | None:
        """[c, W] the capture of a cache hit's cached span (c = r.aux_start), rebuilt from what
        was recorded: the rows of another request of the trace with the same leading tokens
        (what the engine's cache was filled from; itself a cache hit with a shorter cached
        span is rebuilt the same way), else the aligned training sample's rows. None when
        neither holds them (the drafter's context for the hit is then unknown)."""
        if r.key in self._cached_aux_memo:
            return self._cached_aux_memo[r.key]
        got = self._rebuild_cached_aux(r)
        self._cached_aux_memo[r.key] = got
        return got

    def _rebuild_cached_aux(self, r: ServingRequest) -> tuple[torch.Tensor, str] | None:
        c = r.aux_start
        if c == 0:
            return torch.zeros(0, 0), "none"
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
                return o.aux[:c], f"recorded capture of {o.name}"
            head = self.cached_aux(o)  # strictly shorter span: the recursion ends
            if head is not None:
                rows = torch.cat([head[0].to(o.aux.dtype), o.aux])[:c]
                return rows, f"recorded capture of {o.name} (its cached span: {head[1]})"
        for a in self.aligned:
            if a.serving is r:
                aux = a.sample.aux_concat if hasattr(a.sample, "aux_concat") else None
                if aux is not None and a.n >= c and aux.shape[-1] == self.fc_in:
                    dtype = r.aux.dtype if r.aux is not None else aux.dtype
                    return aux[:c].to(dtype), "training sample"
        return None

    def prefix_of(self, r: ServingRequest) -> Step0Input | None:
        """The drafter's context over a cache hit's cached span: aux rows rebuilt by
        `cached_aux`, each fed its successor token, at the engine's positions."""
        c = r.aux_start
        if c == 0 or r.draft is None or not len(r.draft.positions):
            return None
        got = self.cached_aux(r)
        if got is None:
            return None
        offset = int(r.draft.positions[0]) - int(r.draft.index[0])
        tok = torch.as_tensor(r.tokens).long()
        return Step0Input(tok[1 : c + 1], got[0], torch.arange(c) + offset)

    @cached_property
    def unreplayable_hits(self) -> list[ServingRequest]:
        """Cache hits whose cached span no recorded capture covers: left out of the
        engine-vs-reference comparison (their drafter attended over KV we cannot rebuild)."""
        return [
            r
            for r in self.serving.requests
            if r.draft is not None
            and r.draft.topk_draft_ids is not None
            and r.draft.hidden_in is not None  # else nothing is replayed (missing says why)
            and r.aux_start > 0
            and self.cached_aux(r) is None
        ]

    @cached_property
    def engine_rows(self) -> EngineRows | None:
        reqs = self.engine_requests
        if not reqs:
            self.skip("engine vs reference", "the trace has no draft_extend rows with top-k")
            return None
        items, expected = [], []
        for r in reqs:
            d = r.draft
            items.append(
                Step0Input(
                    torch.as_tensor(d.input_ids),
                    d.hidden_in,
                    torch.as_tensor(d.positions),
                    prefix=self.prefix_of(r) if d.hidden_in is not None else None,
                )
            )
            nxt = torch.full((len(d.input_ids),), -1, dtype=torch.long)
            idx = d.index + 1
            ok = idx < len(r.tokens)
            nxt[torch.as_tensor(ok)] = torch.as_tensor(r.tokens[idx[ok]]).long()
            expected.append(nxt)

        def cat(name: str) -> torch.Tensor | None:
            parts = [getattr(r.draft, name) for r in reqs]
            return torch.cat(parts) if all(p is not None for p in parts) else None

        return EngineRows(
            items=items,
            expected_ids=expected,
            topk_draft_ids=cat("topk_draft_ids"),
            topk_target_ids=cat("topk_target_ids"),
            topk_logprobs=cat("topk_logprobs"),
            positions=torch.cat([torch.as_tensor(r.draft.positions) for r in reqs]),
            index=torch.cat([torch.as_tensor(r.draft.index) for r in reqs]),
            steps=torch.cat([torch.as_tensor(r.draft.steps) for r in reqs]),
            request=torch.cat(
                [
                    torch.full((len(r.draft.input_ids),), i, dtype=torch.long)
                    for i, r in enumerate(reqs)
                ]
            ),
        )

    def run_drafter(
        self, model: torch.nn.Module, items: list[Step0Input], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Concatenated step-0 logits [R, Vd] of `model` on `items`."""
        if self.no_forward:
            raise RuntimeError(f"the drafter cannot run: {self.no_forward}")
        logits = step0_logits(model, items, dtype=dtype, on_batch=lambda n: self.tick("drafter", n))
        return torch.cat(logits) if logits else torch.zeros(0, 0)

    @cached_property
    def fc_inputs_fit(self) -> bool:
        rows = self.engine_rows
        return (
            rows is not None
            and self.fc_in is not None
            and all(it.aux.shape[-1] == self.fc_in for it in rows.items)
        )

    @cached_property
    def reference_logits(self) -> torch.Tensor | None:
        """fp32 reference on exactly the recorded draft inputs (when fc can take them)."""
        if self.drafter is None or self.no_forward or self.engine_rows is None:
            return None
        if any(it.aux is None for it in self.engine_rows.items):
            return None  # hidden_in not recorded: serving.missing says so
        if not self.fc_inputs_fit:
            self.skip(
                "engine vs reference",
                f"recorded draft hidden input is not {self.fc_in} wide (fc's input)",
            )
            return None
        return self.run_drafter(self.drafter, self.engine_rows.items)

    @cached_property
    def agreement(self) -> LogitAgreement | None:
        if self.reference_logits is None:
            return None
        rows = self.engine_rows
        lowp = self.run_drafter(self.bf16_drafter, rows.items, dtype=torch.bfloat16)
        return compare_topk(rows.topk_draft_ids, rows.topk_logprobs, self.reference_logits, lowp)

    def chain_agreement(self, model: torch.nn.Module | None = None) -> list[dict[str, Any]]:
        """Engine vs reference top-1 at the recorded chain steps k >= 1 (`replay.chain`)."""
        from hstrace.replay.chain import chain_agreement

        if self.reference_logits is None:  # no usable recorded draft inputs (skipped says why)
            return []
        reqs = [r for r in self.engine_requests if r.chains]
        if not reqs:
            self.skip("draft steps k >= 1", "the trace has no draft_step rows to replay")
            return []
        return chain_agreement(model if model is not None else self.drafter, reqs, self.prefix_of)

    @cached_property
    def chain_by_step(self) -> list[dict[str, Any]]:
        return self.chain_agreement()

    @cached_property
    def bf16_drafter(self) -> torch.nn.Module:
        return self.variant().to(torch.bfloat16)

    def variant(self, **changes: Any) -> torch.nn.Module:
        """A copy of the drafter with config changes (flags, rope, window), same weights."""
        from hstrace.drafter import Eagle3Drafter

        cfg = dataclasses.replace(self.drafter.cfg, **changes)
        model = Eagle3Drafter(cfg)
        model.load_state_dict(self.drafter.state_dict(), strict=False)
        return model.eval()

    @cached_property
    def engine_top1(self) -> torch.Tensor | None:
        return (
            self.engine_rows.topk_draft_ids[:, 0].long() if self.engine_rows is not None else None
        )

    # -- accuracy ------------------------------------------------------------------------------
    def map_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.drafter.draft_to_target(draft_ids)

    @cached_property
    def acc0_serving(self) -> float | None:
        """Step-0 accuracy on the serving capture with the committed tokens: argmax (mapped to
        target ids) == the committed token two ahead (aux row t, fed token t+1, predicts t+2)."""
        if self.drafter is None or self.no_forward or self.fc_in is None:
            return None
        items, labels = [], []
        for r in self.serving.requests:
            if r.aux is None or r.aux.shape[-1] != self.fc_in:
                continue
            c = r.aux_start
            prefix = None
            if c:
                got = self.cached_aux(r)
                if got is None:
                    continue  # the cached span's context is unknown
                tok = torch.as_tensor(r.tokens).long()
                prefix = Step0Input(tok[1 : c + 1], got[0], torch.arange(c))
            n = min(len(r.aux), len(r.tokens) - 2 - c)
            if n <= 0:
                continue
            tok = torch.as_tensor(r.tokens).long()
            rows = torch.arange(c, c + n)
            items.append(Step0Input(tok[rows + 1], r.aux[:n], rows, prefix=prefix))
            labels.append(tok[rows + 2])
        if not items:
            if self.sketched:
                why = "hidden states redacted: the drafter needs them, sketches cannot feed fc"
            elif self.serving_width is None:
                why = "no recorded aux hidden states"
            else:
                why = (
                    f"serving aux width {self.serving_width} != the drafter's fc input {self.fc_in}"
                )
            self.skip("serving step-0 accuracy", why)
            return None
        pred = self.map_to_target(self.run_drafter(self.drafter, items).argmax(-1))
        return agreement(pred, torch.cat(labels))

    @cached_property
    def training_step0(self) -> dict[str, Any] | None:
        """Step-0 on the aligned training tensors: logits, labels (token t+2), loss mask."""
        if self.drafter is None or self.no_forward or not self.aligned:
            return None
        items, labels, masks, idx = [], [], [], []
        for a in self.aligned:
            s = a.sample
            n = min(a.n, int(s.input_ids.shape[0])) - 2
            if n <= 0:
                continue
            tok = torch.as_tensor(s.input_ids).long()
            aux = s.aux_concat if hasattr(s, "aux_concat") else s.aux.flatten(1)
            if aux.shape[-1] != self.fc_in:
                self.skip(
                    "training step-0 accuracy",
                    f"training aux width {aux.shape[-1]} != fc input {self.fc_in}",
                )
                return None
            items.append(Step0Input(tok[1 : n + 1], aux[:n], torch.arange(n)))
            labels.append(tok[2 : n + 2])
            masks.append(torch.as_tensor(s.loss_mask[2 : n + 2]).bool())
            idx.append((a, n))
        if not items:
            return None
        logits = self.run_drafter(self.drafter, items)
        return {
            "logits": logits,
            "labels": torch.cat(labels),
            "mask": torch.cat(masks),
            "rows": idx,
        }

    @cached_property
    def acc0_training(self) -> float | None:
        ts = self.training_step0
        if ts is None:
            return None
        pred = self.map_to_target(ts["logits"].argmax(-1))
        m = ts["mask"] if ts["mask"].any() else torch.ones_like(ts["mask"])
        return agreement(pred[m], ts["labels"][m])

    @cached_property
    def acc0_serving_aligned(self) -> float | None:
        """Step-0 accuracy on the serving capture, restricted to the aligned tokens (same rows,
        same labels as `acc0_training`, so the two are directly comparable)."""
        ts = self.training_step0
        if ts is None or self.sketched or self.serving_width != self.fc_in:
            return None
        items = []
        for a, n in ts["rows"]:
            tok = torch.as_tensor(a.sample.input_ids).long()
            aux = a.serving.aux[: max(0, n - a.start)]
            if a.start:  # a cache hit: its cached span as the cache holds it
                got = self.cached_aux(a.serving)
                if got is None:
                    return None
                aux = torch.cat([got[0].to(aux.dtype), aux])[:n]
            items.append(Step0Input(tok[1 : n + 1], aux, torch.arange(n)))
        pred = self.map_to_target(self.run_drafter(self.drafter, items).argmax(-1))
        m = ts["mask"] if ts["mask"].any() else torch.ones_like(ts["mask"])
        return agreement(pred[m], ts["labels"][m])

    @cached_property
    def teacher(self) -> dict[str, Any] | None:
        """The library's teacher on the aligned training rows, in both norm readings."""
        if self.target is None or self.training_step0 is None:
            return None
        ts = self.training_step0
        lasts = []
        for a, n in ts["rows"]:
            last = a.sample.last
            if last is None:
                self.skip("teacher test", "the training data stores no final state")
                return None
            lasts.append(last[1 : n + 1].float())
        last = torch.cat(lasts)
        with torch.inference_mode():
            normed = self.target.norm(last)
        head = self.target.lm_head.float()
        return {
            "last": last,
            "as_pre": normed @ head.T,  # the stored state is pre-norm: norm, then lm_head
            "as_post": last @ head.T,  # the stored state is post-norm: lm_head only
            "claimed": getattr(a.sample, "last_norm", None),
        }

    def guarded(self, what: str, compute: Callable[[], Any]) -> Any:
        """`compute()`, or None with the reason in `skipped` if it fails internally (a bug in
        one piece of evidence must not cost the report). Bad input still raises."""
        from hstrace.errors import HstraceError

        try:
            return compute()
        except HstraceError:
            raise
        except Exception as exc:
            self.skip(what, f"failed internally: {type(exc).__name__}: {exc}")
            return None

    def metrics_json(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.metrics)
        for name in ("acc0_training", "acc0_serving", "acc0_serving_aligned"):
            value = self.guarded(name, lambda name=name: getattr(self, name, None))
            if value is not None:
                out[name] = round(float(value), 6)
        a = self.guarded("engine vs reference", self._engine_vs_reference_json)
        if a is not None:
            out["engine_vs_reference_top1"] = a["top1_agreement"]
            out["engine_vs_reference_topk"] = a["topk_agreement"]
            out["engine_vs_reference_max_logprob_diff"] = a["max_logprob_diff"]
            out["engine_vs_reference"] = a
        if self.serving.accept_lens:
            out["mean_accept_len"] = round(float(np.mean(self.serving.accept_lens)), 6)
            out["accept_len_convention"] = (
                "accepted draft tokens per verify, excluding the bonus token"
            )
        return out

    def _engine_vs_reference_json(self) -> dict[str, Any] | None:
        if self.agreement is None:
            return None
        a = self.agreement.to_json()
        rows = self.engine_rows
        if rows.steps is not None and len(rows.steps) == len(rows.topk_draft_ids):
            a["by_step"] = agreement_by_step(
                rows.steps, rows.topk_draft_ids, rows.topk_logprobs, self.reference_logits
            )
        if self.chain_by_step:
            a["by_draft_step"] = self.chain_by_step
        return a
