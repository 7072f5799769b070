"""Sampled acceptance, explained: what each verify's own rule predicts, next to what the engine
accepted, and the target-side sampling transforms recomputed from the request's parameters.

The rule (Leviathan et al. 2023, Chen et al. 2023). At draft position j of a verify round, with
the earlier drafts accepted, the engine accepts the drafted token x with probability

    a_j = min(1, p_j(x) / q_j(x))

where p_j is the target's distribution after the engine's transforms (penalties, temperature,
top-k/top-p) and q_j the draft's; a one-hot draft (vLLM's default `draft_sample_method`
"greedy": the draft's argmax) has q_j(x) = 1, so a_j = p_j(x). Averaged over x ~ q_j this is
the familiar Σ_v min(p_j(v), q_j(v)); given the drafts the engine really proposed it is a_j.
A greedy request accepts x iff x = argmax p_j (a_j ∈ {0, 1}).

The spread. One uniform per position decides it, so over the positions a round reached (the
accepted ones and the first rejection), the accepted count A is a sum of independent
Bernoulli(a_j) draws given the drafts:

    E[A] = Σ_reached a_j,    Var[A] = Σ_reached a_j (1 - a_j).

An engine whose realized A lies more than Z_SPREAD standard deviations (plus SLACK tokens) from
E[A] accepts more or fewer than its own rule: `verify-rule`.

The transforms. vLLM's target side, in two stages recorded apart: the logit z of x penalised
by the request's history (the prompt and the output so far, including the round's earlier
drafts x_<j),

    z' = z / r if x seen and z > 0, z · r if x seen and z ≤ 0 (repetition r), else z
    z'' = z' - f · c(x) - π · 1[c(x) > 0]       (frequency f, presence π, c = output count)

then ℓ = z'' / T (temperature; greedy rows keep T = 1), then top-k/top-p mask tokens to -inf
(those are skipped; a NaN is never a mask). Each stage recomputed here against the engine's
own value: a mismatch is `sampling-transform`, named by its stage and the misreading that
reproduces it (penalties not applied, penalties that ignore the round's earlier drafts,
temperature not applied, another temperature).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hstrace.replay.read import ServingData, VerifyRound
from hstrace.replay.unavailable import Unavailable
from hstrace.trace.schema import NO_PENALTY

RULE_NAMES = {0: "greedy", 1: "one-hot", 2: "draft-probs", 3: "synthetic"}
Z_SPREAD = 4.0  # standard deviations of the binomial spread before the rule is doubted
SLACK = 1.0  # tokens: a greedy rule (σ = 0) still allows a tie broken the other way once
TRANSFORM_RTOL = 1e-3  # fp32 logits, the engine's own ops vs the formula above
GREEDY_T = 1e-5  # vLLM's _SAMPLING_EPS: below it a request is greedy


@dataclass(frozen=True)
class RuleSum:
    """Predicted vs realized accepted drafts over a set of rounds."""

    rounds: int
    reached: int  # positions the rounds reached (accepted + first rejection)
    predicted: float  # E[A]
    realized: int  # A
    sigma: float  # sqrt(Var[A])
    predicted_accept_len: float  # mean over rounds of Σ_k Π_{j≤k} a_j (drafts as proposed)
    realized_accept_len: float

    @property
    def z(self) -> float:
        return (self.realized - self.predicted) / self.sigma if self.sigma > 0 else 0.0

    @property
    def beyond_spread(self) -> bool:
        return abs(self.realized - self.predicted) > Z_SPREAD * self.sigma + SLACK

    def to_json(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "positions_reached": self.reached,
            "predicted_accepted": round(self.predicted, 3),
            "realized_accepted": self.realized,
            "sigma": round(self.sigma, 3),
            "z": round(self.z, 2),
            "predicted_accept_len": round(self.predicted_accept_len, 3),
            "realized_accept_len": round(self.realized_accept_len, 3),
        }


@dataclass(frozen=True)
class SampledAcceptance:
    by_rule: dict[str, RuleSum]  # rule name -> predicted vs realized
    transform_checked: int  # drafted tokens with at least one transform stage recomputed
    transform_mismatches: list[dict[str, Any]]  # the first ones, with their evidence
    transform_explained: dict[str, int]  # misreading -> how many mismatches it reproduces
    n_mismatched: int
    by_stage: dict[str, int] = field(default_factory=dict)  # "penalties"/"temperature" -> count
    # Drafted tokens each stage was recomputed on: every checked token's penalties; the
    # temperature only where the penalties agree and top-k/top-p left the token unmasked.
    checked_by_stage: dict[str, int] = field(default_factory=dict)
    masked: int = 0  # checked tokens masked by top-k/top-p (their temperature not comparable)
    unavailable: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        if not self.by_rule and not self.transform_checked:
            return {}
        out: dict[str, Any] = {
            "sampled_acceptance": {
                "by_rule": {k: v.to_json() for k, v in self.by_rule.items()},
                "transform_checked": self.transform_checked,
                "transform_checked_by_stage": dict(self.checked_by_stage),
                "transform_masked": self.masked,
                "transform_mismatched": self.n_mismatched,
                "transform_mismatched_by_stage": self.by_stage,
            }
        }
        sums = list(self.by_rule.values())
        if sums:  # over every judged round, whatever its rule (the summary table's lines)
            pred = sum(s.predicted for s in sums)
            out["verify_rule_predicted_accepted"] = round(pred, 3)
            out["verify_rule_realized_accepted"] = sum(s.realized for s in sums)
            sigma = math.sqrt(sum(s.sigma**2 for s in sums))
            out["verify_rule_sigma"] = round(sigma, 3)
        return out


def acceptance_probability(rule: int, p: np.ndarray, q: np.ndarray, greedy_hit: np.ndarray):
    """a_j of each drafted token under `rule` (module docstring). A NaN p is a rejection, as in
    the engine's own comparison `p / q >= u` (False for NaN)."""
    p = np.nan_to_num(p, nan=0.0)
    if rule == 0:
        return greedy_hit.astype(np.float64)
    if rule == 1:
        return np.clip(p, 0.0, 1.0)
    return np.where(q > 0, np.minimum(1.0, p / np.where(q > 0, q, 1.0)), 0.0)


