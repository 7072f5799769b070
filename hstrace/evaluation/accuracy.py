"""`--against TRAINING_DIR`: the drafter on the training tensors (teacher-forced), each
accuracy with its convention next to it (`CONVENTIONS`), so hstrace's numbers can be put next
to the training libraries' and the engines'. An accuracy needs a real embedding: without one
every accuracy is marked skipped, with no value (a random stand-in would be noise presented as
a measurement)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hstrace.drafter.model import Eagle3Drafter
from hstrace.evaluation.slots import embedding_slot_findings, slot_findings
from hstrace.findings import Finding
from hstrace.metrics import (
    Accuracy,
    TargetHead,
    accuracy_draft_space,
    accuracy_target_space,
    per_position_accuracy,
    reference_ids,
    simulated_acceptance_length,
)

CONVENTIONS = {
    "acc0_teacher": "step 0, draft space: argmax of the drafter vs argmax of the library's teacher "
    "restricted to the draft vocab (teacher[..., t2d]) at position t+1; rows with loss_mask[t+1] "
    "(speculators full_acc_0 / acc0_spec)",
    "acc0_target": "step 0, target space: drafter argmax mapped by d2t vs the target's full-vocab "
    "argmax at position t+1, rebuilt from the stored final state (what greedy verification "
    "accepts; SpecForge acc_0 up to its mask shift); rows with loss_mask[t+1]",
    "acc0_data": "step 0, target space: drafter argmax mapped by d2t vs the token stored in the "
    "data at t+2 (needs no target; equals acc0_target only on the target's own greedy outputs); "
    "rows with loss_mask[t+1], the last stored position excluded",
    "teacher_agrees_with_data": "sanity: target's full-vocab argmax at t+1 == stored token t+2, "
    "same rows; low means the stored final state is not the target's last layer",
    "per_position": "teacher-forced over K steps (step k feeds the stored tokens, predicts the "
    "token at t+2+k), target space vs {reference}; uncond[k] = step k alone over its rows "
    "(SpecForge/EAGLE acc_k), full[k] = correct at every step 0..k over step-0 rows "
    "(speculators full_acc_k = a greedy chain's per-position acceptance), cond[k] = full[k]/full[k-1]",
    "accept_len": "simulated acceptance length of a greedy chain of K drafts = 1 + sum_k full[k]; "
    "the bonus token IS counted (SGLang spec_accept_length / accept_len, vLLM mean acceptance "
    "length); hstrace traces' accept_len excludes it (= value - 1); SpecForge's "
    "simulated_acc_len is sum_k prod_j<=k uncond[j] with no +1",
}


# One line each, for the terminal; `CONVENTIONS` has the full wording (and goes into --json).
SHORT_CONVENTIONS = {
    "acc0_teacher": "step 0, draft space, vs the library's teacher within the draft vocab at t+1 "
    "(speculators full_acc_0)",
    "acc0_target": "step 0, target space, vs the target's full-vocab argmax at t+1 "
    "(SpecForge acc_0; what greedy verification accepts)",
    "acc0_data": "step 0, target space, vs the token stored at t+2 (needs no target)",
    "teacher_agrees_with_data": "sanity: the target's argmax at t+1 == the token stored at t+2",
    "uncond": "step k alone, teacher-forced (SpecForge/EAGLE acc_k)",
    "full": "steps 0..k all correct (speculators full_acc_k; greedy per-position acceptance)",
    "cond": "full[k] / full[k-1] (speculators cond_acc_k)",
    "accept_len": "1 + sum_k full[k]: bonus token counted (SGLang accept_len); a trace's "
    "accept_len = this - 1",
}


def _metric(acc: Accuracy, name: str) -> dict[str, Any]:
    return {
        "value": acc.value if acc.total else None,
        "correct": acc.correct,
        "total": acc.total,
        "convention": CONVENTIONS[name],
        "short": SHORT_CONVENTIONS[name],
    }


def data_reference(ids: torch.Tensor) -> torch.Tensor:
    """Row t's stored next-next token ids[t+2]; -1 where the data has none."""
    ref = torch.full_like(ids, -1)
    if ids.shape[0] > 2:
        ref[:-2] = ids[2:]
    return ref


