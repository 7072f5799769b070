"""Stage compare, entry `build_agreement`: evidence `Agreement`, the reference drafter on
exactly the inputs the engine recorded (with the chains k >= 1 replayed here too).

Engine vs reference on the draft-extend rows (judged against fp32 with the bf16 spread as the
noise floor), by recorded step, on the recorded chains (steps k >= 1, and the same chains with
`feed_normed` flipped when they disagree), split by prefix-cache hit / fresh request:
computed once here, read by any check and by the what-if stage (`hstrace.replay.whatif`),
which comes after it and imports it (never back).

The drafter's recorded hidden input is read a batch of requests at a time, in the batches the
reference runs (`engine_batches`), and released after; of the reference logits only per-row
numbers are kept (`RefRows`). One read serves the fp32 and bf16 references and the chains;
the flipped chains, the zeroed-span what-if and the what-if search read the rows again, and
run only when the engine disagrees with the reference.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hstrace.reference.step0 import Step0Input, plan_batches
from hstrace.replay.compare import (
    AGREE_TOP1,
    LogitAgreement,
    RefRows,
    agreement,
    agreement_by_step,
    compare_topk,
    gap_at,
    with_topk,
)
from hstrace.replay.read import ServingRequest
from hstrace.replay.runner import DrafterRunner
from hstrace.replay.unavailable import Unavailable


# -- agreement ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineRows:
    """Every recorded draft-extend row that the reference can replay, concatenated."""

    # Per request, as recorded, without the hidden input (aux None; a cache hit's prefix
    # without its rows): `engine_batches` gives them whole, a batch at a time.
    items: list[Step0Input]
    expected_ids: list[torch.Tensor]  # per request: committed token t+1 for row t (-1: unknown)
    topk_draft_ids: torch.Tensor  # [R, k]
    topk_target_ids: torch.Tensor | None
    topk_logprobs: torch.Tensor | None
    positions: torch.Tensor  # [R] recorded positions
    index: torch.Tensor  # [R] the row's sequence index
    steps: torch.Tensor | None = None  # [R] the draft_extend step each row was recorded in
    request: torch.Tensor | None = None  # [R] the row's request (index into requests)
    hidden_recorded: bool = False  # every request has its recorded hidden input
    hidden_widths: frozenset[int] = frozenset()  # widths of the recorded hidden inputs
    offsets: list[int] = field(default_factory=list)  # first row of each request, and R

    def rows_of(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i + 1])


@dataclass(frozen=True)
class CacheSplit:
    """Engine vs reference on cache-hit requests and on fresh ones, apart (`draft-kv-stale`)."""

    split: dict[
        str, Any
    ]  # {cache_hit, fresh, tolerance}: the metrics' engine_vs_reference_by_cache
    # Per cache-hit request and the zeroed-cached-span what-if: only when the hits disagree.
    per_request: list[dict[str, Any]] | None = None
    zeroed_span_top1: float | None = None

    @property
    def confined_to_cache_hits(self) -> bool:
        """Fresh requests agree with the reference and cache hits do not (the what-if search and
        the weights fallback then stand aside: no single misreading explains one group only)."""
        hit, fresh = self.split["cache_hit"], self.split["fresh"]
        return hit is not None and fresh is not None and fresh["agrees"] and not hit["agrees"]


@dataclass(frozen=True, kw_only=True)
class Agreement:
    """Stage compare's evidence: built by keyword (`build_agreement`), read by the checks and
    by the what-if stage (`hstrace.replay.whatif.search_whatifs`)."""

    requests: list[ServingRequest]  # requests whose draft rows are replayed (`rows.request`)
    rows: EngineRows | None
    fc_inputs_fit: bool  # every recorded draft hidden input is fc's input width
    # fp32 reference on exactly the recorded inputs, per row (its logits are not kept)
    reference: RefRows | None
    engine_vs_reference: LogitAgreement | None
    by_step: list[dict[str, Any]] | None  # per recorded draft_extend step
    chains: list[dict[str, Any]]  # engine vs reference at chain steps k >= 1 (`replay.agreement`)
    # The same chains with `feed_normed` flipped, when the chains as trained disagree.
    chains_feed_flipped: list[dict[str, Any]] | None = None
    cache: CacheSplit | None = None
    unavailable: dict[str, str] = field(default_factory=dict)
    # sqrt(mean(hidden_in ** 2)) over every recorded row (`fc-skipped` quotes it)
    hidden_in_rms: float | None = None

    @property
    def engine_top1(self) -> torch.Tensor | None:
        return self.rows.topk_draft_ids[:, 0].long() if self.rows is not None else None

    def chains_match(self, by_step: list[dict[str, Any]]) -> bool:
        """Pooled top-1 agrees and every step's log-probs are within the step-0 tolerance
        (the bf16-vs-fp32 spread measured on the same rows)."""

        top1 = pooled(by_step)
        tol = self.engine_vs_reference.tolerance
        return (
            top1 is not None
            and top1 >= AGREE_TOP1
            and all(p["max_logit_diff"] <= tol for p in by_step)
        )

    def to_json(self) -> dict[str, Any] | None:
        """The metrics' `engine_vs_reference` block."""
        if self.engine_vs_reference is None:
            return None
        a = self.engine_vs_reference.to_json()
        if self.by_step is not None:
            a["by_step"] = self.by_step
        if self.chains:
            a["by_draft_step"] = self.chains
        return a


