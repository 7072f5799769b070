"""Static checks on a drafter checkpoint (`hstrace check`): what the load report, the config and
the vocab map already reveal, before any trace. Each check returns `Finding`s; engine-dependent
ones say which engine versions they apply to (`Finding.applies_to`).

Engine facts used here (shared/reference/sglang-internals.md §2, training-formats.md §6, §9):
SGLang ≤0.5.11 maps only `midlayer.*` (drops `layers.0.*` silently); `fc_norm` from 0.5.12;
`norm_before_fc`/`input_norm` from 0.5.17; `norm_before_residual`, sliding windows and qwen3
q/k-norm never (through 0.5.23); `hot_token_id = d2t + arange` (offsets); always the target's
embedding; the target's lm_head when `draft_vocab_size` is absent.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from hstrace.drafter.checkpoint import LoadReport
from hstrace.drafter.model import Eagle3Drafter
from hstrace.errors import CheckpointError
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
from hstrace.training.conventions import BEFORE_LAYER, OUTPUT_OF_LAYER, hf_index

SGLANG_ALL = "sglang<=0.5.23"


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def applies(finding: Finding, engine: str, version: str) -> bool:
    """Does a finding's `applies_to` ("sglang<0.5.17", "sglang>=0.5.23, vllm", None) cover this engine?"""
    if not finding.applies_to:
        return True
    for clause in finding.applies_to.split(","):
        m = re.fullmatch(r"\s*([a-z]+)\s*(<=|>=|<|>|==)?\s*([\d.]*)\s*", clause)
        if not m or m.group(1) != engine:
            continue
        if not m.group(2):
            return True
        a, b = _version(version), _version(m.group(3))
        if {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b, "==": a == b}[m.group(2)]:
            return True
    return False


def check_weights(rep: LoadReport) -> list[Finding]:
    out: list[Finding] = []
    if rep.unmapped:
        out.append(
            Finding(
                "weights-dropped",
                f"{len(rep.unmapped)} checkpoint tensor(s) map to no drafter parameter",
                {"unmapped_keys": rep.unmapped[:20]},
                "Rename the keys to the drafter layout (`layers.0.*` or `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`) and re-save.",
            )
        )
    never = [
        p
        for p in rep.missing
        if p not in ("d2t", "t2d")
        and not (p == "embed_tokens.weight" and rep.dialect != "speculators")
    ]
    if never:
        out.append(
            Finding(
                "weights-dropped",
                f"{len(never)} drafter parameter(s) received no tensor and keep their initial values",
                {"parameters_not_loaded": never[:20]},
                "Export the checkpoint again from the training run; every parameter must be saved.",
            )
        )
    keys = list(rep.key_map)
    layer_keys = [k for k in keys if k.startswith("layers.0.")]
    if layer_keys:
        out.append(
            Finding(
                "weights-dropped",
                "decoder layer saved as `layers.0.*`; SGLang before 0.5.12 maps only `midlayer.*` and drops it without an error",
                {"example_key": layer_keys[0], "n_keys": len(layer_keys)},
                "Serve with SGLang >= 0.5.12, or rename `layers.0.` -> `midlayer.` (`hstrace.drafter.save_drafter(model, out, dialect='specforge')`).",
                applies_to="sglang<0.5.12",
            )
        )
    qk = [k for k in keys if k.endswith(("q_norm.weight", "k_norm.weight"))]
    if qk:
        out.append(
            Finding(
                "weights-dropped",
                "qwen3-style q_norm/k_norm weights; SGLang's EAGLE-3 draft is a Llama layer and drops them",
                {"keys": qk},
                "Serve this drafter with vLLM (Eagle3Qwen3ForCausalLM) or retrain with draft_arch=llama.",
                applies_to=SGLANG_ALL,
            )
        )
    extra_layers = sorted({k.split(".")[1] for k in keys if re.match(r"layers\.[1-9]\d*\.", k)})
    if extra_layers:
        out.append(
            Finding(
                "weights-dropped",
                "more than one draft decoder layer; SGLang before 0.5.12 supports exactly one",
                {"extra_layers": extra_layers},
                "Serve with SGLang >= 0.5.12 or vLLM.",
                applies_to="sglang<0.5.12",
            )
        )
    return out


