"""Stage `target-capture`: do the serving aux slots hold the states the drafter trained on?

Decided from numbers, never from labels: per-slot health (zeros, constant rows), the serving x
training slot matrix on aligned tokens, crossed requests, and, when the target model is at
hand, which physical layer each slot holds. One classification, in the order that makes each
answer specific: corrupt → layout (count, embedding slot) → order → drift (same layers, not
the same numbers) → shift by one layer → default layers → other layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hstrace.engines.registry import aux_ids_fixes, prefix_cache_flags
from hstrace.findings import Finding, finding
from hstrace.replay.compare import SAME_COS, UNRELATED_COS
from hstrace.replay.evidence import Evidence
from hstrace.training.conventions import default_hf_indices

# A recorded slot that matches no target layer this well is not a hidden state of the target.
LAYER_MATCH_COS = 0.9
# A side (serving or training) drifted only when its distance from the fp32 reference, 1 - cos,
# exceeds this many times the target's own serving-dtype distance on the same rows. Another
# engine's bf16 kernels (GPU tensor cores, fused MoE, other accumulation orders and therefore
# other routing flips) land at the same order of distance from fp32 as the reference's own bf16
# run, not at the same point: x4 in 1 - cos is twice the angle, room for that and no more; an
# FP8 checkpoint or another set of weights is one to two orders of magnitude further.
OWN_GAP_FACTOR = 4.0


def _prefix_hint() -> str:
    return (
        " (the leading rows: typically the cached prompt prefix, whose states the engine "
        "zero-fills instead of taking them from the cache; serve once with the prefix cache "
        f"off, {prefix_cache_flags()}, to confirm)"
    )


def _layers(train_hf: list[int]) -> dict[str, Any]:
    """The fields of the registry's layer fix (`hstrace.findings`, variant ""): the layers, and
    what each serving engine's draft config needs to capture them (the engine registry's
    `aux_ids_fixes`)."""
    return {"train_hf": train_hf, "engine_ids": aux_ids_fixes(train_hf)}


@dataclass(frozen=True)
class Reading:
    """What the serving aux slots hold, read once from the evidence: one `code` (or None:
    nothing wrong), the summary, the evidence and the registry's fix variant and fields. The
    checks below each report one code of it."""

    code: str
    summary: str
    evidence: dict[str, Any]
    variant: str = ""
    fields: dict[str, Any] = field(default_factory=dict)

    def findings(self, code: str) -> list[Finding]:
        if self.code != code:
            return []
        return [
            finding(self.code, self.summary, self.evidence, variant=self.variant, **self.fields)
        ]


def dead_rows(ev: Evidence) -> list[dict[str, Any]]:
    """Per request, the captured rows that cannot be hidden states (a slot exactly zero or not
    finite) and the positions that have no target row although they should: found while the
    evidence read each request's rows (`Slots.dead_rows`, `hstrace.replay.runner`)."""
    return ev.slots.dead_rows


def _partly_dead(ev: Evidence) -> Reading | None:
    found = dead_rows(ev)
    if not found:
        return None
    total = sum(f["rows"] for f in found)
    first = found[0]
    spans = ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in first["positions"][:4])
    prefix = any(
        f["kind"] != "missing" and f["positions"][0][0] == 0 and f["rows"] < f["of_rows"]
        for f in found
    )
    return Reading(
        "hidden-corrupt",
        f"{total} serving aux row(s) are {first['kind']} in {len(found)} request(s), e.g. "
        f"{first['request']} positions {spans} ({first['rows']} of {first['of_rows']} rows): "
        "the capture did not cover them (the drafter's hidden input there is unknown or "
        "zero)",
        {"dead_rows": found[:20], "requests": len(found), "rows": total},
        "rows",
        {"prefix_hint": _prefix_hint() if prefix else ""},
    )


def read_capture(ev: Evidence) -> Reading | None:
    """The one classification of the captured slots, in the order that makes each answer
    specific (module docstring); None when the slots hold what training holds."""
    cfg = ev.cfg
    width = ev.serving_width
    if cfg is not None and width == cfg.hidden_size and width != ev.fc_in:
        return None  # one H-wide state instead of the concat: fc-skipped, a draft-input fault
    dead = _dead_slots(ev) or _partly_dead(ev)
    if dead is not None:  # never target-drift: dead rows drag every cosine down
        return dead
    if ev.slots.serving is None:
        return None  # `skipped` says why (slot fingerprints)
    evidence = _matrix_evidence(ev)
    ks, kt = evidence["serving_slots"], evidence["training_slots"]
    m = ev.slots.matrix
    fps = ev.slots.fingerprints
    if ks != kt:
        return Reading(
            "slot-layout",
            f"serving delivers {ks} aux slots, the training data has {kt}",
            evidence,
            "count",
        )
    diag = np.diag(m.cos)
    if (diag >= SAME_COS).all():
        return None
    crossed = ev.slots.crossed
    if crossed and ev.batch.coupled:
        return None  # rows of a request of the same batch: batch-coupling says whose
    if crossed:
        i, j, c = crossed[0]
        return Reading(
            "hidden-corrupt",
            f"serving aux rows of request {i} are the training rows of request {j} "
            f"(cos {c:.4f}): rows crossed between requests",
            {**evidence, "crossed": [list(x) for x in crossed[:10]]},
            "crossed",
        )
    best = m.cos.argmax(axis=1)
    if sorted(best.tolist()) == list(range(ks)) and (m.cos[np.arange(ks), best] >= SAME_COS).all():
        return Reading(
            "aux-order",
            f"serving concatenates the aux slots in order {best.tolist()} of the training order",
            {**evidence, "serving_slot_is_training_slot": best.tolist()},
            fields={"permutation": best.tolist()},
        )
    if fps is not None:
        return _by_layers(ev, evidence, diag, fps)
    return _by_labels(ev, evidence, diag)


