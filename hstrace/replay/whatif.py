"""Stage what-if: which single misreading makes the reference do what the engine did.

Entry: `search_whatifs(runner, agreement, ...) -> WhatIfSearch` (evidence `Evidence.whatif`),
run after the compare stage (`hstrace.replay.agreement`) when the engine's draft logits
disagree with the reference on identical recorded inputs. Each hypothesis is one misreading (a
norm flag read the other way, the RoPE base, the attention window, the embedding source, fc
skipped, tokens or aux layers shifted by one): a name, its kind and its parameters; the search
returns them scored, never a finding code. `hstrace.findings.HYPOTHESES` says which code a kind
confirms and the diagnose room reports it (`diagnose.config.whatif_findings`).

The search walks the recorded rows once, a batch of requests at a time (`engine_batches`): each
batch's hidden inputs are read, every hypothesis runs on them (its drafter variant built once,
sharing the weights), and only per-row argmaxes and log-probs are kept. The pure part
(`search`, `score`, `ranked`, `reproducing`) takes tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hstrace.findings import HYPOTHESES
from hstrace.reference.step0 import Step0Input
from hstrace.reference.target import ReferenceTarget
from hstrace.replay.agreement import Agreement, EngineRows, engine_batches
from hstrace.replay.compare import (
    AGREE_TOP1,
    NOISE_MULTIPLE,
    WHATIF_MARGIN,
    RefRows,
    agreement,
    gap_at,
    gathered_logprobs,
    with_topk,
)
from hstrace.replay.read import ServingRequest
from hstrace.replay.runner import DrafterRunner


@dataclass(frozen=True)
class WhatIf:
    name: str  # e.g. "norm_before_residual=False"
    kind: str  # the hypothesis' kind, e.g. "norm-flag" (`hstrace.findings.HYPOTHESES`)
    run: Callable[[], torch.Tensor]  # draft logits [R, Vd] under the hypothesis, same rows
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WhatIfResult:
    name: str
    kind: str
    agreement: float  # top-1 agreement with the engine
    max_logprob_diff: float  # at the engine's top-k ids (NaN when it recorded no log-probs)
    params: Mapping[str, Any] = field(default_factory=dict)  # what the hypothesis changed

    @property
    def code(self) -> str | None:
        """The finding code this kind confirms, as the registry declares it."""
        return HYPOTHESES.get(self.kind)

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "code": self.code,
            "agreement": round(self.agreement, 6),
            "max_logprob_diff": (
                round(self.max_logprob_diff, 6)
                if self.max_logprob_diff == self.max_logprob_diff
                else None
            ),
        }


def search(
    whatifs: Sequence[WhatIf],
    engine_ids: torch.Tensor,
    engine_logprobs: torch.Tensor | None = None,
) -> list[WhatIfResult]:
    """Every hypothesis scored against the engine's recorded top-k, best first (smallest
    log-prob difference, then highest argmax agreement). Rows without a top-k (id -1) are not
    scored; NaN log-probs are unknown (those rows count by their ids only)."""
    results = []
    for w in whatifs:
        try:
            logits = w.run()
        except (ValueError, RuntimeError, IndexError):
            # A hypothesis that cannot even run on this drafter (e.g. mutually exclusive
            # flags) cannot be what the engine did.
            continue
        ref = RefRows.of(logits, engine_ids, topk=False)
        results.append(score(w, ref, engine_ids, engine_logprobs))
    return ranked(results)


def score(
    w: WhatIf | Hypothesis,
    ref: RefRows,
    engine_ids: torch.Tensor,
    engine_logprobs: torch.Tensor | None = None,
) -> WhatIfResult:
    """One hypothesis's reference rows (`RefRows`, every recorded row) against the engine's
    top-k, on the rows where the engine recorded one."""
    keep = with_topk(engine_ids)
    ids = engine_ids[keep]
    lps = engine_logprobs[keep] if engine_logprobs is not None else None
    top1 = agreement(ref.argmax[keep], ids[:, 0])
    diff = gap_at(ref.logprobs[keep], ids, lps) if lps is not None else float("nan")
    return WhatIfResult(w.name, w.kind, top1, diff, dict(w.params))


def ranked(results: Sequence[WhatIfResult]) -> list[WhatIfResult]:
    """Best first: smallest log-prob difference, then highest argmax agreement."""
    return sorted(
        results,
        key=lambda r: (
            r.max_logprob_diff if r.max_logprob_diff == r.max_logprob_diff else 1e9,
            -r.agreement,
        ),
    )


def reproducing(
    results: Sequence[WhatIfResult], baseline: float, tolerance: float | None
) -> WhatIfResult | None:
    """The best hypothesis if it reproduces the engine: its log-probs within the fp32-judged
    tolerance (when the engine recorded log-probs), else a clear argmax win."""
    if not results:
        return None
    best = results[0]
    if tolerance is not None and best.max_logprob_diff == best.max_logprob_diff:
        return best if best.max_logprob_diff <= tolerance and best.agreement >= AGREE_TOP1 else None
    if best.agreement >= AGREE_TOP1 and best.agreement >= baseline + WHATIF_MARGIN:
        return best
    return None


@dataclass(frozen=True, kw_only=True)
class WhatIfSearch:
    ran: bool
    reason: str | None = None  # why it did not run
    baseline: float = 0.0  # reference top-1 agreement with the engine, without any what-if
    results: list[WhatIfResult] = field(default_factory=list)  # best first
    best: WhatIfResult | None = None  # the one that reproduces the engine, if any
    tolerance: float | None = None
    # The drafter as the engine ran it, when `best` is a config misreading (a variant of the
    # drafter, fed the recorded inputs): the impact stage (`replay.impact`) runs it as served.
    served_model: Callable[[], torch.nn.Module] | None = None
    # The fix checked on the training tensors: step-0 accuracy (loss-masked rows, vs the stored
    # token t+2) of the drafter as trained and of `best`'s variant ({"as_trained", "as_served",
    # "rows"}); None when `best` changes the inputs, not the drafter, or there are no tensors.
    training_check: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        if not self.ran:
            return {"ran": False, "reason": self.reason}
        return {
            "ran": True,
            "baseline_top1": round(self.baseline, 6),
            "results": [r.to_json() for r in self.results[:10]],
            "reproduced_by": self.best.name if self.best else None,
        }


# Draft-config key (as users write it) for each reference flag.
FLAG_KEYS: dict[str, str] = {
    "norm_before_fc": "norm_before_fc",
    "fc_norm": "fc_norm",
    "norm_before_residual": "norm_before_residual",
    "logits_use_norm": "norm_output (SpecForge meaning: norm before lm_head)",
}
# The hypothesis kinds that change only how the drafter is read (its config or embedding): the
# impact stage runs them as the served drafter on any aux concat.
CONFIG_KINDS = frozenset({"norm-flag", "rope-theta", "sliding-window", "target-embedding"})
# RoPE bases engines fall back to: EAGLE/SpecForge configs without rope_theta, Llama-3, Qwen.
COMMON_THETAS = (10000.0, 500000.0, 1000000.0)


@dataclass(frozen=True)
class _Inputs:
    """What the hypotheses are built from: the recorded rows and the reference around them."""

    runner: DrafterRunner
    rows: EngineRows
    requests: list[ServingRequest]
    fits: bool
    target: ReferenceTarget | None
    training_layers: list[int] | None
    training_step0: Any


def search_whatifs(
    runner: DrafterRunner,
    a: Agreement,
    target: ReferenceTarget | None,
    training_layers: list[int] | None,
    training_step0: Any,
) -> Any:
    """The what-if search on the recorded rows (`Agreement.whatif`): not run when the engine
    matches the reference, or when only prefix-cache hits disagree (a cache question)."""
    base = a.engine_vs_reference
    if base is not None and base.agrees and base.within_noise:
        return WhatIfSearch(
            ran=False, reason="engine matches the reference within the fp32-judged tolerance"
        )
    if a.cache is not None and a.cache.confined_to_cache_hits:
        return WhatIfSearch(
            ran=False,
            reason="fresh requests match the reference, only prefix-cache hits disagree: "
            "a cache question (draft-kv-stale), not a misreading of the drafter",
        )
    h = _Inputs(runner, a.rows, a.requests, a.fc_inputs_fit, target, training_layers,
                training_step0)  # fmt: skip
    baseline = base.top1 if base is not None else 0.0
    hyps = whatif_list(h)
    results = _search(h, hyps)
    tolerance = base.tolerance if base is not None else _tolerance_without_baseline(h)
    best = reproducing(results, baseline, tolerance)
    served, check = None, None
    if best is not None:
        hyp = next(x for x in hyps if x.name == best.name)
        # a config misreading: the same drafter fed the same inputs, read another way (not fc
        # skipped, whose drafter cannot take the aux concat; not the input misreadings)
        served = hyp.model if hyp.kind in CONFIG_KINDS else None
        if served is not None and training_step0 is not None:
            check = _on_training(h, served())
    return WhatIfSearch(
        ran=True,
        baseline=baseline,
        results=results,
        best=best,
        tolerance=tolerance,
        served_model=served,
        training_check=check,
    )


def _on_training(h: _Inputs, served: torch.nn.Module) -> dict[str, Any]:
    """Does the fix close the gap on what training fed the drafter? On the aligned training
    tensors (the rows `acc0_training` judges): step-0 accuracy and the mean negative
    log-likelihood of the stored token t+2 (in the draft vocab; the quantity training
    minimised, so the value a drafter was trained with scores lower), as trained and as served."""
    ts = h.training_step0
    items = [
        Step0Input(
            torch.as_tensor(a.sample.input_ids[1 : n + 1]).long(),
            a.sample.aux_concat[:n],
            torch.arange(n),
        )
        for a, n in ts.rows
    ]
    m = ts.judged
    d2t = h.runner.drafter.d2t.long()
    to_draft = torch.full((int(h.runner.cfg.vocab_size),), -1, dtype=torch.long)
    to_draft[torch.arange(len(d2t)) + d2t] = torch.arange(len(d2t))
    label = to_draft[ts.labels.long()]
    keep = m & (label >= 0)

    def acc(logits: torch.Tensor) -> float:
        return agreement(h.runner.map_to_target(logits.argmax(-1))[m], ts.labels[m])

    def nll(logits: torch.Tensor) -> float:
        lp = torch.log_softmax(logits.float(), -1)[keep]
        return float(-lp.gather(-1, label[keep][:, None]).mean())

    logits = h.runner.run(served, items)
    return {
        "as_trained": round(acc(ts.logits), 4),
        "as_served": round(acc(logits), 4),
        "nll_as_trained": round(nll(ts.logits), 4),
        "nll_as_served": round(nll(logits), 4),
        "rows": int(m.sum()),
    }


@dataclass(frozen=True)
class Hypothesis:
    """One misreading: the drafter as the engine would run it (`model`, built once) and, for
    the input misreadings, what it would be fed instead of a batch's recorded items."""

    name: str  # e.g. "norm_before_residual=False"
    kind: str  # e.g. "norm-flag" (`hstrace.findings.HYPOTHESES`)
    params: Mapping[str, Any]  # what it changes (the registry's fix template reads them)
    model: Callable[[], torch.nn.Module]
    items: Callable[[list[Step0Input], list[ServingRequest]], list[Step0Input]] | None = None


