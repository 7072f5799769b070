"""Stage impact: what each fault costs in acceptance, and what its fix is worth (issue 28).

Two halves, because the serving rows are read while the evidence is built and the faults are
known only after the checks ran:

- `build_chains` (evidence `Evidence.chains`): on the aligned tokens, the reference drafter's
  greedy chain of K = the served `num_speculative_tokens` drafts, started from every row, under
  each *state* of the three parts a wiring fault changes:

  | part    | as served                                  | as trained              |
  | ------- | ------------------------------------------ | ----------------------- |
  | `aux`   | the serving capture recorded in the trace   | the training tensors     |
  | `model` | the drafter variant the what-if search found the engine ran (a norm flag, RoPE base, window or embedding misread) | the checkpoint as trained |
  | `vocab` | `d2t` read the way the engine read it       | offsets (`i + d2t[i]`)  |

  Row t feeds token t+1 with aux row t; draft k proposes token t+2+k and step k+1 is fed draft
  k mapped to target ids (greedy serving). Draft k is *accepted* when drafts 0..k all equal
  the target's greedy choices (`reference_tokens`: on the stored tokens while they follow the
  greedy path; without a target model, the stored tokens), as greedy verification would.
  Rows: those whose token t+2 is in the loss mask (the assistant turns, what a served model
  generates) with K tokens after them; prefix-cache hits are left out.

- `impacts` (judge): each fault finding fixes one part (`PART_OF`); its impact is the chain with
  every part as served ("served") next to the same with its part as trained ("fixed"). Several
  faults: the impact of fixing all (`impact_all`). Beside them, the acceptance the trace
  realized on the same requests.

Expected accept length = 1 + the mean number of accepted drafts per verify step (the bonus
token counted, as SGLang's `accept_len` and vLLM's mean acceptance length); `per_position[i]`
= the fraction of steps whose draft i was accepted (not conditional on reaching it). The spread
is a 95 % percentile bootstrap over the aligned requests (rows of one request are not
independent), 1000 resamples with a fixed seed; the gain's interval is paired (the same
resampled requests on both sides), and a gain whose interval holds 0 is not measurable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hstrace.drafter.vocab import OFFSETS, map_draft_ids
from hstrace.findings import Finding
from hstrace.reference.target import ReferenceTarget
from hstrace.replay.align import AlignedPair
from hstrace.replay.unavailable import Unavailable

METRIC = "expected_accept_length"
CI_METHOD = "95% percentile bootstrap over aligned requests (1000 resamples, seed 0)"
RESAMPLES = 1000
PARTS = ("aux", "model", "vocab")

# Which part of the chain a fault code's fix puts back as trained. A code not here (or whose
# part serving did not change in a way the replay can rebuild) gets no impact, and says why.
PART_OF: Mapping[str, str] = {
    "aux-layer-shift": "aux",
    "aux-order": "aux",
    "aux-layers-default": "aux",
    "slot-layout": "aux",
    "hidden-corrupt": "aux",
    "target-drift": "aux",
    "norm-flag-mismatch": "model",
    "rope-mismatch": "model",
    "attention-window": "model",
    "embed-head-source": "model",
    "d2t-direct-table": "vocab",
    "vocab-map-missing": "vocab",
}


# -- the arithmetic: counts per request -> accept length, per position, spread ------------------
@dataclass(frozen=True)
class Counts:
    """Per request: `steps[i]` verify steps (chains started), `accepted[i, k]` of them with
    draft k accepted (drafts 0..k all right)."""

    steps: np.ndarray  # [N]
    accepted: np.ndarray  # [N, K]

    def accept_length(self, idx: np.ndarray | None = None) -> np.ndarray | float:
        """1 + accepted drafts per step, over the requests `idx` ([B, N] resamples) or all."""
        if idx is None:
            return 1.0 + float(self.accepted.sum()) / max(float(self.steps.sum()), 1.0)
        acc = self.accepted.sum(1)[idx].sum(-1)
        return 1.0 + acc / np.maximum(self.steps[idx].sum(-1), 1.0)

    def per_position(self) -> list[float]:
        n = max(float(self.steps.sum()), 1.0)
        return [float(x) / n for x in self.accepted.sum(0)]


def resamples(n: int, seed: int = 0) -> np.ndarray:
    """[RESAMPLES, n] request indices, the same for every side (a paired bootstrap)."""
    return np.random.default_rng(seed).integers(0, n, size=(RESAMPLES, n))


def _ci(values: np.ndarray) -> list[float]:
    lo, hi = np.percentile(values, [2.5, 97.5])
    return [round(float(lo), 4), round(float(hi), 4)]


def side(c: Counts, idx: np.ndarray) -> dict[str, Any]:
    return {
        "accept_length": round(float(c.accept_length()), 4),
        "ci": _ci(np.asarray(c.accept_length(idx))),
        "per_position": [round(p, 4) for p in c.per_position()],
    }


def compare(
    served: Counts,
    fixed: Counts,
    realized: Counts | None,
    k: int,
    topk: int,
    tokens: int,
    reference: str = "",
) -> dict[str, Any]:
    """The `impact` object of docs/replay-json.md (without `fix`)."""
    idx = resamples(len(served.steps))
    gain_draws = np.asarray(fixed.accept_length(idx)) - np.asarray(served.accept_length(idx))
    gain_ci = _ci(gain_draws)
    s, f = side(served, idx), side(fixed, idx)
    real = None
    agrees = None
    if realized is not None and realized.steps.sum() > 0:
        real = side(realized, resamples(len(realized.steps)))
        # the two intervals overlap: the estimate is consistent with what serving realized
        agrees = bool(real["ci"][0] <= s["ci"][1] and s["ci"][0] <= real["ci"][1])
    return {
        "metric": METRIC,
        "num_speculative_tokens": k,
        "topk": topk,
        "tokens": tokens,
        "steps": int(served.steps.sum()),
        "served": s,
        "fixed": f,
        "realized": real,
        "estimate_agrees": agrees,
        "gain": round(f["accept_length"] - s["accept_length"], 4),
        "gain_ci": gain_ci,
        "measurable": bool(gain_ci[0] > 0 or gain_ci[1] < 0),
        "ci_method": CI_METHOD,
        "reference": reference,
    }


def realized_counts(accept_by_request: Sequence[Sequence[int]], k: int) -> Counts:
    """The trace's verify rounds (accepted drafts each, bonus excluded) as `Counts`."""
    steps = np.array([len(a) for a in accept_by_request], dtype=np.float64)
    acc = np.zeros((len(accept_by_request), k))
    for i, a in enumerate(accept_by_request):
        arr = np.asarray(a, dtype=np.int64)
        for j in range(k):
            acc[i, j] = float((arr > j).sum())
    return Counts(steps, acc)