def _dead_slots(ev: Evidence) -> Reading | None:
    """A whole slot all-zero or constant (per-slot health over every captured row)."""
    health = ev.slots.health
    bad = [i for i, h in enumerate(health or []) if h.corrupt]
    if not bad:
        return None
    h = health[bad[0]]
    kind = "all-zero" if h.zero_rows > 0.5 else "constant (identical rows)"
    return Reading(
        "hidden-corrupt",
        f"serving aux slot(s) {bad} are {kind}: the capture did not track the tokens",
        {
            "slots": bad,
            "zero_row_fraction": [round(x.zero_rows, 4) for x in health],
            "constant": [x.constant for x in health],
        },
        "slots",
    )


def _matrix_evidence(ev: Evidence) -> dict[str, Any]:
    """The serving x training slot matrix (and the layer fingerprints) as every capture
    finding quotes them."""
    m = ev.slots.matrix
    fps = ev.slots.fingerprints
    ks, kt = ev.slots.serving.shape[1], ev.slots.training.shape[1]
    evidence: dict[str, Any] = {
        "serving_slots": ks,
        "training_slots": kt,
        "slot_cos": np.round(m.cos, 4).tolist(),
        "slot_rel_norm": np.round(m.rel_norm, 4).tolist(),
    }
    if ev.sketched:  # a `--redact hidden` bundle: cosines between seeded projections
        evidence["fingerprinted_from"] = "per-slot sketches (hidden states redacted)"
    if fps is not None:
        evidence["serving_layers"] = fps[0].layer
        evidence["training_layers"] = fps[1].layer
        evidence["serving_layer_cos"] = [round(c, 4) for c in fps[0].cos]
    return evidence


def _by_layers(ev: Evidence, evidence: dict[str, Any], diag: np.ndarray, fps) -> Reading | None:
    """With the target at hand: which physical layer each slot holds decides."""
    m = ev.slots.matrix
    s_layers, t_layers = fps[0].layer, fps[1].layer
    unmatched = [i for i, c in enumerate(fps[0].cos) if c < LAYER_MATCH_COS]
    if unmatched and (m.cos[unmatched].max(axis=1) < UNRELATED_COS).all():
        return Reading(
            "hidden-corrupt",
            f"serving aux slot(s) {unmatched} match no layer of the target and no training "
            "slot: they are not the target's hidden states for these tokens",
            evidence,
            "unrelated",
        )
    if 0 in t_layers and 0 not in s_layers:
        return Reading(
            "slot-layout",
            f"the training data's slot {t_layers.index(0)} is the embedding (HF index 0) "
            f"while serving captures layers {s_layers}: the stored layout "
            f"{t_layers} was read as aux layers",
            evidence,
            "embedding-slot",
        )
    if s_layers == t_layers:
        return _judged_drift(ev, evidence, diag, fps)
    d = np.array(s_layers) - np.array(t_layers)
    if len(set(d.tolist())) == 1 and abs(int(d[0])) == 1:
        return Reading(
            "aux-layer-shift",
            f"serving captured HF layers {s_layers}, training used {t_layers}: every slot "
            f"is shifted by {int(d[0]):+d} layer (a layer-id convention read off by one)",
            {**evidence, "shift": int(d[0])},
            fields=_layers(t_layers),
        )
    if ev.target is not None and s_layers == default_hf_indices(ev.target.num_layers):
        return Reading(
            "aux-layers-default",
            f"serving captured the default layers {s_layers}; the drafter was trained on "
            f"{t_layers}: the configured aux layer ids were not applied",
            evidence,
            fields=_layers(t_layers),
        )
    return Reading(
        "slot-layout",
        f"serving captured HF layers {s_layers}, training stored {t_layers}",
        evidence,
        fields=_layers(t_layers),
    )