def _search(h: _Inputs, hyps: list[Hypothesis]) -> list[WhatIfResult]:
    """Every hypothesis scored against the engine's recorded top-k (`whatif.score`), best first.
    A hypothesis that cannot even run on this drafter (e.g. mutually exclusive flags) cannot
    be what the engine did: it is left out."""
    rows = h.rows
    ids = rows.topk_draft_ids.long()
    keep = with_topk(ids)
    lps = rows.topk_logprobs
    # Per hypothesis: its argmax hit per row (one byte a row), its largest log-prob gap.
    hits = [torch.zeros(len(ids), dtype=torch.bool) for _ in hyps]
    gaps: list[list[float]] = [[] for _ in hyps]
    models: dict[int, torch.nn.Module] = {}
    failed: set[int] = set()
    for group, items in engine_batches(h.runner, rows, h.requests):
        reqs = [h.requests[i] for i in group]
        for j, hyp in enumerate(hyps):
            if j in failed:
                continue
            try:
                if j not in models:
                    models[j] = hyp.model()
                fed = hyp.items(items, reqs) if hyp.items is not None else items
                out = h.runner.run_items(models[j], fed)
            except (ValueError, RuntimeError, IndexError):
                failed.add(j)
                models.pop(j, None)
                continue
            for i, logits in zip(group, out, strict=True):
                at = rows.rows_of(i)
                got = RefRows.of(logits, ids[at], topk=False)
                hits[j][at] = got.argmax == ids[at][:, 0]
                m = keep[at]
                if lps is not None and m.any():
                    gap = gap_at(got.logprobs[m], ids[at][m], lps[at][m])
                    if gap == gap:
                        gaps[j].append(gap)
    results = []
    for j, hyp in enumerate(hyps):
        if j in failed:
            continue
        top1 = float(hits[j][keep].float().mean()) if keep.any() else 0.0
        diff = max(gaps[j]) if gaps[j] else float("nan")
        results.append(WhatIfResult(hyp.name, hyp.kind, top1, diff, dict(hyp.params)))
    return ranked(results)