# -- the chains (evidence) ---------------------------------------------------------------------
State = tuple[bool, bool, bool]  # (aux, model, vocab) fixed, in `PARTS` order


@dataclass(frozen=True, kw_only=True)
class Chains:
    """Accepted-draft counts per state (`State`: which parts are as trained) on the aligned
    tokens, and what serving changed in each part (`served`: a part's description, or None
    when serving did not change it in a way the replay rebuilds)."""

    k: int = 0
    topk: int = 1
    tokens: int = 0
    reference: str = ""
    counts: dict[State, Counts] = field(default_factory=dict)
    served: dict[str, str | None] = field(default_factory=dict)
    realized: Counts | None = None
    unavailable: dict[str, str] = field(default_factory=dict)
    why_not: str | None = None  # the chains did not run at all


def spec_of(static: Mapping[str, Any]) -> tuple[int | None, int]:
    """(num_speculative_tokens, topk) as served: the static audit's effective settings."""
    spec = static.get("spec") if isinstance(static.get("spec"), dict) else {}
    eff = spec.get("effective") if isinstance(spec.get("effective"), dict) else spec
    k = eff.get("num_steps") or eff.get("num_speculative_tokens")
    return (int(k) if k else None), int(eff.get("topk") or 1)


def greedy_chain(
    model: torch.nn.Module, ids: torch.Tensor, aux: torch.Tensor, k: int, reading: str
) -> torch.Tensor:
    """[T, k] target-space drafts of the greedy chain from every row: step 0 feeds token t+1
    and aux row t; step j feeds draft j-1 mapped to target ids."""
    out = model(ids, aux.float())
    drafts = [out.logits.argmax(-1)]
    for _ in range(1, k):
        fed = map_draft_ids(drafts[-1], model.d2t, reading, int(model.cfg.vocab_size))
        out = model.step(fed, out.hidden, out.cache)
        drafts.append(out.logits.argmax(-1))
    d = torch.stack(drafts, -1)
    return map_draft_ids(d, model.d2t, reading, int(model.cfg.vocab_size))


def accepted_counts(drafts: torch.Tensor, reference: torch.Tensor) -> np.ndarray:
    """[k]: over the rows, how many have drafts 0..j all equal to the reference."""
    hit = (drafts == reference).to(torch.int64).cumprod(-1)
    return hit.sum(0).double().numpy()


