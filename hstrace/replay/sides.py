"""The serving/training alignment every piece of evidence is computed from: which serving
request lines up with which training sample, how the serving capture is shaped (raw aux rows
or, for a `--redact hidden` bundle, per-slot sketches: chosen once, here), and the slot views
of both sides on the aligned tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hstrace.replay.align import Coverage, Match
from hstrace.replay.serving import ServingData, ServingRequest


@dataclass(frozen=True)
class Aligned:
    serving: ServingRequest
    sample: Any  # hstrace.training.TrainingSample
    n: int  # aligned positions 0..n-1 (the tokens agree on all of them)
    # Positions start..n-1 have a serving capture (start > 0: a prefix-cache hit, the cached
    # span has none); slot comparisons use these rows only.
    start: int = 0


@dataclass(frozen=True)
class Alignment:
    serving: ServingData
    samples: list[Any]
    matches: list[Match]
    coverage: Coverage
    aligned: list[Aligned]
    training_kind: str  # "training" (a dump) or "trace" (a second trace as the samples)
    # Serving hidden states were redacted; per-slot sketches stand in for them (both sides
    # are then compared as sketches).
    sketched: bool
    sketch_slot_width: int | None  # the slot width the serving sketches were projected from
    serving_width: int | None  # width of the recorded capture (sketched: before redaction)
    slot_width: int | None  # the drafter's aux width, else the training slots' width
    fc_in: int | None  # the drafter's fc input width (num_aux * aux_width)
    # The dtype the target was served in, as the recorded aux rows carry it (a producer
    # writes them as served, docs/trace-format.md); bf16 when nothing says (a bundle's
    # sketches, no aux rows): what engines serve in.
    serving_dtype: torch.dtype

    @classmethod
    def build(
        cls,
        serving: ServingData,
        samples: list[Any],
        matches: list[Match],
        coverage: Coverage,
        cfg: Any,
        training_kind: str = "training",
    ) -> Alignment:
        aligned = []
        for m in matches:
            req, sample = serving.requests[m.serving], samples[m.training]
            n = min(m.length, req.aux_end, int(sample.aux.shape[0]))
            if n > req.aux_start:
                aligned.append(Aligned(req, sample, n, start=req.aux_start))
        reqs = serving.requests
        sketched = (
            bool(reqs) and not any(r.has_aux for r in reqs) and any(r.has_sketch for r in reqs)
        )
        w = serving.sketch_attrs.get("slot_width")
        sketch_slot_width = int(w) if w else None
        if cfg is not None:
            slot_width: int | None = int(cfg.aux_width)
        elif samples:
            slot_width = int(samples[0].aux.shape[-1])
        else:
            slot_width = None
        return cls(
            serving=serving,
            samples=samples,
            matches=matches,
            coverage=coverage,
            aligned=aligned,
            training_kind=training_kind,
            sketched=sketched,
            sketch_slot_width=sketch_slot_width,
            serving_width=_serving_width(serving, sketched, sketch_slot_width),
            slot_width=slot_width,
            fc_in=int(cfg.num_aux * cfg.aux_width) if cfg is not None else None,
            serving_dtype=_serving_dtype(serving, sketched),
        )

    def serving_slots_of(self, r: ServingRequest, n: int | None = None) -> torch.Tensor:
        """[m, K, Ht] serving slots of one request up to sequence index n (its captured rows:
        from r.aux_start on), or [m, K, D] sketches when redacted."""
        stop = None if n is None else max(0, n - r.aux_start)
        if self.sketched:
            x = r.sketch_head(stop)
            return x.reshape(len(x), -1, int(self.serving.sketch_attrs.get("sketch_dim", 32)))
        x = r.aux_head(stop).float()
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


def _serving_width(serving: ServingData, sketched: bool, slot_width: int | None) -> int | None:
    if sketched:
        from hstrace.redaction import SKETCH_DIM

        dim = int(serving.sketch_attrs.get("sketch_dim") or SKETCH_DIM)
        widths = {r.width("aux_sketch") // dim for r in serving.requests if r.has_sketch}
        return widths.pop() * slot_width if len(widths) == 1 and slot_width else None
    widths = {r.width("aux") for r in serving.requests if r.has_aux}
    return widths.pop() if len(widths) == 1 else None


def _serving_dtype(serving: ServingData, sketched: bool) -> torch.dtype:
    if not sketched:
        for r in serving.requests:
            if r.has_aux and r.dtype("aux").is_floating_point:
                return r.dtype("aux")
    return torch.bfloat16