def _no_fc(h: _Inputs) -> torch.nn.Module:
    return h.runner.variant(skip_fc=True)  # the drafter's fault option: one H-wide state, no fc


def _with_target_embedding(h: _Inputs) -> torch.nn.Module:
    model = h.runner.variant()
    # A new tensor, not a write into the shared one (`DrafterRunner.variant`).
    own = model.embed_tokens.weight
    model.embed_tokens.weight = torch.nn.Parameter(
        h.target.embed.detach().to(own.dtype).clone(), requires_grad=False
    )
    return model


def _shifted_tokens(
    h: _Inputs, shift: int, items: list[Step0Input], reqs: list[ServingRequest]
) -> list[Step0Input]:
    out = []
    for item, req in zip(items, reqs, strict=True):
        tok = torch.as_tensor(req.tokens).long()
        idx = (torch.as_tensor(req.draft.index) + 1 + shift).clamp(0, len(tok) - 1)
        out.append(dataclasses.replace(item, input_ids=tok[idx]))  # a cache hit keeps its prefix
    return out


def _shifted_layers(
    h: _Inputs, shift: int, items: list[Step0Input], reqs: list[ServingRequest]
) -> list[Step0Input]:
    """The aux the target would deliver at the training layers moved by `shift`."""
    layers = h.training_layers
    if layers is None or h.target is None:
        raise ValueError("no training layers or no target")
    n_layers = h.target.num_layers
    chosen = [min(max(layer + shift, 0), n_layers) for layer in layers]
    out = []
    for item, req in zip(items, reqs, strict=True):
        fwd = h.target.forward(torch.as_tensor(req.tokens).long())
        idx = torch.as_tensor(req.draft.index).clamp(max=fwd.layers.shape[0] - 1)
        prefix = item.prefix
        if prefix is not None:  # a cache hit: its cached span at the same shifted layers
            c = len(prefix.input_ids)
            prefix = dataclasses.replace(prefix, aux=fwd.layers[:c][:, chosen].flatten(1))
        out.append(
            Step0Input(
                item.input_ids,
                fwd.layers[idx][:, chosen].flatten(1),
                item.positions,
                prefix=prefix,
            )
        )
    return out