def build_agreement(runner: DrafterRunner) -> Agreement:
    """Stage compare: the reference on the recorded inputs, engine vs reference."""
    u = Unavailable()
    requests = _engine_requests(runner, u)
    rows = _engine_rows(runner, requests) if requests else None
    if rows is None:
        u.note("engine vs reference", "the trace has no draft_extend rows with top-k")
    fc_in = runner.alignment.fc_in
    fits = (
        rows is not None
        and fc_in is not None
        and rows.hidden_recorded
        and rows.hidden_widths <= {fc_in}
    )
    ref, evr, by_step, rms = None, None, None, None
    chains: list[dict[str, Any]] = []
    chained = [r for r in requests if r.chains]
    if runner.can_run and rows is not None and rows.hidden_recorded:
        # (hidden_in not recorded: serving.missing says so)
        if not fits:
            u.note("engine vs reference", f"recorded draft hidden input is not {fc_in} wide "
                   "(fc's input)")  # fmt: skip
            rms = _rms(runner, rows, requests)
        else:  # (the rows are fc's width: `fc-skipped` quotes no RMS)
            first = _first_pass(runner, rows, requests, chained)
            ref = first.ref
            evr = u.guarded("engine vs reference", first.compare)
            if evr is None:
                ref = None
    elif rows is not None and rows.hidden_recorded:
        rms = _rms(runner, rows, requests)
    if evr is not None and rows.steps is not None and len(rows.steps) == len(rows.topk_draft_ids):
        by_step = u.guarded(
            "engine vs reference",
            lambda: agreement_by_step(rows.steps, rows.topk_draft_ids, rows.topk_logprobs, ref),
        )
    if evr is not None:
        if not chained:
            u.note("draft steps k >= 1", "the trace has no draft_step rows to replay")
        else:
            chains = u.guarded("draft steps k >= 1", first.chain_result) or []
    a = Agreement(
        requests=requests,
        rows=rows,
        fc_inputs_fit=fits,
        reference=ref,
        engine_vs_reference=evr,
        by_step=by_step,
        chains=chains,
    )
    flipped = None
    if chains and not a.chains_match(chains):
        trained = bool(runner.cfg.feed_normed)
        flipped = u.guarded(
            "draft steps k >= 1 (feed_normed flipped)",
            lambda: _chains(runner, [r for r in requests if r.chains], feed_normed=not trained),
        )
    cache = None
    if evr is not None:
        cache = u.guarded("cache hit / miss split", lambda: _cache_split(runner, a, u))
    return dataclasses.replace(
        a, chains_feed_flipped=flipped, cache=cache, unavailable=u.frozen(), hidden_in_rms=rms
    )


def engine_batches(
    runner: DrafterRunner,
    rows: EngineRows,
    requests: list[ServingRequest],
    items: list[Step0Input] | None = None,
) -> Iterator[tuple[list[int], list[Step0Input]]]:
    """(request indices, their whole step-0 items) for each batch the reference runs `items`
    (default: every recorded request's `rows.items`) in; each batch's hidden inputs (and a
    cache hit's rebuilt span) are read for it and released when the next batch comes."""
    items = rows.items if items is None else items
    serving = runner.alignment.serving
    for group in plan_batches(items):
        held = [requests[i] for i in group]
        with serving.holding(held, ("hidden_in",)):
            yield group, [_whole(runner, items[i], requests[i]) for i in group]


