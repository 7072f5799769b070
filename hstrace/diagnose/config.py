"""Stage `config` (and the what-if search, whose answers are mostly config codes).

- `spec-params-adjusted`: the static audit shows the engine changed speculative settings.
- findings the recorder already made at load time (the static audit carries them).
- the what-if search: when the engine's draft logits disagree with the reference on identical
  recorded inputs, find the single misreading that reproduces them (norm flags, RoPE, window,
  embedding source, fc skipped, tokens or layers shifted by one).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hstrace.engines.sglang_audit import spec_findings
from hstrace.findings import CODES, Finding
from hstrace.reference.step0 import Step0Input
from hstrace.replay.compare import with_topk
from hstrace.replay.whatif import WhatIf, reproducing, search

# Draft-config key (as users write it) for each reference flag.
FLAG_KEYS: dict[str, str] = {
    "norm_before_fc": "norm_before_fc",
    "fc_norm": "fc_norm",
    "norm_before_residual": "norm_before_residual",
    "logits_use_norm": "norm_output (SpecForge meaning: norm before lm_head)",
}
# RoPE bases engines fall back to: EAGLE/SpecForge configs without rope_theta, Llama-3, Qwen.
COMMON_THETAS = (10000.0, 500000.0, 1000000.0)


def spec_params(ctx) -> list[Finding]:
    spec = ctx.static.get("spec")
    if not isinstance(spec, dict) or "adjusted" not in spec:
        return []
    return spec_findings(spec)


def static_load_findings(ctx) -> list[Finding]:
    """Findings the recorder computed at load time (SGLang hooks: `findings_load`,
    `findings_spec`), kept as they are; the static audit is part of the evidence."""
    out = []
    for key in ("findings_load", "findings_spec"):
        for f in ctx.static.get(key) or []:
            if isinstance(f, dict) and f.get("code") in CODES:
                out.append(
                    Finding(
                        f["code"],
                        f.get("summary", ""),
                        evidence={**(f.get("evidence") or {}), "source": f"static audit ({key})"},
                        fix=f.get("fix", ""),
                        severity="fault"
                        if f["code"] == "spec-params-adjusted"
                        else f.get("severity", "fault"),
                        applies_to=f.get("applies_to"),
                    )
                )
    return out


def checkpoint_findings(ctx) -> list[Finding]:
    """`hstrace check`'s static checks on the drafter checkpoint (reused, not rewritten), kept
    when they apply to the engine and version that recorded the trace."""
    if ctx.drafter is None or ctx.load_report is None:
        return []
    from hstrace.check import applies, static_findings

    engine = ctx.serving.meta.get("engine") or {}
    name, version = str(engine.get("name", "")), str(engine.get("version", ""))
    found, _ = static_findings(ctx.load_report, ctx.drafter)
    kept = [f for f in found if applies(f, name, version)]
    for f in kept:
        f.evidence.setdefault("source", "hstrace check (static, on the checkpoint)")
    return kept


# -- the what-if search ----------------------------------------------------------------------
def _logits(ctx, model: torch.nn.Module, items: list[Step0Input]) -> torch.Tensor:
    return ctx.run_drafter(model, items)


def _no_fc(ctx) -> torch.nn.Module:
    model = ctx.variant()
    model.combine = lambda aux: aux  # type: ignore[method-assign]  # what a width check does
    return model


def _with_target_embedding(ctx) -> torch.nn.Module:
    model = ctx.variant()
    model.embed_tokens.weight.data.copy_(ctx.target.embed.detach().float())
    return model


def _shifted_tokens(ctx, shift: int) -> list[Step0Input]:
    rows = ctx.engine_rows
    out = []
    for item, req in zip(rows.items, ctx.engine_requests, strict=True):
        tok = torch.as_tensor(req.tokens).long()
        idx = (torch.as_tensor(req.draft.index) + 1 + shift).clamp(0, len(tok) - 1)
        out.append(dataclasses.replace(item, input_ids=tok[idx]))  # a cache hit keeps its prefix
    return out


def _shifted_layers(ctx, shift: int) -> list[Step0Input]:
    """The aux the target would deliver at the training layers moved by `shift`."""
    layers = ctx.training_layers
    if layers is None or ctx.target is None:
        raise ValueError("no training layers or no target")
    n_layers = ctx.target.num_layers
    chosen = [min(max(h + shift, 0), n_layers) for h in layers]
    out = []
    for item, req in zip(ctx.engine_rows.items, ctx.engine_requests, strict=True):
        fwd = ctx.target.forward(torch.as_tensor(req.tokens).long())
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


def whatif_list(ctx) -> list[WhatIf]:
    cfg = ctx.cfg
    items = ctx.engine_rows.items
    fits = ctx.fc_inputs_fit
    found: list[WhatIf] = []

    def add(name: str, code: str, fix: str, run) -> None:
        found.append(WhatIf(name, code, fix, run))

    if fits:
        for flag, key in FLAG_KEYS.items():
            trained = getattr(cfg, flag)
            add(
                f"{flag}={not trained}",
                "norm-flag-mismatch",
                f"the engine behaves as if {flag}={not trained}; the drafter was trained with "
                f'{flag}={trained}: set "{key}": {str(trained).lower()} in the draft config.json '
                "and serve with an engine version that reads it",
                lambda flag=flag, trained=trained: _logits(
                    ctx, ctx.variant(**{flag: not trained}), items
                ),
            )
        thetas = set(COMMON_THETAS)
        if ctx.target is not None and ctx.target.rope_theta:
            thetas.add(float(ctx.target.rope_theta))
        for theta in sorted(thetas - {float(cfg.rope_theta)}):
            add(
                f"rope_theta={theta:g}",
                "rope-mismatch",
                f"the engine uses rope_theta={theta:g}; the drafter was trained with "
                f'{cfg.rope_theta:g}: set "rope_theta": {cfg.rope_theta:g} in the draft config.json',
                lambda theta=theta: _logits(ctx, ctx.variant(rope_theta=theta), items),
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
                lambda window=window: _logits(ctx, ctx.variant(sliding_window=window), items),
            )
        if (
            ctx.target is not None
            and ctx.target.embed.shape == ctx.drafter.embed_tokens.weight.shape
        ):
            if not torch.equal(ctx.target.embed.float(), ctx.drafter.embed_tokens.weight.float()):
                add(
                    "embed_tokens=target",
                    "embed-head-source",
                    "the engine replaces the drafter's trained embed_tokens with the target's "
                    "(SGLang set_embed); serve with an engine that loads the draft embedding, or "
                    "train with the target's embedding frozen (embed_requires_grad: false)",
                    lambda: _logits(ctx, _with_target_embedding(ctx), items),
                )
        for shift in (-1, 1):
            add(
                f"token_shift={shift:+d}",
                "token-shift",
                f"the engine pairs aux row t with token t{1 + shift:+d} instead of t+1: feed the "
                "token that follows each aux row (EAGLE-3 pairing)",
                lambda shift=shift: _logits(ctx, ctx.drafter, _shifted_tokens(ctx, shift)),
            )
        for shift in (-1, 1):
            add(
                f"aux_layers{shift:+d}",
                "aux-layer-shift",
                f"the engine fed aux layers shifted by {shift:+d} from training: fix the layer-id "
                "convention (SGLang adds +1 to explicit ids)",
                lambda shift=shift: _logits(ctx, ctx.drafter, _shifted_layers(ctx, shift)),
            )
    elif all(it.aux is not None for it in items):
        widths = {int(it.aux.shape[-1]) for it in items}
        if widths == {int(cfg.hidden_size)}:
            add(
                "fc skipped",
                "fc-skipped",
                "the drafter got one H-wide state and skipped fc: serve with "
                "--speculative-algorithm EAGLE3 so the target delivers the aux concat",
                lambda: _logits(ctx, _no_fc(ctx), items),
            )
    return found


def whatif_findings(ctx) -> list[Finding]:
    if ctx.drafter is None or ctx.no_forward or ctx.engine_rows is None:
        return []
    if any(it.aux is None for it in ctx.engine_rows.items):
        return []  # no recorded hidden input to replay (serving.missing says so)
    base = ctx.agreement
    if base is not None and base.agrees and base.within_noise:
        ctx.metrics["whatif"] = {
            "ran": False,
            "reason": "engine matches the reference within the fp32-judged tolerance",
        }
        return []
    from hstrace.diagnose.cache import confined_to_cache_hits

    if confined_to_cache_hits(ctx):
        ctx.metrics["whatif"] = {
            "ran": False,
            "reason": "fresh requests match the reference, only prefix-cache hits disagree: "
            "a cache question (draft-kv-stale), not a misreading of the drafter",
        }
        return []
    baseline = base.top1 if base is not None else 0.0
    rows = ctx.engine_rows
    results = search(whatif_list(ctx), rows.topk_draft_ids.long(), rows.topk_logprobs)
    tolerance = base.tolerance if base is not None else _tolerance_without_baseline(ctx)
    best = reproducing(results, baseline, tolerance)
    ctx.metrics["whatif"] = {
        "ran": True,
        "baseline_top1": round(baseline, 6),
        "results": [r.to_json() for r in results[:10]],
        "reproduced_by": best.name if best else None,
    }
    if best is None:
        return []
    evidence: dict[str, Any] = {
        "what_if": best.name,
        "max_logprob_diff_with_it": best.to_json()["max_logprob_diff"],
        "max_logprob_diff_without_it": base.to_json()["max_logprob_diff"] if base else None,
        "tolerance": round(tolerance, 6) if tolerance is not None else None,
        "agreement_with_engine": round(best.agreement, 4),
        "reference_agreement_without_it": round(baseline, 4),
        "runner_up": results[1].to_json() if len(results) > 1 else None,
    }
    if best.code == "attention-window" and base is not None:
        evidence.update(_agreement_by_distance(ctx))
    return [
        Finding(
            best.code,
            f"the engine's draft logits are reproduced by the reference with {best.name} "
            f"({best.agreement:.0%} top-1 agreement vs {baseline:.0%} without)",
            evidence=evidence,
            fix=best.fix,
        )
    ]


def _tolerance_without_baseline(ctx) -> float | None:
    """When the reference cannot run on the recorded inputs at all (fc skipped), the noise
    floor comes from the reference on the training-side inputs (same drafter, same dtypes)."""
    ts = ctx.training_step0
    if ts is None:
        return None
    from hstrace.replay.compare import NOISE_MULTIPLE, gathered_logprobs

    items = [
        Step0Input(
            torch.as_tensor(a.sample.input_ids[1 : n + 1]).long(),
            a.sample.aux_concat[:n],
            torch.arange(n),
        )
        for a, n in ts["rows"]
    ]
    low = ctx.run_drafter(ctx.bf16_drafter, items, dtype=torch.bfloat16)
    ids = ts["logits"].topk(8, dim=-1).indices
    noise = float((gathered_logprobs(low, ids) - gathered_logprobs(ts["logits"], ids)).abs().max())
    return NOISE_MULTIPLE * noise + 1e-4


def _agreement_by_distance(ctx) -> dict[str, Any]:
    """Reference-vs-engine agreement for early and late positions (a window bites late)."""
    keep = with_topk(ctx.engine_rows.topk_draft_ids)  # rows without a top-k: nothing to compare
    ref = ctx.reference_logits.argmax(-1)[keep]
    eng = ctx.engine_top1[keep]
    idx = ctx.engine_rows.index[keep]
    half = int(idx.max()) // 2 if len(idx) else 0
    early, late = idx < half, idx >= half
    return {
        "top1_positions_before_" + str(half): round(
            float((ref[early] == eng[early]).float().mean()), 4
        )
        if early.any()
        else None,
        "top1_positions_from_" + str(half): round(float((ref[late] == eng[late]).float().mean()), 4)
        if late.any()
        else None,
    }


def fed_back_state(ctx) -> list[Finding]:
    """Steps k >= 1: does the engine feed back what the drafter was trained to get? Decided by
    rerunning the recorded chains with the trained `feed_normed` and with its opposite."""
    from hstrace.replay.chain import pooled
    from hstrace.replay.compare import AGREE_TOP1

    if ctx.drafter is None or ctx.agreement is None:
        return []
    # The step-0 tolerance (bf16-vs-fp32 spread measured on the same rows) judges log-probs.
    tol = ctx.agreement.tolerance

    def matches(by_step: list[dict[str, Any]]) -> bool:
        top1 = pooled(by_step)
        return (
            top1 is not None
            and top1 >= AGREE_TOP1
            and all(p["max_logit_diff"] <= tol for p in by_step)
        )

    base_steps = ctx.chain_by_step
    if not base_steps or matches(base_steps):
        return []
    trained = bool(ctx.cfg.feed_normed)
    flipped_steps = ctx.chain_agreement(ctx.variant(feed_normed=not trained))
    if not matches(flipped_steps):
        return []
    base, flipped = pooled(base_steps), pooled(flipped_steps)
    state = "norm(h)" if not trained else "h (pre-norm)"
    return [
        Finding(
            "norm-flag-mismatch",
            f"at draft steps k >= 1 the engine feeds back {state}: it behaves as if "
            f"feed_normed={not trained} (top-1 {base:.3f}, max log-prob diff "
            f"{max(p['max_logit_diff'] for p in base_steps):.3f} as trained; {flipped:.3f} and "
            f"within the tolerance {tol:.3f} flipped); step 0 cannot show this",
            evidence={
                "flag": "feed_normed",
                "trained": trained,
                "engine_behaves_as": not trained,
                "by_draft_step_as_trained": base_steps,
                "by_draft_step_flipped": flipped_steps,
                "tolerance": round(tol, 6),
            },
            fix=(
                f'set "norm_output": {str(trained).lower()} (speculators/vLLM meaning: feed '
                "the normed state back) in the draft config.json and serve with an engine "
                "version that reads it, or retrain with the state the engine feeds back"
            ),
        )
    ]