def whatif_list(h: _Inputs) -> list[Hypothesis]:
    """Every hypothesis for these rows: the config and input misreadings when the recorded
    hidden input is fc's width, else (one H-wide state) fc skipped."""
    if h.fits:
        return [
            *_flag_hypotheses(h),
            *_rope_hypotheses(h),
            *_window_hypotheses(h),
            *_embedding_hypotheses(h),
            *_shift_hypotheses(h),
        ]
    if h.rows.hidden_recorded and set(h.rows.hidden_widths) == {int(h.runner.cfg.hidden_size)}:
        return [Hypothesis("fc skipped", "no-fc", {}, lambda: _no_fc(h))]
    return []


def _flag_hypotheses(h: _Inputs) -> list[Hypothesis]:
    cfg = h.runner.cfg
    out = []
    for flag, key in FLAG_KEYS.items():
        trained = getattr(cfg, flag)
        out.append(
            Hypothesis(
                f"{flag}={not trained}",
                "norm-flag",
                {
                    "flag": flag,
                    "served": not trained,
                    "trained": trained,
                    "key": key,
                    "trained_json": str(trained).lower(),
                },
                lambda flag=flag, trained=trained: h.runner.variant(**{flag: not trained}),
            )
        )
    return out


def _rope_hypotheses(h: _Inputs) -> list[Hypothesis]:
    cfg = h.runner.cfg
    thetas = set(COMMON_THETAS)
    if h.target is not None and h.target.rope_theta:
        thetas.add(float(h.target.rope_theta))
    return [
        Hypothesis(
            f"rope_theta={theta:g}",
            "rope-theta",
            {"served": theta, "trained": float(cfg.rope_theta)},
            lambda theta=theta: h.runner.variant(rope_theta=theta),
        )
        for theta in sorted(thetas - {float(cfg.rope_theta)})
    ]