def _whole(runner: DrafterRunner, item: Step0Input, r: ServingRequest) -> Step0Input:
    """A narrow item with the request's recorded hidden input and its prefix's rows."""
    prefix = runner.prefix_of(r) if item.prefix is not None else None
    return Step0Input(item.input_ids, r.draft.hidden_in, item.positions, prefix=prefix)


class _FirstPass:
    """One read of every recorded hidden input: the fp32 reference (per-row `RefRows`), the
    bf16 reference's log-probs at the engine's ids (the noise floor) and the chosen chains.
    Parts that fail keep their exception for the piece that asks."""

    def __init__(self) -> None:
        self.ref: RefRows | None = None
        self.lowp: torch.Tensor | None = None
        self.rows: EngineRows | None = None
        self.bf16_error: BaseException | None = None
        self.chain_sums = ChainSums()
        self.chain_error: BaseException | None = None

    def compare(self) -> LogitAgreement:
        if self.bf16_error is not None:
            raise self.bf16_error
        rows = self.rows
        return compare_topk(
            rows.topk_draft_ids, rows.topk_logprobs, self.ref, lowp_logprobs=self.lowp
        )

    def chain_result(self) -> list[dict[str, Any]]:
        if self.chain_error is not None:
            raise self.chain_error
        return self.chain_sums.result()


def _first_pass(
    runner: DrafterRunner,
    rows: EngineRows,
    requests: list[ServingRequest],
    chained: list[ServingRequest],
) -> _FirstPass:
    out = _FirstPass()
    out.rows = rows
    ids = rows.topk_draft_ids
    n, k = len(ids), ids.shape[1] if ids.dim() == 2 else 0
    argmax = torch.zeros(n, dtype=torch.long)
    lps = torch.zeros(n, k)
    topk = torch.zeros(n, k, dtype=torch.long)
    lowp = torch.zeros(n, k)
    picked: dict[int, list[Any]] = {}
    for r, chain in chosen_chains(chained, lambda r: runner.cached_span(r) is not None):
        picked.setdefault(id(r), []).append(chain)
    for group, items in engine_batches(runner, rows, requests):
        fp32 = runner.run_items(runner.drafter, items)
        for i, logits in zip(group, fp32, strict=True):
            at = rows.rows_of(i)
            got = RefRows.of(logits, ids[at])
            argmax[at], lps[at], topk[at] = got.argmax, got.logprobs, got.topk
        if out.bf16_error is None:
            try:
                low = runner.run_items(runner.bf16, items, dtype=torch.bfloat16)
                for i, logits in zip(group, low, strict=True):
                    lowp[rows.rows_of(i)] = RefRows.of(logits, ids[rows.rows_of(i)], False).logprobs
            except Exception as exc:  # noqa: BLE001 -- raised to `compare`, which notes it
                out.bf16_error = exc
        if out.chain_error is None:
            try:
                for i, it in zip(group, items, strict=True):
                    # the batch item's prefix: a cache hit's span, read once for all its chains
                    prefix = lambda _r, p=it.prefix: p  # noqa: E731
                    for chain in picked.get(id(requests[i]), []):
                        out.chain_sums.run(runner.drafter, requests[i], chain, prefix)
            except Exception as exc:  # noqa: BLE001 -- raised to `chain_result`
                out.chain_error = exc
    out.ref = RefRows(argmax, lps, topk)
    out.lowp = lowp
    return out


def _rms(runner: DrafterRunner, rows: EngineRows, requests: list[ServingRequest]) -> float | None:
    """sqrt(mean(hidden_in ** 2)) over every recorded row, read a request batch at a time,
    when the reference does not run on them (else its first pass has it), and only where
    `fc-skipped` quotes it: one H-wide state instead of fc's input."""
    cfg = runner.cfg
    if cfg is None or rows.hidden_widths != {int(cfg.hidden_size)}:
        return None
    squares, values = 0.0, 0
    serving = runner.alignment.serving
    batch: list[ServingRequest] = []
    for r in [*requests, None]:
        if r is not None:
            batch.append(r)
        if batch and (r is None or sum(len(b.draft.rows) for b in batch) >= 4096):
            with serving.holding(batch, ("hidden_in",)):
                for b in batch:
                    h = b.draft.hidden_in.float()
                    squares += float(h.pow(2).double().sum())
                    values += h.numel()
            batch = []
    return round(float((squares / values) ** 0.5), 4) if values else None


