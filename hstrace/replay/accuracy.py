"""Evidence `Step0Accuracy`: step-0 accuracy of the reference drafter on each side, and the training
side's own numbers (the library's teacher metric, what greedy serving would accept, which norm
form the stored final state is in).

- `serving`: on the serving capture with the committed tokens (aux row t, fed token t+1,
  predicts t+2), mapped to target ids.
- `training` / `serving_aligned`: on the aligned training tensors and on the serving capture of
  the same tokens (same rows, same labels, loss-masked: directly comparable).
- `full_vocab`: the library's step-0 accuracy (teacher restricted to the draft vocab) next to
  the full-vocab target argmax (what greedy serving accepts), on the training rows.
- `teacher_state`: the stored final state's scale against the pre-norm final stream and the
  post-norm lm_head input of the reference target.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hstrace.drafter.vocab import draft_vocab_targets, map_draft_ids
from hstrace.reference.step0 import Step0Input
from hstrace.reference.target import ReferenceTarget
from hstrace.replay.align import AlignedPair
from hstrace.replay.compare import agreement
from hstrace.replay.runner import CaptureScan, DrafterRunner
from hstrace.replay.unavailable import Unavailable


@dataclass(frozen=True)
class TrainingStep0:
    """Step-0 on the aligned training tensors."""

    logits: torch.Tensor  # [R, Vd]
    labels: torch.Tensor  # [R] token t+2
    mask: torch.Tensor  # [R] the library's loss mask
    rows: list[tuple[AlignedPair, int]]  # per aligned sample: its rows 0..n-1

    @property
    def judged(self) -> torch.Tensor:
        """The loss-masked rows (all rows when the mask is empty)."""
        return self.mask if self.mask.any() else torch.ones_like(self.mask)


@dataclass(frozen=True, kw_only=True)
class Step0Accuracy:
    serving: float | None  # acc0_serving
    training: float | None  # acc0_training
    serving_aligned: float | None  # acc0_serving_aligned
    training_step0: TrainingStep0 | None
    # {acc0_training_teacher, acc0_training_full_vocab, draft_vocab_coverage_of_target_argmax}
    full_vocab: dict[str, float] | None
    # {claimed, measured, rel_norm_to_pre_norm_final, rel_norm_to_post_norm_final}
    teacher_state: dict[str, Any] | None
    # (stored / pre-norm final, stored / post-norm final) mean norms, unrounded
    teacher_rel_norms: tuple[float, float] | None
    unavailable: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in (
            ("acc0_training", self.training),
            ("acc0_serving", self.serving),
            ("acc0_serving_aligned", self.serving_aligned),
        ):
            if value is not None:
                out[name] = round(float(value), 6)
        if self.teacher_state is not None:
            out["teacher_state"] = dict(self.teacher_state)
        if self.full_vocab is not None:
            out.update({k: round(v, 6) for k, v in self.full_vocab.items()})
        return out


def build_accuracy(
    runner: DrafterRunner, target: ReferenceTarget | None, scan: CaptureScan
) -> Step0Accuracy:
    u = Unavailable()
    runs = runner.can_run and runner.alignment.fc_in is not None
    ts = u.guarded("acc0_training", lambda: _training_step0(runner, u)) if runs else None
    acc_training = None
    if ts is not None:
        acc_training = u.guarded(
            "acc0_training",
            lambda: agreement(
                runner.map_to_target(ts.logits.argmax(-1))[ts.judged], ts.labels[ts.judged]
            ),
        )
    acc_serving = u.guarded("acc0_serving", lambda: _serving(runner, u, scan)) if runs else None
    aligned = None
    if ts is not None:
        aligned = u.guarded("acc0_serving_aligned", lambda: _serving_aligned(runner, ts))
    full_vocab, teacher, rel = None, None, None
    if target is None:
        u.note("teacher test", "no target model (give --target DIR)")
    else:
        got = u.guarded("teacher test", lambda: _teacher_state(runner, target))
        teacher, rel = got if got is not None else (None, None)
        if ts is not None:
            full_vocab = u.guarded(
                "library metric vs full vocab", lambda: _full_vocab(runner, target, ts)
            )
    return Step0Accuracy(
        serving=acc_serving,
        training=acc_training,
        serving_aligned=aligned,
        training_step0=ts,
        full_vocab=full_vocab,
        teacher_state=teacher,
        teacher_rel_norms=rel,
        unavailable=u.frozen(),
    )


def _serving(runner: DrafterRunner, u: Unavailable, scan: CaptureScan) -> float | None:
    """On every request's capture with the committed tokens (run in `CaptureScan`'s one read
    of the captured rows, request batch by batch)."""
    al = runner.alignment
    value, ran = scan.serving_acc0()
    if not ran:
        if al.sketched:
            why = "hidden states redacted: the drafter needs them, sketches cannot feed fc"
        elif al.serving_width is None:
            why = "no recorded aux hidden states"
        else:
            why = f"serving aux width {al.serving_width} != the drafter's fc input {al.fc_in}"
        u.note("serving step-0 accuracy", why)
        return None
    return value


def _training_step0(runner: DrafterRunner, u: Unavailable) -> TrainingStep0 | None:
    al = runner.alignment
    if not al.aligned:
        return None
    items, labels, masks, idx = [], [], [], []
    for a in al.aligned:
        s = a.sample
        n = min(a.n, int(s.input_ids.shape[0])) - 2
        if n <= 0:
            continue
        tok = torch.as_tensor(s.input_ids).long()
        aux = s.aux_concat if hasattr(s, "aux_concat") else s.aux.flatten(1)
        if aux.shape[-1] != al.fc_in:
            u.note(
                "training step-0 accuracy",
                f"training aux width {aux.shape[-1]} != fc input {al.fc_in}",
            )
            return None
        items.append(Step0Input(tok[1 : n + 1], aux[:n], torch.arange(n)))
        labels.append(tok[2 : n + 2])
        masks.append(torch.as_tensor(s.loss_mask[2 : n + 2]).bool())
        idx.append((a, n))
    if not items:
        return None
    logits = runner.run(runner.drafter, items)
    return TrainingStep0(logits, torch.cat(labels), torch.cat(masks), idx)


def _serving_aligned(runner: DrafterRunner, ts: TrainingStep0) -> float | None:
    al = runner.alignment
    if al.sketched or al.serving_width != al.fc_in:
        return None
    items = []
    for a, n in ts.rows:
        tok = torch.as_tensor(a.sample.input_ids).long()
        aux = a.serving.aux[: max(0, n - a.start)]
        if a.start:  # a cache hit: its cached span as the cache holds it
            got = runner.cached_aux(a.serving)
            if got is None:
                return None
            aux = torch.cat([got[0].to(aux.dtype), aux])[:n]
        items.append(Step0Input(tok[1 : n + 1], aux, torch.arange(n)))
    pred = runner.map_to_target(runner.run(runner.drafter, items).argmax(-1))
    return agreement(pred[ts.judged], ts.labels[ts.judged])


def _teacher_state(
    runner: DrafterRunner, target: ReferenceTarget
) -> tuple[dict[str, Any], tuple[float, float]] | None:
    """Which norm form the stored final state is in, decided by scale: the pre-norm final
    stream or the post-norm lm_head input of the reference target."""
    pairs = [(a, a.sample.last) for a in runner.alignment.aligned if a.sample.last is not None]
    if not pairs:
        return None
    claimed = pairs[0][0].sample.last_norm
    stored, pre, post = [], [], []
    for a, last in pairs:
        fwd = target.forward(torch.as_tensor(a.sample.input_ids[: a.n]).long())
        stored.append(last[: a.n].float())
        pre.append(fwd.layers[:, -1])
        post.append(fwd.post_norm)
    stored_t, pre_t, post_t = torch.cat(stored), torch.cat(pre), torch.cat(post)
    norm = stored_t.norm(dim=-1).mean()
    rel_pre = float(norm / pre_t.norm(dim=-1).mean())
    rel_post = float(norm / post_t.norm(dim=-1).mean())
    state = {
        "claimed": claimed,
        "measured": "pre" if abs(rel_pre - 1) < abs(rel_post - 1) else "post",
        "rel_norm_to_pre_norm_final": round(rel_pre, 4),
        "rel_norm_to_post_norm_final": round(rel_post, 4),
    }
    return state, (rel_pre, rel_post)


def _full_vocab(
    runner: DrafterRunner, target: ReferenceTarget, ts: TrainingStep0
) -> dict[str, float]:
    teacher = []
    for a, n in ts.rows:
        logits = target.forward(torch.as_tensor(a.sample.input_ids[: a.n]).long()).logits
        teacher.append(logits[1 : n + 1])
    d2t = runner.drafter.d2t.long()
    in_vocab = draft_vocab_targets(d2t)
    # Same rows as `acc0_training`: the loss-masked ones the library trains and reports on.
    m = ts.judged
    teacher_full = torch.cat(teacher)[m]
    draft_pred = ts.logits.argmax(-1)[m]
    library = agreement(draft_pred, teacher_full[:, in_vocab].argmax(-1))  # speculators acc_0
    target_argmax = teacher_full.argmax(-1)
    served = agreement(map_draft_ids(draft_pred, d2t), target_argmax)  # what greedy accepts
    coverage = float(torch.isin(target_argmax, in_vocab).float().mean())
    return {
        "acc0_training_teacher": library,
        "acc0_training_full_vocab": served,
        "draft_vocab_coverage_of_target_argmax": coverage,
    }