def reference_tokens(
    ids: torch.Tensor, rows: int, k: int, target: ReferenceTarget | None
) -> torch.Tensor:
    """[rows, k] the token draft j of row t must equal for greedy verification to accept it:
    the target's greedy choice at t+1+j on these tokens, while the stored tokens t+2..t+1+j
    follow that greedy path (past a stored token off it, the target's choice on the greedy
    path is not known: -1, never matched). Without a target: the stored token t+2+j."""
    pos = torch.arange(rows)[:, None] + 2 + torch.arange(k)[None, :]
    stored = ids[pos]
    if target is None:
        return stored
    greedy = target.forward(ids).logits.argmax(-1)[pos - 1]  # position p predicts p+1
    on_path = (greedy == stored).to(torch.int64).cumprod(-1)
    known = torch.cat([torch.ones_like(on_path[:, :1]), on_path[:, :-1]], -1).bool()
    return torch.where(known, greedy, torch.full_like(greedy, -1))


def judged_rows(sample: Any, rows: int) -> torch.Tensor:
    """[rows] bool: the rows whose first drafted token (t+2) is in the library's loss mask
    (the assistant turns: the tokens a served model generates); every row when it has none."""
    mask = torch.as_tensor(sample.loss_mask).bool()
    m = mask[2 : rows + 2] if len(mask) >= rows + 2 else torch.zeros(rows, dtype=torch.bool)
    return m if m.any() else torch.ones(rows, dtype=torch.bool)


def build_chains(
    runner: Any,  # hstrace.replay.runner.DrafterRunner
    aligned: Sequence[AlignedPair],
    target: ReferenceTarget | None,
    static: Mapping[str, Any],
    served_model: Callable[[], torch.nn.Module] | None,
    served_model_name: str | None,
    served_reading: str | None,
    accept_by_key: Mapping[int, Sequence[int]],
) -> Chains:
    """The chains under every state serving differs in (see the module doc)."""
    u = Unavailable()
    k, topk = spec_of(static)
    if not runner.can_run:
        return Chains(why_not="the reference drafter cannot run on this trace")
    if k is None:
        return Chains(why_not="the trace records no num_speculative_tokens (static.spec)")
    if topk != 1:
        return Chains(
            k=k,
            topk=topk,
            why_not=f"tree drafting (topk={topk}): only a greedy chain (topk=1) is modelled",
        )
    fc_in = runner.alignment.fc_in
    pairs = [
        a
        for a in aligned
        if a.start == 0 and a.serving.has_aux and a.serving.aux.shape[-1] == fc_in
    ]
    if not pairs:
        return Chains(
            k=k,
            topk=topk,
            why_not="no aligned request with a full serving capture of the drafter's fc width",
        )
    served: dict[str, str | None] = {
        "aux": "the serving capture",
        "model": served_model_name if served_model is not None else None,
        "vocab": served_reading if served_reading not in (None, OFFSETS) else None,
    }
    trained = runner.drafter
    as_served = served_model() if served_model is not None else trained
    states: list[State] = [
        (a, m, v)
        for a in (False, True)
        for m in ((False, True) if served["model"] else (True,))
        for v in ((False, True) if served["vocab"] else (True,))
    ]
    steps = np.zeros(len(pairs))
    acc = {s: np.zeros((len(pairs), k)) for s in states}
    tokens = 0
    for i, a in enumerate(pairs):
        ids = torch.as_tensor(a.sample.input_ids).long()
        serving_aux = a.serving.aux
        training_aux = a.sample.aux_concat
        n = min(a.n, len(ids), len(serving_aux), len(training_aux))
        rows = n - 1 - k  # row t needs tokens up to t+1+k
        if rows <= 0:
            continue
        judged = judged_rows(a.sample, rows)
        tokens += n
        steps[i] = int(judged.sum())
        ref = reference_tokens(ids[:n], rows, k, target)[judged]
        for s in states:
            aux = (training_aux if s[0] else serving_aux)[:rows]
            model = trained if s[1] else as_served
            reading = OFFSETS if s[2] else str(served_reading)
            drafts = greedy_chain(model, ids[1 : rows + 1], aux, k, reading)
            acc[s][i] = accepted_counts(drafts[judged], ref)
    keep = steps > 0
    if not keep.any():
        return Chains(k=k, topk=topk, why_not=f"no aligned request longer than {k + 2} tokens")
    realized = None
    rounds = [
        list(accept_by_key.get(a.serving.key, [])) for a, ok in zip(pairs, keep, strict=True) if ok
    ]
    if any(rounds):
        realized = realized_counts(rounds, k)
    else:
        u.note("impact: realized acceptance", "the trace records no verify rounds for these")
    return Chains(
        k=k,
        topk=topk,
        tokens=tokens,
        reference=(
            "the target's greedy choice at t+1+k while the stored tokens follow it; rows whose "
            "token t+2 is in the loss mask"
            if target is not None
            else "the stored token at t+2+k (no target model: not checked against its greedy "
            "choice)"
        ),
        counts={s: Counts(steps[keep], acc[s][keep]) for s in states},
        served=served,
        realized=realized,
        unavailable=u.frozen(),
    )