def _chains(
    runner: DrafterRunner, requests: list[ServingRequest], **variant: Any
) -> list[dict[str, Any]]:
    """The chosen chains rerun with a config variant (a second read of their requests' rows,
    only when the chains as trained disagree)."""
    model = runner.variant(**variant) if variant else runner.drafter
    sums = ChainSums()
    chosen = chosen_chains(requests, lambda r: runner.cached_span(r) is not None)
    serving = runner.alignment.serving
    for r in dict.fromkeys(r for r, _c in chosen):
        with serving.holding([r], ("hidden_in",)):
            prefix = runner.prefix_of(r)  # a cache hit's span, read once for its chains
            for q, chain in chosen:
                if q is r:
                    sums.run(model, r, chain, lambda _r, p=prefix: p)
    return sums.result()


def _unreplayable_hits(runner: DrafterRunner) -> list[ServingRequest]:
    """Cache hits whose cached span no recorded capture covers: left out of the
    engine-vs-reference comparison (their drafter attended over KV we cannot rebuild)."""
    return [
        r
        for r in runner.alignment.serving.requests
        if r.draft is not None
        and r.draft.topk_draft_ids is not None
        and r.draft.has_hidden  # else nothing is replayed (missing says why)
        and r.aux_start > 0
        and runner.cached_span(r) is None
    ]


def _engine_requests(runner: DrafterRunner, u: Unavailable) -> list[ServingRequest]:
    reqs = [
        r
        for r in runner.alignment.serving.requests
        if r.draft is not None and r.draft.topk_draft_ids is not None
    ]
    left = {r.key for r in _unreplayable_hits(runner)}
    if left:
        u.note(
            "engine vs reference (cache hits)",
            f"{len(left)} prefix-cache hit(s) left out: no recorded capture covers their "
            "cached span (no earlier request of the trace, no aligned training sample)",
        )
    holes = {r.key for r in reqs if r.missing}
    if holes:
        u.note(
            "engine vs reference (missing rows)",
            f"{len(holes)} request(s) left out: target rows missing inside the request "
            "(hidden-corrupt names them), so their draft rows cannot be placed",
        )
    return [r for r in reqs if r.key not in left | holes]


def _engine_rows(runner: DrafterRunner, reqs: list[ServingRequest]) -> EngineRows:
    items, expected = [], []
    for r in reqs:
        d = r.draft
        items.append(
            Step0Input(
                torch.as_tensor(d.input_ids),
                None,  # the hidden input: read a batch at a time (`engine_batches`)
                torch.as_tensor(d.positions),
                prefix=runner.prefix_of(r, read=False) if d.has_hidden else None,
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

    recorded = all(r.draft.has_hidden for r in reqs)
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
            [torch.full((len(r.draft.input_ids),), i, dtype=torch.long) for i, r in enumerate(reqs)]
        ),
        hidden_recorded=recorded,
        hidden_widths=frozenset(r.draft.width("hidden_in") for r in reqs if r.draft.has_hidden),
        offsets=[int(x) for x in np.cumsum([0, *(len(r.draft.input_ids) for r in reqs)])],
    )


# -- prefix-cache hits vs fresh requests --------------------------------------------------------
def _cache_split(runner: DrafterRunner, a: Agreement, u: Unavailable) -> CacheSplit | None:
    rows = a.rows
    if a.reference is None or rows is None or rows.request is None:
        return None
    reqs = a.requests
    hit = torch.tensor([reqs[int(i)].cache_hit for i in rows.request], dtype=torch.bool)
    if not hit.any():
        return None
    keep = with_topk(rows.topk_draft_ids)
    tol = a.engine_vs_reference.tolerance
    accept_by_key = runner.alignment.serving.accept_by_key

    def part(mask: torch.Tensor) -> dict[str, Any] | None:
        m = mask & keep
        if not m.any():
            return None
        lps = rows.topk_logprobs[m] if rows.topk_logprobs is not None else None
        c = compare_topk(rows.topk_draft_ids[m], lps, a.reference[m])
        known = c.max_logprob_diff == c.max_logprob_diff
        members = {int(i) for i in rows.request[m]}
        accepts = [x for i in members for x in accept_by_key.get(reqs[i].key, [])]
        return {
            "requests": len(members),
            "mean_accept_len": round(sum(accepts) / len(accepts), 4) if accepts else None,
            "rows": c.rows,
            "top1_agreement": round(c.top1, 4),
            "max_logprob_diff": round(c.max_logprob_diff, 4) if known else None,
            "agrees": c.agrees and (not known or c.max_logprob_diff <= tol),
        }

    split = {"cache_hit": part(hit), "fresh": part(~hit), "tolerance": round(tol, 6)}
    if split["cache_hit"] is None or split["cache_hit"]["agrees"]:
        return CacheSplit(split)
    per_request = u.guarded("draft-kv-stale per request", lambda: _per_request(runner, a))
    zeroed = u.guarded("draft-kv-stale what-if", lambda: _zeroed_span_agreement(runner, a))
    return CacheSplit(split, per_request, zeroed)


