"""The what-if hypotheses and their search (evidence of `hstrace.replay.agreement`).

When the engine's draft logits disagree with the reference on identical recorded inputs, find
the single misreading that reproduces them: norm flags, RoPE base, attention window, embedding
source, fc skipped, tokens or aux layers shifted by one. Each hypothesis carries the finding
code it would confirm and its fix; the checks read the search's outcome, never rerun it.

The search walks the recorded rows once, a batch of requests at a time (`engine_batches`): each
batch's hidden inputs are read, every hypothesis runs on them (its drafter variant built once,
sharing the weights), and only per-row argmaxes and log-probs are kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hstrace.reference.step0 import Step0Input
from hstrace.reference.target import ReferenceTarget
from hstrace.replay.compare import RefRows, gap_at, with_topk
from hstrace.replay.runner import DrafterRunner
from hstrace.replay.serving import ServingRequest
from hstrace.replay.whatif import WhatIfResult, ranked, reproducing

# Draft-config key (as users write it) for each reference flag.
FLAG_KEYS: dict[str, str] = {
    "norm_before_fc": "norm_before_fc",
    "fc_norm": "fc_norm",
    "norm_before_residual": "norm_before_residual",
    "logits_use_norm": "norm_output (SpecForge meaning: norm before lm_head)",
}
# RoPE bases engines fall back to: EAGLE/SpecForge configs without rope_theta, Llama-3, Qwen.
COMMON_THETAS = (10000.0, 500000.0, 1000000.0)


@dataclass(frozen=True)
class _Inputs:
    """What the hypotheses are built from: the recorded rows and the reference around them."""

    runner: DrafterRunner
    rows: Any  # hstrace.replay.agreement.EngineRows
    requests: list[ServingRequest]
    fits: bool
    target: ReferenceTarget | None
    training_layers: list[int] | None
    training_step0: Any


def search_whatifs(
    runner: DrafterRunner,
    a: Any,  # hstrace.replay.agreement.Agreement, without its search yet
    target: ReferenceTarget | None,
    training_layers: list[int] | None,
    training_step0: Any,
) -> Any:
    """The what-if search on the recorded rows (`Agreement.whatif`): not run when the engine
    matches the reference, or when only prefix-cache hits disagree (a cache question)."""
    from hstrace.replay.agreement import WhatIfSearch

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
    results = _search(h, whatif_list(h))
    tolerance = base.tolerance if base is not None else _tolerance_without_baseline(h)
    best = reproducing(results, baseline, tolerance)
    return WhatIfSearch(True, None, baseline, results, best, tolerance)


@dataclass(frozen=True)
class Hypothesis:
    """One misreading: the drafter as the engine would run it (`model`, built once) and, for
    the input misreadings, what it would be fed instead of a batch's recorded items."""

    name: str  # e.g. "norm_before_residual=False"
    code: str  # the finding code it would confirm
    fix: str
    model: Callable[[], torch.nn.Module]
    items: Callable[[list[Step0Input], list[ServingRequest]], list[Step0Input]] | None = None