def _window_hypotheses(h: _Inputs) -> list[Hypothesis]:
    cfg = h.runner.cfg
    longest = max(len(it.input_ids) for it in h.rows.items)
    windows: list[int | None] = [None] if cfg.sliding_window is not None else []
    w = 8
    while w < longest:
        windows.append(w)
        w *= 2
    trained = (
        "full attention" if cfg.sliding_window is None else f"sliding_window={cfg.sliding_window}"
    )
    return [
        Hypothesis(
            f"sliding_window={window}",
            "sliding-window",
            {
                "served": "full attention" if window is None else f"a sliding window of {window}",
                "trained": trained,
                "window": cfg.sliding_window,
            },
            lambda window=window: h.runner.variant(sliding_window=window),
        )
        for window in windows
    ]


def _embedding_hypotheses(h: _Inputs) -> list[Hypothesis]:
    own = h.runner.drafter.embed_tokens.weight
    if h.target is None or h.target.embed.shape != own.shape:
        return []
    if torch.equal(h.target.embed.float(), own.float()):
        return []
    return [
        Hypothesis("embed_tokens=target", "target-embedding", {}, lambda: _with_target_embedding(h))
    ]


def _shift_hypotheses(h: _Inputs) -> list[Hypothesis]:
    """Tokens, then aux layers, shifted by one either way (the recorded drafter, other items)."""
    tokens = [
        Hypothesis(
            f"token_shift={shift:+d}",
            "token-shift",
            {"shift": shift, "pairing": 1 + shift},
            lambda: h.runner.drafter,
            lambda its, reqs, shift=shift: _shifted_tokens(h, shift, its, reqs),
        )
        for shift in (-1, 1)
    ]
    layers = [
        Hypothesis(
            f"aux_layers{shift:+d}",
            "aux-layer-shift",
            {"shift": shift},
            lambda: h.runner.drafter,
            lambda its, reqs, shift=shift: _shifted_layers(h, shift, its, reqs),
        )
        for shift in (-1, 1)
    ]
    return tokens + layers


def _tolerance_without_baseline(h: _Inputs) -> float | None:
    """When the reference cannot run on the recorded inputs at all (fc skipped), the noise
    floor comes from the reference on the training-side inputs (same drafter, same dtypes)."""
    ts = h.training_step0
    if ts is None:
        return None
    items = [
        Step0Input(
            torch.as_tensor(a.sample.input_ids[1 : n + 1]).long(),
            a.sample.aux_concat[:n],
            torch.arange(n),
        )
        for a, n in ts.rows
    ]
    low = h.runner.run(h.runner.bf16, items, dtype=torch.bfloat16)
    ids = ts.logits.topk(8, dim=-1).indices
    noise = float((gathered_logprobs(low, ids) - gathered_logprobs(ts.logits, ids)).abs().max())
    return NOISE_MULTIPLE * noise + 1e-4