def check_flags(rep: LoadReport, model: Eagle3Drafter) -> list[Finding]:
    cfg, flags, out = model.cfg, rep.flags, []

    def src(name: str) -> str:
        return flags.get(name, (None, "?"))[1]

    if cfg.norm_before_residual:
        out.append(
            Finding(
                "norm-flag-mismatch",
                "trained with norm_before_residual=True; SGLang has no such flag and serves it as False",
                {"norm_before_residual": True, "source": src("norm_before_residual")},
                "Serve with vLLM (honours it), or retrain with norm_before_residual=False for SGLang.",
                applies_to=SGLANG_ALL,
            )
        )
    if cfg.norm_before_fc:
        out.append(
            Finding(
                "norm-flag-mismatch",
                "norm_before_fc=True (input_norm.weight); SGLang before 0.5.17 skips the input norm",
                {"norm_before_fc": True, "source": src("norm_before_fc")},
                "Serve with SGLang >= 0.5.17 (PR #32334) or vLLM with PR #38111.",
                applies_to="sglang<0.5.17",
            )
        )
    if cfg.fc_norm:
        out.append(
            Finding(
                "norm-flag-mismatch",
                "fc_norm=True (per-slot norms before fc); SGLang before 0.5.12 skips them",
                {"fc_norm": True, "source": src("fc_norm")},
                "Serve with SGLang >= 0.5.12.",
                applies_to="sglang<0.5.12",
            )
        )
    if cfg.feed_normed:
        out.append(
            Finding(
                "norm-flag-mismatch",
                "speculators norm_output=True: steps >= 1 must receive the normed state; engines without norm_output plumbing feed the pre-norm state",
                {"norm_output": True, "meaning": "feed norm(h) back", "source": src("feed_normed")},
                "Serve with an engine that reads norm_output (vLLM with PR #46488; SGLang 0.5.23 reads it, older versions not verified).",
                severity="warning",
                applies_to="sglang<0.5.23",
            )
        )
    explicit_no = "norm_output" in rep.config
    if rep.dialect == "specforge" and explicit_no and rep.config.get("norm_output") is True:
        out.append(
            Finding(
                "norm-flag-mismatch",
                "SpecForge `norm_output: true` means 'norm before lm_head', but SGLang/vLLM read it as 'feed the normed state back': steps >= 1 get another input than in training",
                {
                    "norm_output": True,
                    "specforge_meaning": "logits use norm; feedback pre-norm",
                    "engine_meaning": "feedback normed",
                },
                "Drop `norm_output` from the served config.json (SpecForge's default already applies the norm before lm_head).",
                applies_to="sglang>=0.5.23, vllm",
            )
        )
    if not cfg.logits_use_norm:
        out.append(
            Finding(
                "norm-flag-mismatch",
                "trained with norm_output=false (SpecForge: lm_head on the un-normed state); every engine applies the final norm before lm_head",
                {"logits_use_norm": False, "source": src("logits_use_norm")},
                "Retrain with norm_output true, the only form engines serve.",
            )
        )
    if rep.dialect == "speculators" and "norm_before_residual" not in rep.config:
        out.append(
            Finding(
                "norm-flag-mismatch",
                "config has no norm_before_residual: speculators' class default is False, vLLM's update_eagle3 default is True",
                {"speculators_default": False, "vllm_default": True},
                "Write norm_before_residual explicitly into config.json (True for drafters trained by speculators' train.py).",
                severity="warning",
                applies_to="vllm",
            )
        )
    if cfg.sliding_window is not None:
        out.append(
            Finding(
                "attention-window",
                f"trained with a {cfg.sliding_window}-token sliding window; SGLang's EAGLE-3 draft uses full attention",
                {"sliding_window": cfg.sliding_window, "layer_types": cfg.layer_types},
                "Expect divergence past the window on long contexts; serve with vLLM (reads layer_types/sliding_window) or retrain without the window.",
                severity="warning",
                applies_to=SGLANG_ALL,
            )
        )
    theta = cfg.extra.get("config_rope_theta")
    if rep.dialect == "eagle" and theta is not None and float(theta) != 10000.0:
        out.append(
            Finding(
                "rope-mismatch",
                f"config.json says rope_theta={theta}, but EAGLE-3 trained with base 10000 whatever the config says; engines read the config",
                {"config_rope_theta": theta, "training_rope_theta": 10000.0},
                "Remove rope_theta from config.json (or set it to 10000) for serving.",
            )
        )
    return out


