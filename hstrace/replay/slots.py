"""Evidence `Slots`: which hidden states the serving aux slots hold, next to the training slots.

Raw rows or sketches (the choice is the alignment's, made once); the serving x training slot
matrix on aligned tokens, per-slot health, rows crossed between requests, and with the target
at hand which physical layer each slot holds and how far the target's own serving dtype moves
it from fp32 (what `target-drift` is judged against).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hstrace.reference.target import ReferenceTarget
from hstrace.replay.align import Alignment
from hstrace.replay.compare import (
    SAME_COS,
    LayerFingerprint,
    SlotHealth,
    SlotMatrix,
    layer_fingerprint,
    rows_of_other_requests,
    slot_matrix,
)
from hstrace.replay.runner import CaptureScan
from hstrace.replay.unavailable import Unavailable


@dataclass(frozen=True)
class Slots:
    serving: torch.Tensor | None  # [N, Ks, Ht] over all aligned tokens (sketched: [N, K, D])
    training: torch.Tensor | None  # [N, Kt, Ht]
    matrix: SlotMatrix | None
    health: list[SlotHealth] | None  # per serving slot, over every captured row
    # Per request, captured rows that cannot be hidden states (a slot all zero or not finite)
    # and positions that have no target row although they should (`hidden-corrupt`).
    dead_rows: list[dict[str, Any]]
    # (serving request, training request, cos); looked for only when the slots differ
    crossed: list[tuple[int, int, float]]
    target_layers: torch.Tensor | None  # [N, L+1, Ht] reference target forward, aligned rows
    # (serving slots, training slots) each matched to a target layer
    fingerprints: tuple[LayerFingerprint, LayerFingerprint] | None
    # Per serving slot: mean cos(target forward in the serving dtype, fp32 forward) at the HF
    # layer the slot holds; only when both sides hold the same layers and differ (the one
    # case it judges), as it costs a second target forward.
    target_own_cos: list[float] | None
    # HF indices of the training slots: fingerprinted, else as the data or drafter config say
    training_layers: list[int] | None
    unavailable: dict[str, str] = field(default_factory=dict)


def build_slots(
    al: Alignment,
    cfg: Any,
    load_report: Any,
    target: ReferenceTarget | None,
    tick: Callable[[str, int], None],
    scan: CaptureScan,
) -> Slots:
    u = Unavailable()
    pair = u.guarded("slot fingerprints", lambda: _slot_pair(al, u))
    matrix = slot_matrix(*pair) if pair is not None else None
    health = u.guarded("slot health", scan.health)  # one read of every request's rows
    dead = u.guarded("dead rows", scan.dead_rows) or []
    # Rows crossed between requests explain slots that differ on the same tokens: looked for
    # only then (a cosine of every request's rows against every sample's).
    differ = matrix is not None and not (np.diag(matrix.cos) >= SAME_COS).all()
    crossed = (u.guarded("crossed requests", lambda: _crossed(al)) or []) if differ else []
    layers = None  # fingerprints need slots to name: without them, no target forward
    if pair is not None and target is None:
        u.note("layer fingerprints", "no target model (give --target DIR)")
    elif pair is not None:
        layers = u.guarded("layer fingerprints", lambda: _target_layers(al, target, tick))
    fps = None
    if pair is not None and layers is not None:
        if pair[0].shape[-1] != layers.shape[-1]:
            u.note("layer fingerprints", "slot width differs from the target's hidden size")
        else:
            fps = (layer_fingerprint(pair[0], layers), layer_fingerprint(pair[1], layers))
    own = None
    if fps is not None and fps[0].layer == fps[1].layer and differ:
        own = u.guarded("target own precision gap", lambda: _own_cos(al, target, layers, fps, tick))
    return Slots(
        serving=pair[0] if pair is not None else None,
        training=pair[1] if pair is not None else None,
        matrix=matrix,
        health=health,
        dead_rows=dead,
        crossed=crossed,
        target_layers=layers,
        fingerprints=fps,
        target_own_cos=own,
        training_layers=_training_layers(al, cfg, load_report, fps),
        unavailable=u.frozen(),
    )


def _slot_pair(al: Alignment, u: Unavailable) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(serving [N, Ks, Ht], training [N, Kt, Ht]) over all aligned tokens; for a bundle
    with hidden states redacted, both sides as sketches [N, K, D]."""
    ht = al.slot_width
    if not al.aligned or ht is None or al.serving_width is None:
        u.note("slot fingerprints", "no aligned tokens with recorded aux hidden states")
        return None
    if al.sketched:
        tw = int(al.aligned[0].sample.aux.shape[-1])
        if al.sketch_slot_width != tw:
            u.note(
                "slot fingerprints",
                f"serving slots were sketched from width {al.sketch_slot_width}, training "
                f"slots are {tw} wide: sketches of different widths do not compare",
            )
            return None
    elif al.serving_width % ht:
        u.note(
            "slot fingerprints",
            f"serving aux width {al.serving_width} is not a multiple of the slot width {ht}",
        )
        return None
    s = torch.cat([al.serving_slots_of(a.serving, a.n) for a in al.aligned])
    t = torch.cat([al.training_slots_of(a) for a in al.aligned])
    return s, t


