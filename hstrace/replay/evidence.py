"""The typed evidence a replay hands to the checks (entry `build_evidence`): the compare and
what-if stages run here, once, in dataflow order; read-only after.

`build_evidence` computes every piece (the alignment, `Slots`, `Step0Accuracy`, `Agreement`, the
what-if search `WhatIfSearch`, `DraftInputs`, `VocabReadings`, `BatchCoupling`) before any
check runs.
The serving side's wide tensors are read while a piece walks a batch of requests and released
after (`ServingData.holding`): the evidence keeps per-row numbers and per-request results, so
its memory follows the largest batch of requests, not the trace.
What could not be computed, and why, is decided while a piece is built and kept in it
(`unavailable`); the replay's `skipped` is their union in build order, so it never depends on
which check looked first, and a check only reads evidence and returns findings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hstrace.reference.target import ReferenceTarget
from hstrace.replay.accuracy import Step0Accuracy, build_accuracy
from hstrace.replay.agreement import Agreement, build_agreement
from hstrace.replay.align import TWIN_FORMAT, AlignedPair, Alignment, Coverage, Match
from hstrace.replay.fed import (
    BatchCoupling,
    DraftInputs,
    VocabReadings,
    build_batch_coupling,
    build_draft_inputs,
    build_vocab_readings,
)
from hstrace.replay.impact import Chains, build_chains
from hstrace.replay.ranks import RankComparison, build_ranks
from hstrace.replay.read import ServingData
from hstrace.replay.runner import CaptureScan, DrafterRunner
from hstrace.replay.slots import Slots, build_slots
from hstrace.replay.unavailable import Unavailable, merged
from hstrace.replay.verify import SampledAcceptance, build_sampled_acceptance
from hstrace.replay.whatif import WhatIfSearch, search_whatifs


@dataclass(frozen=True)
class Evidence:
    alignment: Alignment
    runner: DrafterRunner  # the reference drafter (and the cached-span rebuild) it came from
    target: ReferenceTarget | None
    slots: Slots
    accuracy: Step0Accuracy
    agreement: Agreement
    whatif: WhatIfSearch | None  # the what-if stage (None: not run, `unavailable` says why)
    draft_inputs: DraftInputs
    vocab: VocabReadings
    batch: BatchCoupling
    # Each verify's rule: predicted vs realized acceptance, the target's transforms recomputed.
    sampled: SampledAcceptance
    # The greedy chains as served and as trained, for the impact stage (`replay.impact`).
    chains: Chains | None = None
    # Accept lengths per DP rank beside rank 0's replay (only with more than one rank).
    accept_len_by_rank: dict[str, Any] = field(default_factory=dict)
    # Every rank next to rank 0 (None: one rank, or the comparison could not be built).
    ranks: RankComparison | None = None
    # Everything that could not be checked, and why: the replay's `skipped`.
    unavailable: dict[str, str] = field(default_factory=dict)
    # The traffic's stages that were not judged, on which requests, and why (`not_judged_of`).
    not_judged: list[dict[str, Any]] = field(default_factory=list)

    # -- what was judged -------------------------------------------------------------------------
    def judged(self) -> dict[str, dict[str, int]]:
        """Per stage of the traffic, what it was judged on: `target-capture` (serving aux slots
        next to a training twin or a reference twin from the target's forward), `draft-input`
        (the fed tokens and positions), `draft-logits` (engine vs reference drafter on the
        engine's recorded inputs). A stage is absent when nothing of it was judged."""
        out: dict[str, dict[str, int]] = {}
        if self.slots.matrix is not None:
            twins = sum(_is_twin(a.sample) for a in self.aligned)
            out["target-capture"] = {
                "requests": len(self.aligned),
                "against_training": len(self.aligned) - twins,
                "against_target_forward": twins,
                "tokens": sum(a.n - a.start for a in self.aligned),
            }
        rows = self.agreement.rows
        if self.draft_inputs.token_agreement_by_shift is not None and rows is not None:
            out["draft-input"] = {
                "requests": len(self.agreement.requests),
                "rows": int(len(rows.positions)),
            }
        evr = self.agreement.engine_vs_reference
        if evr is not None:
            out["draft-logits"] = {"requests": len(self.agreement.requests), "rows": evr.rows}
        return out

    # -- the inputs, as checks read them ---------------------------------------------------------
    @property
    def serving(self) -> ServingData:
        return self.alignment.serving

    @property
    def static(self) -> dict[str, Any]:
        return self.serving.static

    @property
    def drafter(self) -> torch.nn.Module | None:
        return self.runner.drafter

    @property
    def cfg(self) -> Any:
        return self.runner.cfg

    @property
    def load_report(self) -> Any:
        return self.runner.load_report

    @property
    def no_forward(self) -> str | None:
        return self.runner.no_forward

    @property
    def aligned(self) -> list[AlignedPair]:
        return self.alignment.aligned

    @property
    def sketched(self) -> bool:
        return self.alignment.sketched

    @property
    def slot_width(self) -> int | None:
        return self.alignment.slot_width

    @property
    def serving_width(self) -> int | None:
        return self.alignment.serving_width

    @property
    def fc_in(self) -> int | None:
        return self.alignment.fc_in

    def metrics_json(self) -> dict[str, Any]:
        """The replay's metrics, from the evidence alone (in a fixed order)."""
        out: dict[str, Any] = {}
        if self.accept_len_by_rank:
            out["accept_len_by_rank"] = self.accept_len_by_rank
        if self.ranks is not None:
            out["ranks"] = self.ranks.to_json()
        out.update(self.draft_inputs.to_json())
        out.update(self.vocab.to_json())
        out.update(self.batch.to_json())
        out.update(self.sampled.to_json())
        if self.whatif is not None:
            out["whatif"] = self.whatif.to_json()
        if self.agreement.cache is not None:
            out["engine_vs_reference_by_cache"] = self.agreement.cache.split
        out.update(self.accuracy.to_json())
        a = self.agreement.to_json()
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

    def fingerprints_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.slots.matrix is not None:
            out["serving_x_training"] = self.slots.matrix.to_json()
        if self.slots.fingerprints is not None:
            out["serving_layers"] = self.slots.fingerprints[0].to_json()
            out["training_layers"] = self.slots.fingerprints[1].to_json()
        return out


def build_evidence(
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
    notes: dict[str, str] | None = None,
    accept_len_by_rank: dict[str, Any] | None = None,
    other_ranks: dict[int, ServingData] | None = None,
    views: dict[int, Any] | None = None,
    untwinned: dict[str, str] | None = None,
) -> Evidence:
    """Every piece of evidence, in dataflow order. `notes`: what the caller already knows
    cannot be checked (a stream missing from the trace, a target that failed to load).
    `views`: every rank's trace view (rank -> view) and `other_ranks` the other ranks' serving
    data (rank -> data), for the comparison of the ranks (`replay.ranks`). `untwinned`:
    request name -> why it has neither a training twin nor a reference twin."""
    cfg = drafter.cfg if drafter is not None else None
    alignment = Alignment.build(serving, samples, matches, coverage, cfg, training_kind)
    runner = DrafterRunner(drafter, alignment, load_report, no_forward, progress)
    # The aligned requests' rows are held while the evidence is built: they are compared with
    # the training samples (in memory already, as many rows) by several pieces. Every other
    # request's wide tensors are read when a piece walks it and released after.
    with serving.holding([a.serving for a in alignment.aligned]):
        scan = CaptureScan(runner)  # one read of every request's captured rows
        slots = build_slots(alignment, cfg, load_report, target, runner.tick, scan)
        accuracy = build_accuracy(runner, target, scan)
        agreement = build_agreement(runner)
        searched = Unavailable()
        whatif = None
        if runner.can_run and agreement.rows is not None and agreement.rows.hidden_recorded:
            whatif = searched.guarded(
                "what-if search",
                lambda: search_whatifs(
                    runner, agreement, target, slots.training_layers, accuracy.training_step0
                ),
            )
        draft_inputs = build_draft_inputs(serving, agreement.rows, agreement.requests, target)
        vocab = build_vocab_readings(drafter, agreement.rows)
        batch = build_batch_coupling(alignment)
        chains = searched.guarded(
            "impact",
            lambda: build_chains(
                runner,
                alignment.aligned,
                target,
                serving.static,
                whatif.served_model if whatif is not None and whatif.ran else None,
                whatif.best.name if whatif is not None and whatif.best is not None else None,
                served_reading(vocab),
                serving.accept_by_key,
            ),
        )
    sampled = build_sampled_acceptance(serving)
    ranks = None
    if views and len(views) > 1:
        by_rank = {0: serving, **(other_ranks or {})}
        draft_vocab = int(getattr(cfg, "draft_vocab_size", 0) or 0) or None
        ranks = searched.guarded(
            "rank comparison", lambda: build_ranks(by_rank, views, draft_vocab)
        )
    if serving.wide is not None:
        serving.wide.window.clear()  # the last window read: not needed by any check
    first = {"drafter forward": no_forward} if no_forward else {}
    return Evidence(
        alignment=alignment,
        runner=runner,
        target=target,
        slots=slots,
        accuracy=accuracy,
        agreement=agreement,
        whatif=whatif,
        draft_inputs=draft_inputs,
        vocab=vocab,
        batch=batch,
        chains=chains,
        sampled=sampled,
        accept_len_by_rank=dict(accept_len_by_rank or {}),
        ranks=ranks,
        unavailable=merged(
            first,
            notes or {},
            slots,
            accuracy,
            agreement,
            searched.frozen(),
            draft_inputs,
            vocab,
            batch,
            sampled,
            ranks.unavailable if ranks is not None else {},
            # why a fault has no impact is said on the finding (`impact_unavailable`), not here
        ),
        not_judged=not_judged_of(
            untwinned or {}, len(alignment.aligned), slots, draft_inputs, agreement, no_forward
        ),
    )


def _is_twin(sample: Any) -> bool:
    return (getattr(sample, "provenance", None) or {}).get("format") == TWIN_FORMAT


def not_judged_of(
    untwinned: dict[str, str],
    aligned: int,
    slots: Slots,
    draft_inputs: DraftInputs,
    agreement: Agreement,
    no_forward: str | None,
) -> list[dict[str, Any]]:
    """The stages of the traffic not judged, and why: `{stage, what, requests, n_requests,
    why}` (requests: at most 20 names; none when the stage was not judged on any)."""
    out: list[dict[str, Any]] = []
    by_why: dict[str, list[str]] = {}
    for name, why in untwinned.items():
        by_why.setdefault(why, []).append(name)
    for why, names in by_why.items():
        out.append(
            {
                "stage": "target-capture",
                "what": "capture layers (the serving aux slots next to what training fed the "
                "drafter), step-0 accuracy and impact",
                "requests": names[:20],
                "n_requests": len(names),
                "why": why,
            }
        )
    why_slots = slots.unavailable.get("slot fingerprints")
    if slots.matrix is None and why_slots and (aligned or not untwinned):
        out.append(  # requests with a twin (or none without), yet no slot could be compared
            {
                "stage": "target-capture",
                "what": "capture layers (the serving aux slots next to what training fed the "
                "drafter)",
                "requests": [],
                "n_requests": 0,
                "why": why_slots,
            }
        )
    if draft_inputs.token_agreement_by_shift is None:
        out.append(
            {
                "stage": "draft-input",
                "what": "draft inputs (fed tokens and positions)",
                "requests": [],
                "n_requests": 0,
                "why": draft_inputs.unavailable.get("token pairing")
                or agreement.unavailable.get("engine vs reference")
                or "the trace has no draft_extend rows",
            }
        )
    if agreement.engine_vs_reference is None:
        out.append(
            {
                "stage": "draft-logits",
                "what": "draft logits (engine vs reference drafter on identical inputs)",
                "requests": [],
                "n_requests": 0,
                "why": no_forward
                or agreement.unavailable.get("engine vs reference")
                or "the trace has no recorded draft hidden input",
            }
        )
    return out


def served_reading(vocab: VocabReadings) -> str | None:
    """How the engine read `d2t`: the reading that explains its proposed ids, when offsets do
    not (None: not recorded)."""
    from hstrace.replay.compare import AGREE_TOP1

    if vocab.scores is None:
        return None
    best = max(vocab.scores, key=vocab.scores.get)
    if vocab.scores.get("offsets", 0.0) >= AGREE_TOP1 or vocab.scores[best] < AGREE_TOP1:
        return "offsets"
    return best
