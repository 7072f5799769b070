"""The replay of an MTP trace (vLLM `method: mtp`): read → align → compare → judge, for an MTP
head instead of an EAGLE-3 drafter (entry `replay_mtp`; the evidence `MTPEvidence`).

What an MTP head is fed at row t: h[t], the target's state of token t, and the embedding of
token x[t] (= token t+1 when paired right); its logits predict token t+2. Three questions
decide the wiring, each from the numbers, never from labels:

    which state:  h_serving[t] vs the target's own states on the same tokens (each decoder
                  layer's input, the last layer's residual stream before the final norm,
                  after it): the candidate with the smallest relative error; the same for the
                  training dump's h_training[t]                          -> fed.serving / .training
    which token:  x[t] == tokens[t + s] for s in {0, 1, 2} on the served rows       -> pairing
    which order:  the head's step-0 accuracy on the training inputs with `eh_proj` as loaded
                  and with its two input halves exchanged (W[:, :H] <-> W[:, H:])  -> order

and one comparison that judges the engine's own forward: the reference head on the recorded
serving inputs (the same ids, hidden rows and positions) against the engine's top-k at every
row vLLM sampled a draft from                                        -> engine_vs_reference

Step-0 accuracy convention: the head's argmax at row t == the target's own greedy token at
position t+1 (what greedy serving accepts), over loss-masked training rows with a token t+1.
The reference head is `hstrace.drafter.mtp.MTPHead` loaded from the served target checkpoint
(`hstrace.drafter.mtp_checkpoint.load_mtp_head`); the target forward is
`hstrace.reference.target.ReferenceTarget` (fp32).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from hstrace.errors import HstraceError
from hstrace.replay.read import ServingData, read_serving
from hstrace.replay.result import Judgement, ReplayResult
from hstrace.replay.unavailable import Unavailable, merged, split_failures

PAIRING_SHIFTS = (0, 1, 2)  # token t + s paired with h[t]; the head is trained with s = 1
TRAINED_SHIFT = 1
MAX_REQUESTS = 16  # requests whose rows are compared (each costs one target forward)
MAX_SAMPLES = 16  # training samples the head is scored on


def state_candidates(layers: torch.Tensor, post_norm: torch.Tensor) -> dict[str, torch.Tensor]:
    """The target's states of every token, by name: `layer k input` (HF hidden_states[k]) for
    k < N, `pre_final_norm` (the last layer's residual stream, hstrace's layers[N]) and
    `post_final_norm`. layers [T, N+1, H], post_norm [T, H]."""
    n = layers.shape[1] - 1
    out = {f"layer {k} input": layers[:, k] for k in range(1, n)}
    out["pre_final_norm"] = layers[:, n]
    out["post_final_norm"] = post_norm
    return out


def relative_errors(fed: torch.Tensor, candidates: dict[str, torch.Tensor]) -> dict[str, float]:
    """Mean over rows of ||fed - c|| / ||c|| for each candidate state."""
    fed = fed.float()
    return {
        name: float(((fed - c).norm(dim=-1) / c.norm(dim=-1).clamp_min(1e-12)).mean())
        for name, c in candidates.items()
    }


def decide_state(errors: dict[str, float], tolerance: float) -> str | None:
    """The candidate the fed rows are (smallest error, within `tolerance`), else None."""
    if not errors:
        return None
    best = min(errors, key=errors.__getitem__)
    return best if errors[best] <= tolerance else None


def pairing_shares(draft_ids: torch.Tensor, tokens: torch.Tensor) -> dict[int, float]:
    """For each shift s: the share of rows t whose fed token is tokens[t + s] (rows with one)."""
    out = {}
    for s in PAIRING_SHIFTS:
        n = min(len(draft_ids), len(tokens) - s)
        out[s] = float((draft_ids[:n] == tokens[s : s + n]).float().mean()) if n > 0 else 0.0
    return out


def swap_halves(weight: torch.Tensor) -> torch.Tensor:
    """`eh_proj` with its two input halves exchanged: [W_a | W_b] -> [W_b | W_a]."""
    h = weight.shape[1] // 2
    return torch.cat([weight[:, h:], weight[:, :h]], dim=1)


@dataclass(frozen=True)
class Fed:
    """Which target state each side fed the head (decided from the numbers)."""

    serving: str | None
    training: str | None
    serving_errors: dict[str, float]
    training_errors: dict[str, float]
    tolerance_serving: float
    tolerance_training: float
    serving_rows: int
    training_rows: int

    def to_json(self) -> dict[str, Any]:
        return {
            "serving_state": self.serving,
            "training_state": self.training,
            "serving_rel_error": {k: round(v, 6) for k, v in self.serving_errors.items()},
            "training_rel_error": {k: round(v, 6) for k, v in self.training_errors.items()},
            "tolerance": {"serving": self.tolerance_serving, "training": self.tolerance_training},
            "rows": {"serving": self.serving_rows, "training": self.training_rows},
        }


@dataclass(frozen=True)
class Agreement:
    """The engine's draft top-k vs the reference head's on identical recorded inputs."""

    rows: int
    top1: float
    max_logprob_diff: float  # over the engine's top-k ids, |engine - reference| log-probs

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "top1_agreement": round(self.top1, 4),
            "max_logprob_diff": round(self.max_logprob_diff, 6),
            "convention": "depth-0 rows vLLM sampled a draft from; reference = MTPHead on the "
            "recorded ids, hidden rows and positions",
        }


@dataclass(frozen=True)
class MTPEvidence:
    """What the MTP checks read (`hstrace.diagnose.mtp`); each piece None when it could not be
    computed (`unavailable` says why)."""

    serving: ServingData
    head_report: dict[str, Any]
    fed: Fed | None = None
    pairing: dict[str, Any] | None = None
    # step-0 accuracy on the training inputs: as loaded, eh_proj halves exchanged, and under
    # each token pairing (name -> accuracy), rows scored
    training_accuracy: dict[str, Any] | None = None
    # step-0 accuracy of the reference head on the serving inputs (same convention)
    serving_accuracy: float | None = None
    engine_vs_reference: Agreement | None = None
    compared: dict[str, int] = field(default_factory=dict)  # requests and rows compared
    unavailable: dict[str, str] = field(default_factory=dict)

    @property
    def static(self) -> dict[str, Any]:
        return self.serving.static

    def metrics(self) -> dict[str, Any]:
        lens = self.serving.accept_lens
        evr = self.engine_vs_reference
        return {
            # the flat numbers the renderers print (`hstrace.report.replay.METRIC_LABELS`)
            "acc0_mtp_training": (self.training_accuracy or {}).get("as_loaded"),
            "acc0_mtp_serving": self.serving_accuracy,
            "engine_vs_reference_top1": round(evr.top1, 4) if evr else None,
            "engine_vs_reference_max_logprob_diff": round(evr.max_logprob_diff, 6) if evr else None,
            "mtp": {
                "head": self.head_report,
                "fed": self.fed.to_json() if self.fed else None,
                "pairing": self.pairing,
                "training_accuracy": self.training_accuracy,
                "acc0_serving": self.serving_accuracy,
            },
            "engine_vs_reference": self.engine_vs_reference.to_json()
            if self.engine_vs_reference
            else None,
            "mean_accept_len": round(sum(lens) / len(lens), 4) if lens else None,
            "accept_len_convention": "accepted draft tokens per verify, excluding the bonus",
        }


def is_mtp_trace(meta: dict[str, Any]) -> bool:
    return isinstance((meta.get("static") or {}).get("mtp"), dict)


# ---- compare -----------------------------------------------------------------------------------


@torch.inference_mode()
def _step0_accuracy(
    head: Any,
    ids: torch.Tensor,
    hidden: torch.Tensor,
    greedy: torch.Tensor,
    mask: torch.Tensor,
    shift: int,
) -> tuple[int, int]:
    """(hits, rows): head fed (h[t], ids[t + shift]) at rows t, scored against greedy[t + 1]."""
    t = len(ids) - max(shift, 1)
    if t <= 0:
        return 0, 0
    x = ids[shift : shift + t]
    logits = head(x, hidden[:t].float(), torch.arange(t)).logits
    want = greedy[1 : 1 + t]
    keep = mask[1 : 1 + t]
    hits = int(((logits.argmax(-1) == want) & keep).sum())
    return hits, int(keep.sum())


def _training_side(
    head: Any, samples: list[Any], target: Any
) -> tuple[dict[str, Any], dict[str, float], int]:
    """Accuracy on the training inputs (as loaded, halves exchanged, each pairing) and the
    relative error of the training hidden rows against the target's states."""
    weight = head.layers[0].eh_proj.weight
    loaded = weight.detach().clone()
    counts: dict[str, list[int]] = {"as_loaded": [0, 0], "halves_exchanged": [0, 0]}
    counts.update({f"pairing_shift_{s}": [0, 0] for s in PAIRING_SHIFTS})
    errors: dict[str, list[float]] = {}
    rows = 0
    try:
        for s in samples:
            ids = s.input_ids.long()
            fwd = target.forward(ids)
            greedy = fwd.logits.argmax(-1)
            hidden = s.last if s.last is not None else s.aux[:, 0]
            for name, e in relative_errors(
                hidden, state_candidates(fwd.layers, fwd.post_norm)
            ).items():
                errors.setdefault(name, []).append(e)
            rows += len(ids)
            mask = s.loss_mask.bool()
            for name, w in (("as_loaded", loaded), ("halves_exchanged", swap_halves(loaded))):
                with torch.no_grad():
                    weight.copy_(w)
                h, n = _step0_accuracy(head, ids, hidden, greedy, mask, TRAINED_SHIFT)
                counts[name][0] += h
                counts[name][1] += n
            with torch.no_grad():
                weight.copy_(loaded)
            for sh in PAIRING_SHIFTS:
                h, n = _step0_accuracy(head, ids, hidden, greedy, mask, sh)
                counts[f"pairing_shift_{sh}"][0] += h
                counts[f"pairing_shift_{sh}"][1] += n
    finally:
        with torch.no_grad():
            weight.copy_(loaded)
    acc = {k: (round(h / n, 4) if n else None) for k, (h, n) in counts.items()}
    acc["rows"] = counts["as_loaded"][1]
    acc["convention"] = (
        "step 0: head argmax at row t == the target's greedy token at t+1, loss-masked rows"
    )
    mean_err = {k: sum(v) / len(v) for k, v in errors.items()}
    return acc, mean_err, rows