def _crossed(al: Alignment) -> list[tuple[int, int, float]]:
    s = [al.serving_slots_of(a.serving, a.n) for a in al.aligned]
    t = [al.training_slots_of(a) for a in al.aligned]
    if s and s[0].shape[1] != t[0].shape[1]:
        return []
    return rows_of_other_requests(s, t)


def _target_layers(
    al: Alignment, target: ReferenceTarget, tick: Callable[[str, int], None]
) -> torch.Tensor:
    out = []
    for a in al.aligned:
        layers = target.forward(torch.as_tensor(a.sample.input_ids[: a.n]).long()).layers
        layers = layers[a.start :]
        out.append(al.sketch(layers.float()) if al.sketched else layers)
        tick("target forward", a.n)
    return torch.cat(out)


def _own_cos(
    al: Alignment,
    target: ReferenceTarget,
    ref: torch.Tensor,
    fps: tuple[LayerFingerprint, LayerFingerprint],
    tick: Callable[[str, int], None],
) -> list[float]:
    """How far the target moves from its fp32 self in the serving dtype alone (bf16 MoE
    routing flips), on the aligned rows the slots use."""
    if al.serving_dtype == torch.float32:
        return [1.0] * len(fps[0].layer)
    out = []
    for a in al.aligned:
        ids = torch.as_tensor(a.sample.input_ids[: a.n]).long()
        layers = target.layers_in(ids, al.serving_dtype)[a.start :]
        out.append(al.sketch(layers.float()) if al.sketched else layers)
        tick("target forward (serving dtype)", a.n)
    lowp = torch.cat(out)
    cos = []
    for layer in fps[0].layer:
        x, y = lowp[:, layer], ref[:, layer]
        c = (x * y).sum(-1) / (x.norm(dim=-1) * y.norm(dim=-1)).clamp_min(1e-12)
        cos.append(float(c.mean()))
    return cos


def _training_layers(
    al: Alignment,
    cfg: Any,
    load_report: Any,
    fps: tuple[LayerFingerprint, LayerFingerprint] | None,
) -> list[int] | None:
    if fps is not None:
        return list(fps[1].layer)
    from hstrace.training.conventions import BEFORE_LAYER, hf_index

    samples = al.samples
    if samples and samples[0].slot_layer_ids:
        conv = (samples[0].provenance or {}).get("layer_id_convention", BEFORE_LAYER)
        return [hf_index(i, conv) for i in samples[0].slot_layer_ids]
    if cfg is not None and cfg.aux_layer_ids:
        from hstrace.replay.align import drafter_aux_layers

        return drafter_aux_layers(cfg, getattr(load_report, "dialect", None), 0)[0]
    return None