def check_head_and_embed(rep: LoadReport, model: Eagle3Drafter) -> list[Finding]:
    out = []
    if rep.dialect != "speculators" and not model.cfg.extra.get("draft_vocab_size_in_config", True):
        out.append(
            Finding(
                "embed-head-source",
                "config.json has no draft_vocab_size: SGLang replaces the trained lm_head with the target's",
                {"lm_head_in_checkpoint": any(v == "lm_head.weight" for v in rep.key_map.values())},
                "Add draft_vocab_size to config.json.",
                applies_to=SGLANG_ALL,
            )
        )
    if model.cfg.extra.get("tie_word_embeddings"):
        out.append(
            Finding(
                "embed-head-source",
                "tie_word_embeddings=true: engines use the (target) embedding as lm_head and drop the trained one",
                {"tie_word_embeddings": True},
                "Set tie_word_embeddings to false in config.json.",
            )
        )
    if rep.dialect == "speculators" and model.cfg.extra.get("embed_requires_grad"):
        out.append(
            Finding(
                "embed-head-source",
                "the embedding was trained (embed_requires_grad) but SGLang always uses the target's embedding",
                {"embed_requires_grad": True},
                "Serve with vLLM (uses the draft's embedding) or retrain with a frozen embedding.",
                applies_to=SGLANG_ALL,
            )
        )
    return out


def check_vocab(rep: LoadReport, model: Eagle3Drafter) -> tuple[list[Finding], dict[str, Any]]:
    cfg = model.cfg
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    has_d2t = "d2t" in rep.loaded
    info: dict[str, Any] = {
        "vocab_size": V,
        "draft_vocab_size": Vd,
        "d2t_present": has_d2t,
        "t2d_present": "t2d" in rep.loaded,
    }
    if Vd >= V:
        return [], info
    d2t = model.d2t
    if not has_d2t or not bool(d2t.any()):
        return [
            Finding(
                "vocab-map-missing",
                f"draft vocab {Vd} < target vocab {V} but "
                + ("no d2t in the checkpoint" if not has_d2t else "d2t is all zeros"),
                info,
                "Save the d2t/t2d built from the training data (speculators d2t.npy, SpecForge vocab_mapping.pt) into the checkpoint; without it draft id i is served as target id i.",
            )
        ], info
    target = torch.arange(Vd) + d2t
    info |= {
        "d2t_min": int(d2t.min()),
        "d2t_max": int(d2t.max()),
        "offset_target_max": int(target.max()),
    }
    as_table = "t2d" in rep.loaded and torch.equal(
        torch.nonzero(model.t2d).flatten(), torch.sort(d2t).values
    )
    if (
        int(target.max()) >= V
        or int(target.min()) < 0
        or (as_table and not torch.equal(torch.nonzero(model.t2d).flatten(), target))
    ):
        info["d2t_equals_t2d_ids"] = as_table
        return [
            Finding(
                "d2t-direct-table",
                "d2t holds target ids (a direct table), but every engine adds it to the draft id as an offset",
                info,
                "Store offsets: d2t = target_ids - arange(draft_vocab_size).",
            )
        ], info
    if bool((d2t[1:] < d2t[:-1]).any()):
        return [
            Finding(
                "d2t-direct-table",
                "d2t offsets are not non-decreasing; every library builds them from a sorted id list",
                info,
                "Rebuild d2t/t2d from the training data's vocab mapping.",
                severity="warning",
            )
        ], info
    return [], info


def check_slots(rep: LoadReport, model: Eagle3Drafter) -> list[Finding]:
    out = [
        Finding(
            "slot-layout",
            note,
            {"fc_in_features": model.fc.in_features, "aux_layer_ids": model.cfg.aux_layer_ids},
            "Make eagle_aux_hidden_state_layer_ids / target_hidden_size in config.json match the fc weight.",
        )
        for note in rep.notes
    ]
    ids = model.cfg.aux_layer_ids
    if ids is not None and len(ids) != model.cfg.num_aux and not rep.notes:
        out.append(
            Finding(
                "slot-layout",
                f"config lists {len(ids)} aux layer ids but fc takes {model.cfg.num_aux} slots",
                {"aux_layer_ids": ids, "fc_in_features": model.fc.in_features},
                "Make eagle_aux_hidden_state_layer_ids match the slots the drafter was trained on.",
            )
        )
    return out


def static_findings(rep: LoadReport, model: Eagle3Drafter) -> tuple[list[Finding], dict[str, Any]]:
    vocab, vinfo = check_vocab(rep, model)
    found = (
        check_weights(rep)
        + check_flags(rep, model)
        + check_head_and_embed(rep, model)
        + vocab
        + check_slots(rep, model)
    )
    return found, {"vocab": vinfo}