def _search(h: _Inputs, hyps: list[Hypothesis]) -> list[WhatIfResult]:
    """Every hypothesis scored against the engine's recorded top-k (`whatif.score`), best first.
    A hypothesis that cannot even run on this drafter (e.g. mutually exclusive flags) cannot
    be what the engine did: it is left out."""
    from hstrace.replay.agreement import engine_batches

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
        results.append(WhatIfResult(hyp.name, hyp.code, hyp.fix, top1, diff))
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
    cfg = h.runner.cfg
    items = h.rows.items
    fits = h.fits
    found: list[Hypothesis] = []

    def add(name: str, code: str, fix: str, model, fed=None) -> None:
        found.append(Hypothesis(name, code, fix, model, fed))

    if fits:
        for flag, key in FLAG_KEYS.items():
            trained = getattr(cfg, flag)
            add(
                f"{flag}={not trained}",
                "norm-flag-mismatch",
                f"the engine behaves as if {flag}={not trained}; the drafter was trained with "
                f'{flag}={trained}: set "{key}": {str(trained).lower()} in the draft config.json '
                "and serve with an engine version that reads it",
                lambda flag=flag, trained=trained: h.runner.variant(**{flag: not trained}),
            )
        thetas = set(COMMON_THETAS)
        if h.target is not None and h.target.rope_theta:
            thetas.add(float(h.target.rope_theta))
        for theta in sorted(thetas - {float(cfg.rope_theta)}):
            add(
                f"rope_theta={theta:g}",
                "rope-mismatch",
                f"the engine uses rope_theta={theta:g}; the drafter was trained with "
                f'{cfg.rope_theta:g}: set "rope_theta": {cfg.rope_theta:g} in the draft config.json',
                lambda theta=theta: h.runner.variant(rope_theta=theta),
            )
        longest = max(len(it.input_ids) for it in items)
        windows: list[int | None] = [None] if cfg.sliding_window is not None else []
        w = 8
        while w < longest:
            windows.append(w)
            w *= 2
        for window in windows:
            served = "full attention" if window is None else f"a sliding window of {window}"
            trained = (
                "full attention"
                if cfg.sliding_window is None
                else f"sliding_window={cfg.sliding_window}"
            )
            add(
                f"sliding_window={window}",
                "attention-window",
                f"the engine's drafter uses {served}; it was trained with {trained}: set "
                f'"sliding_window" ({cfg.sliding_window}) and "layer_types" in the draft config '
                "so the engine attends like training",
                lambda window=window: h.runner.variant(sliding_window=window),
            )
        if (
            h.target is not None
            and h.target.embed.shape == h.runner.drafter.embed_tokens.weight.shape
        ):
            if not torch.equal(
                h.target.embed.float(), h.runner.drafter.embed_tokens.weight.float()
            ):
                add(
                    "embed_tokens=target",
                    "embed-head-source",
                    "the engine replaces the drafter's trained embed_tokens with the target's "
                    "(SGLang set_embed); serve with an engine that loads the draft embedding, or "
                    "train with the target's embedding frozen (embed_requires_grad: false)",
                    lambda: _with_target_embedding(h),
                )
        for shift in (-1, 1):
            add(
                f"token_shift={shift:+d}",
                "token-shift",
                f"the engine pairs aux row t with token t{1 + shift:+d} instead of t+1: feed the "
                "token that follows each aux row (EAGLE-3 pairing)",
                lambda: h.runner.drafter,
                lambda its, reqs, shift=shift: _shifted_tokens(h, shift, its, reqs),
            )
        for shift in (-1, 1):
            add(
                f"aux_layers{shift:+d}",
                "aux-layer-shift",
                f"the engine fed aux layers shifted by {shift:+d} from training: fix the layer-id "
                "convention (SGLang adds +1 to explicit ids)",
                lambda: h.runner.drafter,
                lambda its, reqs, shift=shift: _shifted_layers(h, shift, its, reqs),
            )
    elif h.rows.hidden_recorded:
        widths = set(h.rows.hidden_widths)
        if widths == {int(cfg.hidden_size)}:
            add(
                "fc skipped",
                "fc-skipped",
                "the drafter got one H-wide state and skipped fc: serve with "
                "--speculative-algorithm EAGLE3 so the target delivers the aux concat",
                lambda: _no_fc(h),
            )
    return found


def _tolerance_without_baseline(h: _Inputs) -> float | None:
    """When the reference cannot run on the recorded inputs at all (fc skipped), the noise
    floor comes from the reference on the training-side inputs (same drafter, same dtypes)."""
    ts = h.training_step0
    if ts is None:
        return None
    from hstrace.replay.compare import NOISE_MULTIPLE, gathered_logprobs

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