@torch.inference_mode()
def _serving_side(head: Any, data: ServingData, target: Any) -> dict[str, Any]:
    """Per request (from position 0, no cache hit): the fed rows against the target's states,
    the pairing, the reference head on the recorded inputs vs the engine's top-k."""
    errors: dict[str, list[float]] = {}
    shares: dict[int, list[float]] = {s: [] for s in PAIRING_SHIFTS}
    agree, n_rows, max_diff = 0, 0, 0.0
    hits, scored, rows, compared = 0, 0, 0, 0
    for r in data.requests[:MAX_REQUESTS]:
        if r.cache_hit or r.aux is None or r.draft is None or r.draft.hidden_in is None:
            continue
        p = min(len(r.aux), len(r.draft.positions))
        if p < 2 or int(r.draft.positions[0]) != 0:
            continue
        tokens = torch.as_tensor(r.tokens).long()
        fed = r.aux[:p].float()
        fwd = target.forward(tokens[:p])
        for name, e in relative_errors(fed, state_candidates(fwd.layers, fwd.post_norm)).items():
            errors.setdefault(name, []).append(e)
        rows += p
        compared += 1
        x = torch.as_tensor(r.draft.input_ids[:p]).long()
        for s, v in pairing_shares(x, tokens).items():
            shares[s].append(v)
        pos = torch.as_tensor(r.draft.positions[:p]).long()
        out = head(x, r.draft.hidden_in[:p].float(), pos)
        logp = torch.log_softmax(out.logits.float(), -1)
        topk = r.draft.topk_target_ids
        if topk is not None:
            sampled = (topk[:p, 0] >= 0).nonzero().flatten()
            for row in sampled.tolist():
                ids = topk[row].long()
                ok = ids >= 0
                agree += int(ids[0] == logp[row].argmax())
                n_rows += 1
                if r.draft.topk_logprobs is not None:
                    d = (r.draft.topk_logprobs[row][ok].float() - logp[row, ids[ok]]).abs()
                    max_diff = max(max_diff, float(d.max()))
        greedy = fwd.logits.argmax(-1)
        t = p - 1  # rows with a token t+1 in the committed sequence
        hits += int((logp[:t].argmax(-1) == greedy[1 : 1 + t]).sum())
        scored += t
    return {
        "errors": {k: sum(v) / len(v) for k, v in errors.items()},
        "rows": rows,
        "requests": compared,
        "pairing": {str(s): (sum(v) / len(v) if v else None) for s, v in shares.items()},
        "agreement": Agreement(n_rows, agree / n_rows, max_diff) if n_rows else None,
        "acc0": round(hits / scored, 4) if scored else None,
    }