# -- the judge's half --------------------------------------------------------------------------
@dataclass(frozen=True)
class Impacts:
    """`by_finding[i]`: the impact of fixing fault i alone (None: `unavailable[i]` says why);
    `all`: of fixing every fault (with at least two that have one)."""

    by_finding: list[dict[str, Any] | None]
    unavailable: list[str | None]
    all: dict[str, Any] | None = None


def part_fixed_by(f: Finding, chains: Chains) -> tuple[str | None, str | None]:
    """(the part fault `f` fixes, why it has no impact)."""
    part = PART_OF.get(f.code)
    if part is None:
        return None, f"the replay cannot rebuild serving with only {f.code} fixed"
    if chains.served.get(part) is None:
        what = {
            "model": "the what-if search found no config misreading that reproduces the engine",
            "vocab": "the engine's d2t reading is offsets or was not recorded",
            "aux": "no serving capture",
        }[part]
        return None, f"{f.code}: {what}, so serving cannot be rebuilt as the engine ran it"
    return part, None


def _state(fixed: set[str]) -> State:
    return tuple(p in fixed for p in PARTS)  # type: ignore[return-value]


def impacts(findings: Sequence[Finding], chains: Chains | None) -> Impacts:
    faults = [f for f in findings if f.severity == "fault"]
    if chains is None or not chains.counts:
        why = (chains.why_not if chains is not None else None) or "the chains did not run"
        return Impacts([None] * len(faults), [why] * len(faults))
    served_state = _state({p for p in PARTS if chains.served.get(p) is None})
    base = chains.counts[served_state]
    out, why_not, parts = [], [], set()
    for f in faults:
        part, why = part_fixed_by(f, chains)
        if part is None:
            out.append(None)
            why_not.append(why)
            continue
        parts.add(part)
        fixed_state = tuple(b or p == part for b, p in zip(served_state, PARTS, strict=True))
        out.append(
            compare(
                base,
                chains.counts[fixed_state],  # type: ignore[index]
                chains.realized,
                chains.k,
                chains.topk,
                chains.tokens,
                chains.reference,
            )
        )
        why_not.append(None)
    every = None
    if sum(1 for x in out if x is not None) >= 2:
        every = compare(
            base,
            chains.counts[(True, True, True)],
            chains.realized,
            chains.k,
            chains.topk,
            chains.tokens,
            chains.reference,
        )
        every["parts_fixed"] = sorted(parts)
    return Impacts(out, why_not, every)


def verdict_phrase(impact: Mapping[str, Any] | None) -> str | None:
    """The sentence the verdict carries: what fixing it is worth, or that it costs nothing
    measurable on these tokens."""
    if not impact:
        return None
    s, f = impact["served"]["accept_length"], impact["fixed"]["accept_length"]
    if not impact["measurable"]:
        return (
            f"fixing this changes nothing measurable on these tokens (expected accept length "
            f"{s:.2f} → {f:.2f}, gain 95% CI {impact['gain_ci'][0]:+.2f}..{impact['gain_ci'][1]:+.2f}):"
            " still a fault, low priority"
        )
    verb = "raises" if f > s else "lowers"
    return f"fixing this {verb} the expected accept length {s:.2f} → {f:.2f}"


def impact_lines(impact: Mapping[str, Any]) -> list[str]:
    """The impact as the terminal and Markdown print it, one line each."""
    s, f, r = impact["served"], impact["fixed"], impact["realized"]

    def pp(x: Mapping[str, Any]) -> str:
        return "/".join(f"{p:.2f}" for p in x["per_position"])

    out = [
        f"expected accept length as served {s['accept_length']:.2f} "
        f"[{s['ci'][0]:.2f}, {s['ci'][1]:.2f}], fixed {f['accept_length']:.2f} "
        f"[{f['ci'][0]:.2f}, {f['ci'][1]:.2f}] (95% CI); gain {impact['gain']:+.2f}"
        + ("" if impact["measurable"] else " (not measurable)"),
        f"acceptance by draft position as served {pp(s)}, fixed {pp(f)} "
        f"(K={impact['num_speculative_tokens']}, {impact['steps']} verify steps on "
        f"{impact['tokens']} aligned tokens)",
    ]
    if r is not None:
        agrees = "agrees with" if impact["estimate_agrees"] else "does NOT agree with"
        out.append(
            f"realized in the trace {r['accept_length']:.2f} [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}]"
            f", by position {pp(r)}: {agrees} the as-served estimate"
        )
    return out