def _round_terms(v: VerifyRound) -> tuple[np.ndarray, int]:
    t = v.tokens
    p = t["p_target"].astype(np.float64)
    q = t["q_draft"].astype(np.float64)
    hit = t["target_argmax"].astype(np.int64) == v.drafts
    a = acceptance_probability(v.rule, p, q, hit)
    reached = min(v.accepted + 1, len(v.drafts))
    return a, reached


def rule_sums(rounds: list[VerifyRound]) -> dict[str, RuleSum]:
    by: dict[str, list[VerifyRound]] = {}
    for v in rounds:
        if v.rule in (0, 1, 2) and len(v.drafts):
            by.setdefault(RULE_NAMES[v.rule], []).append(v)
    out = {}
    for name, vs in by.items():
        pred = var = 0.0
        reached = realized = 0
        len_pred = []
        for v in vs:
            a, n = _round_terms(v)
            pred += float(a[:n].sum())
            var += float((a[:n] * (1.0 - a[:n])).sum())
            reached += n
            realized += v.accepted
            len_pred.append(float(np.cumprod(a).sum()))
        out[name] = RuleSum(
            rounds=len(vs),
            reached=reached,
            predicted=pred,
            realized=realized,
            sigma=math.sqrt(var),
            predicted_accept_len=float(np.mean(len_pred)),
            realized_accept_len=realized / len(vs),
        )
    return out


def penalised(z: float, seen: bool, count: int, params: dict[str, float]) -> float:
    r = params.get("repetition_penalty", NO_PENALTY["repetition_penalty"])
    r = 1.0 if not np.isfinite(r) else r
    if seen and r != 1.0:
        z = z / r if z > 0 else z * r
    f = params.get("frequency_penalty", NO_PENALTY["frequency_penalty"])
    pr = params.get("presence_penalty", NO_PENALTY["presence_penalty"])
    z -= (0.0 if not np.isfinite(f) else f) * count
    z -= (0.0 if not np.isfinite(pr) else pr) * (1.0 if count > 0 else 0.0)
    return z


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TRANSFORM_RTOL * (1.0 + abs(a))


def _temperature(params: dict[str, float]) -> float:
    t = params.get("temperature", float("nan"))
    return 1.0 if not np.isfinite(t) or t < GREEDY_T else t


def _penalty_inputs(v: VerifyRound, j: int) -> tuple[bool, int, dict[str, float]]:
    t = v.tokens
    x = int(v.drafts[j])
    seen_prompt, n_out = int(t["seen_prompt"][j]), int(t["n_out"][j])
    if seen_prompt < 0:  # the engine applied no penalties: the request asked for none
        return False, 0, {**v.params, **NO_PENALTY}
    count = n_out + int((v.drafts[:j] == x).sum())
    return bool(seen_prompt) or count > 0, count, v.params