def build_mtp_evidence(
    data: ServingData, head: Any, head_report: dict[str, Any], target: Any, samples: list[Any]
) -> MTPEvidence:
    """Every piece of the MTP evidence; a piece that fails internally is noted, not fatal."""
    un = Unavailable()
    # fp32 serving vs the fp32 reference target: 1e-3; a bf16 dump: 2e-2 (8 significant bits)
    tol_s, tol_t = 1e-3, 2e-2
    serving = un.guarded("mtp serving side", lambda: _serving_side(head, data, target))
    training = None
    if samples:
        training = un.guarded("mtp training side", lambda: _training_side(head, samples, target))
    else:
        un.note("mtp training side", "no training samples (--against)")
    fed = None
    if serving is not None and serving["rows"]:
        t_err = training[1] if training else {}
        fed = Fed(
            serving=decide_state(serving["errors"], tol_s),
            training=decide_state(t_err, tol_t) if t_err else None,
            serving_errors=serving["errors"],
            training_errors=t_err,
            tolerance_serving=tol_s,
            tolerance_training=tol_t,
            serving_rows=serving["rows"],
            training_rows=training[2] if training else 0,
        )
    elif serving is not None:
        un.note("mtp serving side", "no request recorded from position 0 with its drafter rows")
    pairing = None
    if serving is not None and serving["rows"]:
        pairing = {
            "serving_share_by_shift": serving["pairing"],
            "trained_shift": TRAINED_SHIFT,
            "meaning": "share of served rows t whose token is tokens[t + shift]",
        }
    head_ok = not head_report.get("missing")
    if not head_ok:  # a head left at its initial values judges nothing
        missing = head_report["missing"]
        un.note(
            "mtp reference head",
            f"the checkpoint fills none of {len(missing)} head parameters ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): the head's accuracy and the engine-vs-"
            "reference comparison are not judged",
        )
    return MTPEvidence(
        serving=data,
        head_report=head_report,
        fed=fed,
        pairing=pairing,
        training_accuracy=training[0] if training and head_ok else None,
        serving_accuracy=serving["acc0"] if serving and head_ok else None,
        engine_vs_reference=serving["agreement"] if serving and head_ok else None,
        compared={"requests": serving["requests"], "rows": serving["rows"]} if serving else {},
        unavailable=un.frozen(),
    )