def _padded(rows: list[torch.Tensor], fill: Any) -> torch.Tensor:
    out = torch.full((len(rows), max(r.shape[0] for r in rows)), fill, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


ACCURACY_NAMES = ("acc0_teacher", "acc0_target", "acc0_data", "teacher_agrees_with_data")


def _skipped(info: dict[str, Any], reason: str) -> dict[str, Any]:
    """Every accuracy marked skipped with no value: a number computed with a stand-in
    embedding would be noise presented as a measurement."""
    info["skipped"] = reason
    for name in ACCURACY_NAMES:
        info[name] = {"value": None, "skipped": True, "convention": CONVENTIONS[name]}
    info["per_position"] = {"skipped": True}
    info["accept_len"] = {"value": None, "skipped": True}
    return info


def training_findings(
    model: Eagle3Drafter,
    td: Any,
    dialect: str = "speculators",
    head: TargetHead | None = None,
    max_samples: int = 16,
    steps: int = 3,
    embedding: torch.Tensor | None = None,
    embedding_source: str | None = None,
    embedding_loaded: bool = True,
) -> tuple[list[Finding], dict[str, Any]]:
    """Run the drafter (teacher-forced, `steps` TTT steps) on the first `max_samples` training
    samples and report accuracy metrics, each with its convention (`CONVENTIONS`). `head` (the
    target's final norm + lm_head) rebuilds the library's teacher from the stored final state;
    without it only the teacher-free metrics (vs the stored tokens) are reported.

    `embedding` [V, Ht] (the target's, or the drafter's saved copy) is what stored slots are
    compared with to find an embedding slot. `embedding_loaded=False` (the drafter has no
    embedding and none was given): the slot checks run, every accuracy is marked skipped."""
    n = min(len(td), max_samples)
    info: dict[str, Any] = {"format": getattr(td, "format", None), "samples": n, "steps": steps}
    if n == 0:
        return [], info
    first = td[0]
    found = slot_findings(model, dialect, first)
    if not any(f.severity == "fault" for f in found):
        more, slot_info = embedding_slot_findings(
            model, dialect, first, embedding, embedding_source
        )
        found += more
        info |= slot_info
    if not embedding_loaded:
        return found, _skipped(
            info,
            "accuracy needs the target's embedding, which this checkpoint does not carry"
            + (f" ({dialect} saves none)" if dialect != "speculators" else "")
            + ": pass --target TARGET_DIR (a random stand-in would give a meaningless number)",
        )
    if any(f.severity == "fault" for f in found):
        return found, info  # the drafter's fc cannot consume these slots
    dtype = next(model.parameters()).dtype
    t2d = model.t2d
    a_teacher = a_target = a_data = a_sanity = Accuracy(0, 0)
    hits: list[list[torch.Tensor]] = [[] for _ in range(steps)]
    masks: list[torch.Tensor] = []
    use_teacher = head is not None and first.last is not None
    with torch.no_grad():
        for i in range(n):
            s = td[i]
            ids, mask = s.input_ids.long(), s.loss_mask.bool()
            if ids.shape[0] < 3:
                continue
            next_ids = torch.cat([ids[1:], ids.new_zeros(1)])  # row t: token t+1
            outs = model.ttt(next_ids, s.aux_concat.to(dtype), steps=steps)
            data_ref = data_reference(ids)
            data_mask = mask.clone()
            data_mask[-1] = False  # position T-1 scores token T, which is not stored
            drafted = [model.draft_to_target(o.logits.argmax(-1)) for o in outs]
            a_data += accuracy_target_space(drafted[0], data_ref, data_mask)
            if use_teacher:
                assert head is not None and s.last is not None and s.last_norm is not None
                teacher = head.teacher_logits(s.last, s.last_norm)
                a_teacher += accuracy_draft_space(outs[0].logits.float(), teacher[..., t2d], mask)
                a_target += accuracy_target_space(drafted[0], reference_ids(teacher, 0), mask)
                a_sanity += accuracy_target_space(reference_ids(teacher, 0), data_ref, data_mask)
                refs = [reference_ids(teacher, k) for k in range(steps)]
                masks.append(mask)
            else:
                refs = [
                    torch.cat([data_ref[k:], data_ref.new_full((k,), -1)]) for k in range(steps)
                ]
                masks.append(data_mask)
            for k in range(steps):
                hits[k].append(drafted[k] == refs[k])
    if not masks:
        return found, info
    mask_b = _padded(masks, False)
    pp = per_position_accuracy([_padded(h, False) for h in hits], mask_b)
    reference = (
        "the target's full-vocab argmax at t+1+k (rebuilt from the stored final state)"
        if use_teacher
        else "the stored token at t+2+k (no target given)"
    )
    info["rows"] = int(mask_b[:, 1:].sum())
    info["teacher"] = (
        f"target lm_head({'norm(last)' if first.last_norm == 'pre' else 'last'}) from the stored "
        f"{first.last_norm}-norm final state"
        if use_teacher
        else "none: pass --target to rebuild the library's teacher"
    )
    if use_teacher:
        info["acc0_teacher"] = _metric(a_teacher, "acc0_teacher")
        info["acc0_target"] = _metric(a_target, "acc0_target")
    info["acc0_data"] = _metric(a_data, "acc0_data")
    if use_teacher:
        info["teacher_agrees_with_data"] = _metric(a_sanity, "teacher_agrees_with_data")
    info["per_position"] = {
        "uncond": pp.uncond,
        "full": pp.full,
        "cond": pp.cond,
        "reference": reference,
        "convention": CONVENTIONS["per_position"].format(reference=reference),
    }
    info["accept_len"] = {
        "value": simulated_acceptance_length(pp.full, count_bonus=True),
        "bonus_counted": True,
        "value_without_bonus": simulated_acceptance_length(pp.full, count_bonus=False),
        "specforge_simulated_acc_len": _specforge_sim_len(pp.uncond),
        "convention": CONVENTIONS["accept_len"],
    }
    return found, info


def _specforge_sim_len(uncond: list[float]) -> float:
    total, prod = 0.0, 1.0
    for a in uncond:
        prod *= a
        total += prod
    return total


# The drafter flags a norm-flag finding can name, as `DrafterConfig` spells them.
NORM_FLAGS = ("norm_before_fc", "norm_before_residual", "fc_norm", "feed_normed", "logits_use_norm")


def _step0_scores(model: Eagle3Drafter, samples: list[Any]) -> dict[str, Any]:
    """Step-0 accuracy (target space, vs the stored token t+2, loss-masked rows, the last
    stored position excluded: `acc0_data`) and the mean loss of that token in the draft vocab
    (what training minimised; labels outside the draft vocab skipped)."""
    d2t = model.d2t.long()
    to_draft = torch.full((int(model.cfg.vocab_size),), -1, dtype=torch.long)
    to_draft[torch.arange(len(d2t)) + d2t] = torch.arange(len(d2t))
    acc, loss, n_loss = Accuracy(0, 0), 0.0, 0
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        for s in samples:
            ids, mask = s.input_ids.long(), s.loss_mask.bool()
            if ids.shape[0] < 3:
                continue
            next_ids = torch.cat([ids[1:], ids.new_zeros(1)])
            logits = model(next_ids, s.aux_concat.to(dtype)).logits.float()
            ref, m = data_reference(ids), mask.clone()
            m[-1] = False
            acc += accuracy_target_space(model.draft_to_target(logits.argmax(-1)), ref, m)
            label = torch.where(ref >= 0, to_draft[ref.clamp(min=0)], ref)
            keep = m & (label >= 0)
            lp = torch.log_softmax(logits[keep], -1).gather(-1, label[keep][:, None])
            loss -= float(lp.sum())
            n_loss += int(keep.sum())
    return {
        "acc0_data": round(acc.value, 4) if acc.total else None,
        "loss": round(loss / n_loss, 4) if n_loss else None,
        "rows": acc.total,
    }


def flag_fix_on_training(
    model: Eagle3Drafter, td: Any, findings: list[Finding], max_samples: int = 16
) -> None:
    """`hstrace check --against` (issue 28 item 5): for each norm-flag finding, the drafter on
    the training tensors with the flag as the checkpoint says it was trained (the fix) and as
    the engine reads it (the other value), in the finding's evidence as `on_training`: step-0
    accuracy and loss both ways, and which value fits the training tensors (lower loss)."""
    from hstrace.drafter.model import Eagle3Drafter as Drafter

    samples = [td[i] for i in range(min(len(td), max_samples))]
    for f in findings:
        if f.code != "norm-flag-mismatch":
            continue
        text = f.summary + " " + " ".join(f.evidence)
        flags = [n for n in NORM_FLAGS if n in text]
        if not flags:
            continue
        flag = flags[0]
        trained = bool(getattr(model.cfg, flag))
        try:
            other = Drafter(dataclasses.replace(model.cfg, **{flag: not trained}))
        except ValueError:  # mutually exclusive flags: the other value cannot be served
            continue
        other.load_state_dict(model.state_dict(), strict=False)
        with_fix, as_engine = _step0_scores(model, samples), _step0_scores(other.eval(), samples)
        fits = (
            None
            if with_fix["loss"] is None or as_engine["loss"] is None
            else (trained if with_fix["loss"] < as_engine["loss"] else not trained)
        )
        f.evidence["on_training"] = {
            "flag": flag,
            f"with the fix ({flag}={trained})": with_fix,
            f"as the engine reads it ({flag}={not trained})": as_engine,
            "value_that_fits_training": fits,
        }