def _per_request(runner: DrafterRunner, a: Agreement) -> list[dict[str, Any]]:
    rows, reference = a.rows, a.reference
    keep = with_topk(rows.topk_draft_ids)
    ref = reference.argmax
    tol = a.engine_vs_reference.tolerance
    out = []
    for i, r in enumerate(a.requests):
        if not r.cache_hit:
            continue
        m = (rows.request == i) & keep
        if not m.any():
            continue
        same = ref[m] == rows.topk_draft_ids[m][:, 0].long()
        pos = rows.index[m]
        # The first row the engine's top-1 differs on, or else its log-probs do.
        off = same.clone()
        if rows.topk_logprobs is not None:
            lp = reference.logprobs[m]
            diff = (lp - rows.topk_logprobs[m].float()).abs().nan_to_num(0.0).amax(-1)
            off = same & (diff <= tol)
        first = pos[~off][0].item() if (~off).any() else None
        accepts = runner.alignment.serving.accept_by_key.get(r.key) or []
        span = runner.cached_span(r)
        lps = rows.topk_logprobs[m] if rows.topk_logprobs is not None else None
        gap = gap_at(reference.logprobs[m], rows.topk_draft_ids[m], lps)
        out.append(
            {
                "request": r.name,
                "n_cached": r.aux_start,
                "n_cached_recorded": r.n_cached,
                "rows": int(m.sum()),
                "top1_agreement": round(float(same.float().mean()), 4),
                "max_logprob_diff": round(gap, 4) if gap == gap else None,
                "first_disagreeing_position": first,
                "mean_accept_len": round(sum(accepts) / len(accepts), 4) if accepts else None,
                "cached_span_rebuilt_from": span.label if span is not None else None,
            }
        )
    return out


def _zeroed_span_agreement(runner: DrafterRunner, a: Agreement) -> float | None:
    """Top-1 agreement with the engine on cache-hit rows when the reference's cached span is
    fed zero states (a cache that never held the drafter's KV). Reads the hits' rows again
    (only when the hits disagree)."""
    rows = a.rows
    hits = [i for i, r in enumerate(a.requests) if r.cache_hit and rows.items[i].prefix is not None]
    if not hits:
        return None
    reqs = [a.requests[i] for i in hits]
    items = [rows.items[i] for i in hits]
    preds: dict[int, torch.Tensor] = {}
    for group, whole in engine_batches(runner, rows, reqs, items):
        zeroed = []
        for it in whole:
            p = it.prefix
            zeroed.append(
                Step0Input(
                    it.input_ids,
                    it.aux,
                    it.positions,
                    prefix=Step0Input(p.input_ids, torch.zeros_like(p.aux), p.positions),
                )
            )
        for j, logits in zip(group, runner.run_items(runner.drafter, zeroed), strict=True):
            preds[j] = logits.argmax(-1)
    masks, engine = [], []
    for i in hits:
        masks.append(with_topk(rows.topk_draft_ids[rows.request == i]))
        engine.append(rows.topk_draft_ids[rows.request == i][:, 0])
    m = torch.cat(masks)
    pred = torch.cat([preds[j] for j in range(len(hits))])
    return agreement(pred[m], torch.cat(engine).long()[m])


# -- chain -------------------------------------------------------------------------------------
# Replay of the recorded draft chains (steps k >= 1, the `draft_step` table).
#
# Step 0 does not depend on what the drafter feeds back to itself, so a fed-back-state mismatch
# (speculators/vLLM `norm_output` = `feed_normed`: step k gets norm(h) instead of h) passes every
# step-0 check. Here each recorded chain is rerun through the reference drafter from the same
# recorded draft-extend inputs, feeding at step k the token the engine fed, and the reference's
# step-k argmax is compared with the engine's recorded step-k top-1.