# ---- judge -------------------------------------------------------------------------------------


def replay_mtp(
    judge: Any, trace_path: Path, against: Path | None, target_path: Path | None = None
) -> ReplayResult:
    """Open the MTP trace, its target checkpoint (the head and the target forward), the training
    dump; build the evidence; `judge(evidence) -> Judgement` (from above: `hstrace.diagnose`)."""
    from hstrace.drafter.mtp_checkpoint import load_mtp_head
    from hstrace.reference.target import ReferenceTarget
    from hstrace.replay.run import locate, target_path_from_trace
    from hstrace.trace import open_trace
    from hstrace.training import open_training

    with open_trace(trace_path) as tr:
        data = read_serving(tr)
        path = target_path or locate(target_path_from_trace(data.meta), trace_path)
        if path is None or not Path(path).is_dir():
            raise HstraceError(
                f"the MTP head lives in the target checkpoint: {path} is not a directory "
                "(pass --target DIR)"
            )
        head, report = load_mtp_head(path)
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # a MiMo checkpoint loads as its Qwen2 backbone
        try:
            target = ReferenceTarget(Path(path))
        finally:
            hf_logging.set_verbosity(level)
        samples = []
        if against is not None:
            samples = list(islice(open_training(against).samples(), MAX_SAMPLES))
        ev = build_mtp_evidence(data, head, report.to_json(), target, samples)
    judgement: Judgement = judge(ev)
    missing, failures = split_failures(ev.unavailable)
    return ReplayResult(
        findings=judgement.findings,
        metrics=ev.metrics(),
        coverage={
            "serving_requests": len(data.requests),
            "aligned_requests": ev.compared.get("requests", 0),
            "serving_tokens": sum(len(r.tokens) for r in data.requests),
            "aligned_tokens": ev.compared.get("rows", 0),
            "training_samples": len(samples),
            "convention": "MTP: requests recorded from position 0, compared row by row with "
            "the target's states and the reference head (training aligned by sample, not ids)",
        },
        inputs={
            "trace": str(trace_path),
            "against": str(against) if against else None,
            "target": str(path),
            "drafter": f"the MTP head in the target checkpoint ({report.layout} layout)",
        },
        skipped=missing,
        failed=merged(failures, judgement.failed),
    )