def _by_labels(ev: Evidence, evidence: dict[str, Any], diag: np.ndarray) -> Reading:
    """Without a target: only the slot matrix and the static audit's labels remain."""
    m = ev.slots.matrix
    train_hf = ev.slots.training_layers
    if (diag >= 0.95).all() and np.allclose(np.diag(m.rel_norm), 1.0, atol=0.1):
        return _drift(evidence, diag)
    captured = (ev.static.get("capture") or {}).get("layers_to_capture")
    if captured and train_hf and len(captured) == len(train_hf):
        d = np.array(sorted(captured)) - np.array(train_hf)
        evidence.update({"static_layers_to_capture": captured, "training_layers": train_hf})
        if len(set(d.tolist())) == 1 and abs(int(d[0])) == 1:
            return Reading(
                "aux-layer-shift",
                f"serving captured layers {sorted(captured)} (static audit), training used "
                f"{train_hf}: shifted by {int(d[0]):+d}",
                {**evidence, "shift": int(d[0])},
                fields=_layers(train_hf),
            )
    return Reading(
        "slot-layout",
        "serving aux slots do not match the training slots on the same tokens "
        f"(diagonal cos {np.round(diag, 3).tolist()})",
        evidence,
        "no-target",
    )


def _judged_drift(ev: Evidence, evidence: dict[str, Any], diag: np.ndarray, fps) -> Reading | None:
    """Same layers, not the same numbers: drift, or only the target's own precision gap?

    Both sides are measured against the fp32 reference forward at the layer each slot holds
    (`fps[k].cos`) and compared with the target's own serving-dtype-vs-fp32 cosine on the same
    rows; a side drifted where its 1 - cos exceeds OWN_GAP_FACTOR times the target's own (and
    the fixed bf16 storage floor SAME_COS). A DeepSeek-V3/Kimi MoE served in bf16 sits at cos
    0.995-0.998 from fp32 through routing flips alone, and its training data, generated in
    fp32 or by another bf16 engine, is as far: not drift."""
    own = ev.slots.target_own_cos
    if own is None:
        return _drift(evidence, diag)
    serving_cos, training_cos = list(fps[0].cos), list(fps[1].cos)

    def limit(c_own: float) -> float:
        return min(SAME_COS, 1.0 - OWN_GAP_FACTOR * (1.0 - c_own))

    lim = [limit(c) for c in own]
    s_bad = [i for i, c in enumerate(serving_cos) if c < lim[i]]
    t_bad = [i for i, c in enumerate(training_cos) if c < lim[i]]
    dtype = str(ev.alignment.serving_dtype).removeprefix("torch.")
    judged = {
        "serving_dtype": dtype,
        "serving_vs_fp32_cos": [round(c, 6) for c in serving_cos],
        "training_vs_fp32_cos": [round(c, 6) for c in training_cos],
        "target_own_cos": [round(c, 6) for c in own],
        "drift_below_cos": [round(c, 6) for c in lim],
        "own_gap_factor": OWN_GAP_FACTOR,
    }
    if not s_bad and not t_bad:
        return None  # both sides within the target's own precision gap: noise, not drift
    side, bad, cos_of = (
        ("serving", s_bad, serving_cos) if s_bad else ("training", t_bad, training_cos)
    )
    i = bad[0]
    both = " (the training side too)" if s_bad and t_bad else ""
    return Reading(
        "target-drift",
        f"{side} aux slot(s) {bad} hold the same layers as training but are further from the "
        f"fp32 target than {dtype} alone moves it: {side} cos {cos_of[i]:.5f} vs the target's "
        f"own {dtype}-vs-fp32 cos {own[i]:.5f} on the same rows (HF layer "
        f"{fps[0].layer[i]}; drift below {lim[i]:.5f}){both}",
        {
            **evidence,
            **judged,
            "diag_cos": np.round(diag, 6).tolist(),
            "drifted": "both" if s_bad and t_bad else side,
            "serving_drift_slots": s_bad,
            "training_drift_slots": t_bad,
        },
    )


def _drift(evidence: dict[str, Any], diag: np.ndarray) -> Reading:
    return Reading(
        "target-drift",
        "serving and training aux hold the same layers but differ beyond precision noise "
        f"(per-slot cos {np.round(diag, 4).tolist()}, bf16 noise would give > {SAME_COS}; no "
        "target model to measure its own precision gap, give --target DIR)",
        {**evidence, "diag_cos": np.round(diag, 6).tolist()},
    )


# -- one check per code: each reports its own code of the one reading -----------------------
def _of(ev: Evidence, code: str) -> list[Finding]:
    reading = read_capture(ev)
    return reading.findings(code) if reading is not None else []


def hidden_corrupt(ev: Evidence) -> list[Finding]:
    return _of(ev, "hidden-corrupt")


def slot_layout(ev: Evidence) -> list[Finding]:
    return _of(ev, "slot-layout")


def aux_order(ev: Evidence) -> list[Finding]:
    return _of(ev, "aux-order")


def target_drift(ev: Evidence) -> list[Finding]:
    return _of(ev, "target-drift")


def aux_layer_shift(ev: Evidence) -> list[Finding]:
    return _of(ev, "aux-layer-shift")


def aux_layers_default(ev: Evidence) -> list[Finding]:
    return _of(ev, "aux-layers-default")