# Chains replayed per trace at most: each costs one step-0 forward over its committed rows.
MAX_CHAINS = 256


def chain_agreement(
    model: torch.nn.Module,
    requests: list[Any],
    prefix_of: Callable[[Any], Any] | None = None,
) -> list[dict[str, float | int]]:
    """[{draft_step, rows, top1_agreement, max_logit_diff}] over the chains of `requests`
    (`hstrace.replay.read.ServingRequest` with draft rows and hidden inputs). `prefix_of(r)`
    gives a prefix-cache hit's cached span as a `Step0Input` (None: no cached span)."""
    sums = ChainSums()
    has_prefix = (lambda r: prefix_of(r) is not None) if prefix_of is not None else None
    for r, chain in chosen_chains(requests, has_prefix):
        sums.run(model, r, chain, prefix_of)
    return sums.result()


def chosen_chains(
    requests: list[Any], has_prefix: Callable[[Any], bool] | None = None
) -> list[tuple[Any, Any]]:
    """The (request, chain) pairs replayed, at most MAX_CHAINS, in request order, decided from
    the narrow columns alone (a request's hidden input is read only when its chains run)."""
    out: list[tuple[Any, Any]] = []
    for r in requests:
        d = r.draft
        if d is None or not d.has_hidden:
            continue
        for chain in r.chains:
            if len(out) >= MAX_CHAINS:
                return out
            T = min(int(chain.rows), len(d.input_ids))
            ks = chain.step_index.tolist()
            if T <= 0 or ks != list(range(1, len(ks) + 1)):
                continue  # a chain recorded with gaps cannot be rerun step by step
            if r.aux_start and (has_prefix is None or not has_prefix(r)):
                continue  # a cache hit whose cached span cannot be rebuilt
            out.append((r, chain))
    return out


class ChainSums:
    """Per draft step: argmax hits, rows compared, max log-prob gap; chains added in any order
    give the same result (sums and maxima)."""

    def __init__(self) -> None:
        self.hits: dict[int, int] = defaultdict(int)
        self.diff: dict[int, float] = defaultdict(float)
        self.total: dict[int, int] = defaultdict(int)

    def run(
        self,
        model: torch.nn.Module,
        r: Any,
        chain: Any,
        prefix_of: Callable[[Any], Any] | None,
    ) -> None:
        """Rerun one chain from its recorded draft-extend inputs (r's hidden input: hold it)."""
        from hstrace.reference.step0 import Step0Input
        from hstrace.replay.compare import logprob_gap

        d = r.draft
        T = min(int(chain.rows), len(d.input_ids))
        item = Step0Input(
            torch.as_tensor(d.input_ids[:T]).long(),
            d.hidden_in[:T].float(),
            torch.as_tensor(d.positions[:T]).long(),
            prefix=prefix_of(r) if prefix_of is not None and r.aux_start else None,
        )
        item = item.with_prefix()
        out = model(item.input_ids, item.aux.float(), positions=item.positions)
        for j, k in enumerate(chain.step_index.tolist()):
            fed = torch.full((len(item.input_ids),), int(chain.input_ids[j]), dtype=torch.long)
            out = model.step(fed, out.hidden, out.cache)
            engine_ids = torch.as_tensor(chain.topk_draft_ids[j]).long()
            if int(engine_ids[0]) < 0:
                continue  # no draft recorded at this step: nothing to compare
            self.hits[k] += int(int(out.logits[-1].argmax()) == int(engine_ids[0]))
            if chain.topk_logprobs is not None:
                lps = torch.as_tensor(chain.topk_logprobs[j])[None]
                gap = logprob_gap(out.logits[-1:], engine_ids[None], lps)
                if gap == gap:  # NaN: log-probs not recorded, the ids alone count
                    self.diff[k] = max(self.diff[k], gap)
            self.total[k] += 1

    def result(self) -> list[dict[str, float | int]]:
        return [
            {
                "draft_step": k,
                "rows": self.total[k],
                "top1_agreement": round(self.hits[k] / self.total[k], 6),
                "max_logit_diff": round(self.diff[k], 6),
            }
            for k in sorted(self.total)
        ]


def pooled(by_step: list[dict[str, float | int]]) -> float | None:
    rows = sum(int(p["rows"]) for p in by_step)
    if not rows:
        return None
    return sum(float(p["top1_agreement"]) * int(p["rows"]) for p in by_step) / rows