# --- `--against TRAINING_DIR`: the drafter on the training tensors --------------------------------

# The dialect's own layer-id convention for `aux_layer_ids` (training-formats.md §1).
DIALECT_CONVENTION = {
    "speculators": BEFORE_LAYER,
    "specforge": OUTPUT_OF_LAYER,
    "eagle": BEFORE_LAYER,
}

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


def load_target_embedding(path: str | Path) -> torch.Tensor:
    """`model.embed_tokens.weight` of an HF target dir (SpecForge/EAGLE drafters carry none)."""
    from safetensors import SafetensorError, safe_open

    root = Path(path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        raise CheckpointError(f"{root}: not a target checkpoint dir (no *.safetensors)")
    for f in files:
        try:
            with safe_open(str(f), "pt") as st:
                if "model.embed_tokens.weight" in st.keys():
                    return st.get_tensor("model.embed_tokens.weight").float()
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{f}: cannot read tensors ({exc})") from None
    raise CheckpointError(f"{root}: target checkpoint lacks model.embed_tokens.weight")


def _metric(acc: Accuracy, name: str) -> dict[str, Any]:
    return {
        "value": acc.value if acc.total else None,
        "correct": acc.correct,
        "total": acc.total,
        "convention": CONVENTIONS[name],
        "short": SHORT_CONVENTIONS[name],
    }


def _slot_findings(model: Eagle3Drafter, dialect: str, first: Any) -> list[Finding]:
    """Stored slots vs what the drafter's fc takes: count and width, then (where the data names
    them) the physical layers, compared as HF hidden_states indices."""
    cfg = model.cfg
    n_slots, width = int(first.aux.shape[1]), int(first.aux.shape[2])
    evidence = {
        "stored_slots": n_slots,
        "stored_width": width,
        "fc_slots": cfg.num_aux,
        "fc_width": cfg.aux_width,
        "stored_layer_ids": first.slot_layer_ids,
        "config_layer_ids": cfg.aux_layer_ids,
        "provenance": first.provenance,
    }
    if (n_slots, width) != (cfg.num_aux, cfg.aux_width):
        return [
            Finding(
                "slot-layout",
                f"training data stores {n_slots} aux slots of width {width}; the drafter's fc takes {cfg.num_aux} of width {cfg.aux_width}",
                evidence,
                "Check which stored slots the trainer fed (speculators: all but the last; the last is the teacher's state).",
            )
        ]
    stored, conv = first.slot_layer_ids, first.provenance.get("layer_id_convention")
    if stored is None or cfg.aux_layer_ids is None or conv is None:
        return []
    data_hf = [hf_index(i, conv) for i in stored]
    drafter_hf = [hf_index(i, DIALECT_CONVENTION[dialect]) for i in cfg.aux_layer_ids]
    if data_hf == drafter_hf:
        return []
    return [
        Finding(
            "slot-layout",
            f"training data stores HF hidden_states {data_hf}, the drafter's config names {drafter_hf}: one of them is not what the drafter was trained or will be served on",
            {**evidence, "stored_hf_indices": data_hf, "config_hf_indices": drafter_hf},
            "Use data captured at the drafter's layers, or fix eagle_aux_hidden_state_layer_ids to the layers it was trained on (mind each library's id convention).",
            severity="warning",
        )
    ]


def _data_reference(ids: torch.Tensor) -> torch.Tensor:
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


def training_findings(
    model: Eagle3Drafter,
    td: Any,
    dialect: str = "speculators",
    head: TargetHead | None = None,
    max_samples: int = 16,
    steps: int = 3,
) -> tuple[list[Finding], dict[str, Any]]:
    """Run the drafter (teacher-forced, `steps` TTT steps) on the first `max_samples` training
    samples and report accuracy metrics, each with its convention (`CONVENTIONS`). `head` (the
    target's final norm + lm_head) rebuilds the library's teacher from the stored final state;
    without it only the teacher-free metrics (vs the stored tokens) are reported."""
    n = min(len(td), max_samples)
    info: dict[str, Any] = {"format": getattr(td, "format", None), "samples": n, "steps": steps}
    if n == 0:
        return [], info
    first = td[0]
    found = _slot_findings(model, dialect, first)
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
            data_ref = _data_reference(ids)
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