def token_transform(v: VerifyRound, j: int) -> dict[str, Any] | None:
    """Draft j's target logit through the two transforms, engine next to reference (None: not
    recorded). Stage "penalties": the raw logit penalised by the request's history vs the
    engine's logit after its penalties; stage "temperature": that logit over the request's
    temperature vs the engine's processed logit (-inf = masked by top-k/top-p: skipped; NaN is
    never a mask). With `explained` when a stage differs: every misreading that reproduces the
    engine's value. A token masked after its penalties (by top-k/top-p: -inf) has its
    penalties checked and its temperature stage not comparable: stage "penalties", `masked`."""
    t = v.tokens
    z, pen, got = (float(t[k][j]) for k in ("logit_raw", "logit_pen", "logit_proc"))
    if not (np.isfinite(z) and np.isfinite(pen)):
        return None
    x = int(v.drafts[j])
    seen, count, params = _penalty_inputs(v, j)
    temp = _temperature(v.params)
    want_pen = penalised(z, seen, count, params)
    row: dict[str, Any] = {"token": x, "position": j, "raw_logit": z}
    if not _close(want_pen, pen):
        n_out = int(t["n_out"][j])
        readings = {
            "penalties not applied": z,
            "penalties ignore the round's earlier drafts (applied once per step)": penalised(
                z, int(t["seen_prompt"][j]) > 0 or n_out > 0, n_out, params
            ),
        }
        row |= {"stage": "penalties", "engine": pen, "reference": want_pen}
        row["explained"] = [k for k, val in readings.items() if _close(val, pen)]
        return row
    if got == float("-inf"):  # masked by top-k / top-p: only the penalties are comparable
        return row | {"stage": "penalties", "engine": pen, "reference": want_pen, "masked": True}
    want = pen / temp
    row |= {"stage": "temperature", "engine": got, "reference": want}
    if _close(want, got):
        return row
    if not np.isfinite(got):
        row["explained"] = [
            f"processed logit {got} (the verify's temperature or top-p is not the request's)"
        ]
        return row
    implied = pen / got if got != 0 else float("inf")
    row["implied_temperature"] = implied
    row["explained"] = (
        ["temperature not applied"]
        if _close(pen, got)
        else [f"temperature applied is not the request's {temp:g}"]
    )
    return row


def build_sampled_acceptance(serving: ServingData, max_listed: int = 10) -> SampledAcceptance:
    u = Unavailable()
    rounds = serving.verify_rounds
    if not rounds:  # a trace without the rule columns (SGLang, vLLM V2, older hstrace)
        return SampledAcceptance({}, 0, [], {}, 0, unavailable=u.frozen())
    if all(v.rule < 0 for v in rounds):
        u.note("sampled acceptance", "the verify tap recorded no rule inputs (it was disabled)")
        return SampledAcceptance({}, 0, [], {}, 0, unavailable=u.frozen())
    sums = u.guarded("sampled acceptance", lambda: rule_sums(rounds)) or {}
    if any(v.rule == 3 for v in rounds):
        u.note("verify rule (synthetic)", "synthetic acceptance rates are not a function of p, q")
    if any(v.rule == 2 for v in rounds):
        u.note(
            "draft-side sampling transform",
            "the draft's own transform (vLLM: temperature only) is not recomputed; q is taken "
            "as the engine gave it",
        )
    checked, mismatches, explained, n_bad, masked, unknown, premasked = 0, [], {}, 0, 0, 0, 0
    by_stage: dict[str, int] = {}
    checked_by_stage = {"penalties": 0, "temperature": 0}

    def scan() -> None:
        nonlocal checked, n_bad, masked, unknown, premasked
        for v in rounds:
            if v.rule < 0:
                continue
            for j in range(len(v.drafts)):
                row = token_transform(v, j)
                if row is None:
                    raw, pen = v.tokens["logit_raw"][j], v.tokens["logit_pen"][j]
                    if np.isfinite(raw):
                        # without its logit after the engine's processors: one the hooks do
                        # not rerun (vLLM's thinking budget) changed the row; or masked by
                        # them (-inf: min_tokens' stop tokens, bad words, allowed tokens),
                        # which the reference does not model
                        unknown += bool(np.isnan(pen))
                        premasked += bool(pen == float("-inf"))
                    continue
                checked += 1
                checked_by_stage["penalties"] += 1
                checked_by_stage["temperature"] += row["stage"] == "temperature"
                masked += bool(row.get("masked"))
                if "explained" in row:
                    n_bad += 1
                    by_stage[row["stage"]] = by_stage.get(row["stage"], 0) + 1
                    for why in row["explained"] or ["unexplained"]:
                        explained[why] = explained.get(why, 0) + 1
                    if len(mismatches) < max_listed:
                        mismatches.append({"req_key": v.key, "verify_step": v.step, **row})

    u.guarded("sampling transform", scan)
    why = []
    if unknown:
        why.append(
            f"{unknown} drafted tokens' logits after the engine's processors were not recorded "
            "(a processor the hooks do not rerun changed their rows: vLLM's thinking budget)"
        )
    if premasked:
        why.append(
            f"{premasked} drafted tokens were masked (-inf) by the engine's processors before "
            "the temperature (vLLM: min_tokens' stop tokens, bad words, allowed token ids), "
            "which the reference does not model"
        )
    if why:
        u.note("sampling transform (some tokens)", "; ".join(why) + ": not judged")
    return SampledAcceptance(
        sums,
        checked,
        mismatches,
        explained,
        n_bad,
        by_stage,
        checked_by_stage=checked_by_stage if checked else {},
        masked=masked,
        unavailable=u.frozen(),
    )
