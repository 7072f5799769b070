"""Static checks on a drafter checkpoint (`hstrace check`): what the load report, the config and
the vocab map already reveal, before any trace. Each check returns `Finding`s; engine-dependent
ones say which engine versions they apply to (`Finding.applies_to`).

Nothing here guesses: an accuracy needs a real embedding (else it is marked skipped, with no
value); an embedding slot in the training data is decided from the numbers (the target's or the
drafter's embedding, else "a function of the token alone"); SpecForge's `norm_output`, whose
meaning changed in SpecForge PR #879, is read from the training tensors by a paired test, or
reported as a question.

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


# SpecForge's `norm_output` before and after SpecForge PR #879 (merged 2026-09-15). The installed
# specforge 0.2.0 (`LlamaForCausalLMEagle3.compute_logits`; the backbone output is what the next
# step gets) is "before": the flag only chooses lm_head(norm(h)) vs lm_head(h), the fed-back state
# is always h. After #879 the logits always use norm(h) and the flag chooses the fed-back state
# (true = EAGLE-3.1, norm(h); false = EAGLE-3, h), as SGLang (default False) and vLLM read it.
# A checkpoint's config.json carries no SpecForge version, so the reading is a question: hstrace
# answers it from the training tensors (`resolve_norm_output`), or says it cannot.
PRE_879, POST_879 = "before-specforge-pr-879", "after-specforge-pr-879"
NORM_OUTPUT_READINGS = (PRE_879, POST_879)


def norm_output_flags(value: bool, reading: str) -> dict[str, bool]:
    """The drafter math a SpecForge `norm_output: value` means under each reading."""
    if reading == PRE_879:
        return {"logits_use_norm": bool(value), "feed_normed": False}
    return {"logits_use_norm": True, "feed_normed": bool(value)}


def _norm_output_meaning(value: bool, reading: str) -> str:
    f = norm_output_flags(value, reading)
    logits = "lm_head(norm(h))" if f["logits_use_norm"] else "lm_head(h) (no final norm)"
    fed = "norm(h) (EAGLE-3.1)" if f["feed_normed"] else "h (EAGLE-3)"
    return f"logits {logits}, next step gets {fed}"


def specforge_norm_output_findings(
    rep: LoadReport, resolution: dict[str, Any] | None = None
) -> list[Finding]:
    """`resolution`: what `resolve_norm_output` found on the training tensors, if it ran."""
    value = bool(rep.config.get("norm_output"))
    reading = resolution.get("reading") if resolution else None
    both = {
        "norm_output": value,
        "meaning_before_pr_879": _norm_output_meaning(value, PRE_879),
        "meaning_after_pr_879": _norm_output_meaning(value, POST_879),
        "engines_serve": "logits lm_head(norm(h)); next step gets norm(h) iff norm_output "
        "(SGLang >= 0.5.23, vLLM; older SGLang always h)",
    }
    if reading is None:
        return [
            Finding(
                "norm-flag-mismatch",
                f"SpecForge `norm_output: {str(value).lower()}` changed meaning in SpecForge PR "
                "#879 (2026-09-15) and this checkpoint does not say which SpecForge trained it: "
                f"before #879 (specforge <= 0.2.0) {_norm_output_meaning(value, PRE_879)}; after "
                f"it {_norm_output_meaning(value, POST_879)}",
                {
                    **both,
                    "reading": "unknown",
                    "hstrace_loads_it_as": PRE_879,
                    "tested_on_training_data": resolution.get("why") if resolution else "not run",
                },
                (
                    "Check the SpecForge commit of the training run (PR #879 or later means the "
                    "new reading) and write the config accordingly."
                    if resolution
                    else "Run `hstrace check DRAFTER --against TRAINING_DIR --target TARGET_DIR`: "
                    "hstrace scores both readings on the training tensors and names the one the "
                    "weights were trained with; or check the SpecForge commit of the training run "
                    "(PR #879 or later means the new reading)."
                ),
                severity="warning",
            )
        ]
    both["reading"] = reading
    if reading == PRE_879 and value:
        return [
            Finding(
                "norm-flag-mismatch",
                "trained before SpecForge PR #879: `norm_output: true` meant 'norm before "
                "lm_head, feed h back' (EAGLE-3), but SGLang >= 0.5.23 and vLLM read it as 'feed "
                "norm(h) back' (EAGLE-3.1): steps >= 1 get another input than in training",
                both,
                "Drop `norm_output` from the served config.json (the norm before lm_head is "
                "applied anyway; absent = feed h back, as trained).",
                applies_to="sglang>=0.5.23, vllm",
            )
        ]
    if reading == PRE_879 and not value:
        return [
            Finding(
                "norm-flag-mismatch",
                "trained before SpecForge PR #879 with `norm_output: false`: lm_head on the "
                "un-normed state, which no engine serves (they always norm before lm_head)",
                both,
                "Retrain (SpecForge >= PR #879, or norm_output true before it); engines cannot "
                "serve lm_head(h).",
            )
        ]
    if value:  # after #879, true = EAGLE-3.1: served as trained where norm_output is read
        return [
            Finding(
                "norm-flag-mismatch",
                "EAGLE-3.1 drafter (SpecForge >= PR #879, `norm_output: true`: feed norm(h) back); "
                "SGLang before 0.5.23 feeds h",
                both,
                "Serve with SGLang >= 0.5.23 or vLLM with PR #46488.",
                severity="warning",
                applies_to="sglang<0.5.23",
            )
        ]
    return []


def check_flags(
    rep: LoadReport, model: Eagle3Drafter, norm_output_resolution: dict[str, Any] | None = None
) -> list[Finding]:
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
    if cfg.feed_normed and rep.dialect != "specforge":  # SpecForge's: see its own finding
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
    if rep.dialect == "specforge" and "norm_output" in rep.config:
        out += specforge_norm_output_findings(rep, norm_output_resolution)
    elif not cfg.logits_use_norm:
        out.append(
            Finding(
                "norm-flag-mismatch",
                "trained with norm_output=false (lm_head on the un-normed state); every engine "
                "applies the final norm before lm_head",
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
    mismatch = _t2d_vs_d2t(model, target) if "t2d" in rep.loaded else None
    if mismatch is not None:
        return [
            Finding(
                "vocab-map-inconsistent",
                f"t2d marks {mismatch['t2d_true']} target ids but d2t maps the {Vd} draft ids to "
                f"{mismatch['d2t_distinct_targets']} distinct ones, {mismatch['n_only_in_d2t']} "
                f"of them outside t2d and {mismatch['n_only_in_t2d']} t2d ids that no draft id "
                "reaches: training restricts the teacher with t2d, serving maps drafts with d2t, "
                "so they use different vocabularies",
                {**info, **mismatch},
                "Rebuild both from one vocab mapping: t2d = zeros(V, bool); t2d[arange(Vd) + d2t] "
                "= True (speculators d2t.npy/t2d.npy, SpecForge vocab_mapping.pt); retrain if the "
                "teacher was restricted with the wrong t2d.",
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


def _t2d_vs_d2t(model: Eagle3Drafter, target: torch.Tensor) -> dict[str, Any] | None:
    """The set {i + d2t[i]} must equal t2d's true entries (both libraries build them from one
    sorted id list); None when it does."""
    t2d_ids = torch.nonzero(model.t2d).flatten()
    d2t_ids = torch.unique(target)
    if torch.equal(d2t_ids, t2d_ids):
        return None
    only_d2t = d2t_ids[~torch.isin(d2t_ids, t2d_ids)]
    only_t2d = t2d_ids[~torch.isin(t2d_ids, d2t_ids)]
    return {
        "t2d_true": int(t2d_ids.numel()),
        "d2t_distinct_targets": int(d2t_ids.numel()),
        "d2t_duplicate_targets": int(target.numel() - d2t_ids.numel()),
        "n_only_in_d2t": int(only_d2t.numel()),
        "n_only_in_t2d": int(only_t2d.numel()),
        "only_in_d2t": only_d2t[:10].tolist(),
        "only_in_t2d": only_t2d[:10].tolist(),
    }


def sglang_default_hf_layers(n_layers: int) -> list[int]:
    """SGLang's (and vLLM's) default capture with no ids: HF hidden_states [2, N//2, N-3]."""
    return [2, n_layers // 2, n_layers - 3]


def check_aux_source(rep: LoadReport, model: Eagle3Drafter, n_layers: int | None) -> list[Finding]:
    """Aux layer ids at the config's top level with no `eagle_config`: SGLang's target reads only
    `eagle_config.eagle_aux_hidden_state_layer_ids` and captures its defaults instead (the
    recorder's audit says the same at record time: `sglang_audit.aux_layer_findings`)."""
    from hstrace.engines.sglang_audit import aux_layer_source

    src = aux_layer_source(rep.config)
    if src["read_by_sglang"] is not None or src["top_level_ids"] is None:
        return []
    ids = [int(i) for i in src["top_level_ids"]]
    conv = DIALECT_CONVENTION[rep.dialect]
    trained_hf = [hf_index(i, conv) for i in ids]
    evidence: dict[str, Any] = {
        "top_level_ids": ids,
        "eagle_config": rep.config.get("eagle_config"),
        "id_convention": conv,
        "trained_hf_indices": trained_hf,
        "read_by_sglang": None,
    }
    if n_layers is not None:
        default = sglang_default_hf_layers(n_layers)
        evidence |= {"target_layers": n_layers, "sglang_default_hf_indices": default}
        if default == trained_hf:
            return []  # SGLang's default is what the drafter was trained on: harmless
        summary = (
            f"aux layer ids {ids} sit at the config's top level, which SGLang ignores: the "
            f"target captures its default HF hidden_states {default} instead of {trained_hf}"
        )
    else:
        summary = (
            f"aux layer ids {ids} sit at the config's top level, which SGLang ignores: the target "
            f"captures its default HF hidden_states [2, N//2, N-3] instead of {trained_hf} "
            "(--target gives N and says whether they differ)"
        )
    return [
        Finding(
            "aux-layers-default",
            summary,
            evidence,
            'Add "eagle_config": {"eagle_aux_hidden_state_layer_ids": [...]} to the draft '
            "config.json, the ids in SGLang's convention (output of layer k, HF index k+1).",
            severity="fault" if n_layers is not None else "warning",
            applies_to=SGLANG_ALL,
        )
    ]


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


def static_findings(
    rep: LoadReport,
    model: Eagle3Drafter,
    n_layers: int | None = None,
    norm_output_resolution: dict[str, Any] | None = None,
    advisory: bool = False,
) -> tuple[list[Finding], dict[str, Any]]:
    """`n_layers`: the target's decoder layer count (from --target), for SGLang's defaults.
    `norm_output_resolution`: `resolve_norm_output`'s answer when it ran. `advisory` (what
    `hstrace check` asks for, before anything is served): also the findings that only say what
    to verify, the top-level aux ids SGLang ignores and a SpecForge `norm_output` whose reading
    is unknown. Replay (which reuses these checks) leaves them out: it judges both from the
    recorded data (the capture audit, the what-if search), and a question is not a verdict."""
    vocab, vinfo = check_vocab(rep, model)
    flags = check_flags(rep, model, norm_output_resolution)
    if not advisory:
        flags = [f for f in flags if f.evidence.get("reading") != "unknown"]
    found = (
        check_weights(rep)
        + flags
        + check_head_and_embed(rep, model)
        + vocab
        + (check_aux_source(rep, model, n_layers) if advisory else [])
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


# A stored slot "is" the token embedding when it equals embed_tokens[input_ids] up to bf16
# rounding (relative error <= 2^-8 per element, so <= ~4e-3 over a row); the stream after one
# decoder layer is further away by orders of magnitude (it adds attention and MLP outputs).
EMBED_SLOT_REL_TOL = 1e-2


def embedding_slots(sample: Any, embedding: torch.Tensor) -> list[dict[str, Any]]:
    """For each stored aux slot (and the final state), its relative distance to
    `embedding[input_ids]`: ||slot - emb|| / ||emb|| over all rows. Slots of another width than
    the embedding are not compared."""
    ids = sample.input_ids.long()
    if int(ids.max()) >= embedding.shape[0]:
        return []
    emb = embedding[ids].float()
    slots = [(j, sample.aux[:, j]) for j in range(sample.aux.shape[1])]
    if sample.last is not None:
        slots.append(("last", sample.last))
    out = []
    for j, x in slots:
        if x.shape[-1] != emb.shape[-1]:
            continue
        rel = float((x.float() - emb).norm() / emb.norm().clamp_min(1e-12))
        out.append({"slot": j, "rel_error": rel, "is_embedding": rel <= EMBED_SLOT_REL_TOL})
    return out


# Without any embedding: a slot that is a function of the token id alone (the same row wherever
# a token repeats, at any position and context) can only be the embedding; every decoder layer
# mixes in the context through attention. Needs a few tokens that repeat to say anything.
MIN_REPEATED_TOKENS = 4


def token_function_slots(sample: Any) -> list[dict[str, Any]]:
    """For each stored aux slot (and the final state), the largest relative spread between rows
    of the same token id, ||x_i - x_j|| / ||x_i||; `is_embedding` when it is within bf16
    rounding for at least `MIN_REPEATED_TOKENS` repeated tokens. [] when too few tokens repeat."""
    ids = sample.input_ids.long()
    groups = [torch.nonzero(ids == t).flatten() for t in torch.unique(ids)]
    groups = [g for g in groups if g.numel() >= 2]
    if len(groups) < MIN_REPEATED_TOKENS:
        return []
    slots = [(j, sample.aux[:, j]) for j in range(sample.aux.shape[1])]
    if sample.last is not None:
        slots.append(("last", sample.last))
    out = []
    for j, x in slots:
        x = x.float()
        spread = 0.0
        for g in groups:
            rows = x[g]
            ref = rows[0]
            rel = (rows - ref).norm(dim=-1).max() / ref.norm().clamp_min(1e-12)
            spread = max(spread, float(rel))
        out.append(
            {
                "slot": j,
                "rel_error": spread,
                "is_embedding": spread <= EMBED_SLOT_REL_TOL,
                "repeated_tokens": len(groups),
            }
        )
    return out


def _embedding_slot_findings(
    model: Eagle3Drafter,
    dialect: str,
    first: Any,
    embedding: torch.Tensor | None,
    embedding_source: str | None,
) -> tuple[list[Finding], dict[str, Any]]:
    """B12 / the seed incident ([embed, L3, L31, L59] stored, [2, 30, 58] served): a training
    slot that IS the token embedding (HF hidden_states[0]) while the drafter's config asks the
    engine for decoder layers only. Decided from the numbers: against the target's embedding,
    else the drafter's own saved one (speculators saves the target's), else by the slot being a
    function of the token id alone (`token_function_slots`)."""
    if embedding is None:
        tested = token_function_slots(first)
        embedding_source = (
            "none (the checkpoint has none, no --target): a slot that is the same row wherever "
            "a token repeats is a function of the token alone, the embedding"
        )
        if not tested:
            return [], {
                "embedding_slot_test": "not run: no embedding (pass --target) and too few "
                "repeated tokens to test without one"
            }
    else:
        tested = embedding_slots(first, embedding)
    info = {
        "embedding_slot_test": {
            "embedding_source": embedding_source,
            "slots": tested,
            "rows": first.num_tokens,
            "tolerance": EMBED_SLOT_REL_TOL,
        }
    }
    aux_embed = [t["slot"] for t in tested if t["is_embedding"] and t["slot"] != "last"]
    if not aux_embed:
        return [], info
    ids = model.cfg.aux_layer_ids
    conv = DIALECT_CONVENTION[dialect]
    config_hf = [hf_index(int(i), conv) for i in ids] if ids is not None else None
    if config_hf is not None and all(j < len(config_hf) and config_hf[j] == 0 for j in aux_embed):
        return [], info  # the config asks for the embedding where the data stores it
    n_slots = int(first.aux.shape[1])
    stored = ["embed" if j in aux_embed else "layer?" for j in range(n_slots)]
    if first.last is not None:
        stored.append("last (teacher)")
    served = (
        f"HF hidden_states {config_hf} (ids {ids}, {conv} convention)"
        if config_hf is not None
        else "the engine's default layers (no ids in the config), none of them the embedding"
    )
    return [
        Finding(
            "slot-layout",
            f"training aux slot(s) {aux_embed} of {n_slots} are the token embedding "
            f"(embed_tokens[input_ids] up to bf16, HF hidden_states[0]), but the drafter's config "
            f"asks the engine for {served}: fc was trained on an embedding slot that serving "
            "never delivers",
            {
                "embedding_slots": aux_embed,
                "stored_layout": stored,
                "slot_rel_errors": {str(t["slot"]): t["rel_error"] for t in tested},
                "embedding_source": embedding_source,
                "rows": first.num_tokens,
                "tolerance": EMBED_SLOT_REL_TOL,
                "config_layer_ids": ids,
                "config_convention": conv,
                "config_hf_indices": config_hf,
                "data_format": first.provenance.get("format"),
                "data_last": first.provenance.get("last"),
            },
            "Regenerate the training data at the layers the drafter is served with (no embedding "
            "slot) and retrain; or, if the drafter is meant to take the embedding, make the served "
            "config capture it (vLLM: id 0; SGLang >= 0.5.22: layers_to_capture 0).",
        )
    ], info


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
    found = _slot_findings(model, dialect, first)
    if not any(f.severity == "fault" for f in found):
        more, slot_info = _embedding_slot_findings(
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


def _reading_hits(
    model: Eagle3Drafter, td: Any, head: TargetHead | None, n: int, steps: list[int], K: int
) -> torch.Tensor:
    """Per scored row, whether the drafter's teacher-forced step-k draft (target space) is right,
    for k in `steps`, concatenated over samples: vs the target's argmax (rebuilt from the stored
    final state) with `head`, else vs the stored token."""
    dtype = next(model.parameters()).dtype
    out = []
    with torch.no_grad():
        for i in range(n):
            s = td[i]
            ids, mask = s.input_ids.long(), s.loss_mask.bool()
            if ids.shape[0] < K + 2:
                continue
            next_ids = torch.cat([ids[1:], ids.new_zeros(1)])
            outs = model.ttt(next_ids, s.aux_concat.to(dtype), steps=K)
            if head is not None and s.last is not None and s.last_norm is not None:
                teacher = head.teacher_logits(s.last, s.last_norm)
                refs = [reference_ids(teacher, k) for k in range(K)]
            else:
                data_ref = _data_reference(ids)
                refs = [torch.cat([data_ref[k:], data_ref.new_full((k,), -1)]) for k in range(K)]
            for k in steps:
                T = ids.shape[0]
                valid = torch.zeros(T, dtype=torch.bool)
                valid[: T - 1 - k] = mask[1 + k :]  # row t scores where loss_mask[t+1+k]
                valid &= refs[k] >= 0
                drafted = model.draft_to_target(outs[k].logits.argmax(-1))
                out.append((drafted == refs[k])[valid])
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool)


def resolve_norm_output(
    model: Eagle3Drafter,
    td: Any,
    value: bool,
    head: TargetHead | None = None,
    max_samples: int = 16,
    steps: int = 3,
    min_discordant: int = 10,
    z: float = 3.0,
) -> dict[str, Any]:
    """Which SpecForge `norm_output` reading (before/after PR #879) the weights were trained
    with, from the training tensors: the drafter is scored teacher-forced under both readings on
    the same rows; they differ at step 0 for `false` (norm before lm_head or not) and at steps
    >= 1 for `true` (the fed-back state). Paired test (McNemar): of the rows where exactly one
    reading is right, one reading must win by `z` standard deviations (|b - c| >= z*sqrt(b + c),
    b + c >= `min_discordant`); otherwise `reading` is None and hstrace says it cannot tell.
    The model's flags are left as they were."""
    n = min(len(td), max_samples)
    if n == 0:
        return {"reading": None, "why": "no training samples"}
    first = td[0]
    if tuple(first.aux.shape[1:]) != (model.cfg.num_aux, model.cfg.aux_width):
        return {"reading": None, "why": "the stored slots do not fit the drafter's fc"}
    scored = list(range(1, steps)) if value else [0]
    saved = (model.cfg.logits_use_norm, model.cfg.feed_normed)
    hits: dict[str, torch.Tensor] = {}
    try:
        for reading in NORM_OUTPUT_READINGS:
            flags = norm_output_flags(value, reading)
            model.cfg.logits_use_norm = flags["logits_use_norm"]
            model.cfg.feed_normed = flags["feed_normed"]
            hits[reading] = _reading_hits(model, td, head, n, scored, steps)
    finally:
        model.cfg.logits_use_norm, model.cfg.feed_normed = saved
    a, b = (hits[r] for r in NORM_OUTPUT_READINGS)
    only_a, only_b = int((a & ~b).sum()), int((~a & b).sum())
    disc = only_a + only_b
    decided = disc >= min_discordant and abs(only_a - only_b) >= z * disc**0.5
    best = NORM_OUTPUT_READINGS[0] if only_a > only_b else NORM_OUTPUT_READINGS[1]
    return {
        "reading": best if decided else None,
        "accuracy": {r: float(h.float().mean()) if h.numel() else None for r, h in hits.items()},
        "rows": int(a.numel()),
        "only_right_before_pr_879": only_a,
        "only_right_after_pr_879": only_b,
        "compared": (
            "teacher-forced accuracy at steps >= 1 (the fed-back state)"
            if value
            else "step-0 accuracy (norm before lm_head or not)"
        )
        + (" vs the target's argmax" if head is not None else " vs the stored tokens"),
        "test": f"McNemar: |b - c| >= {z} sqrt(b + c), b + c >= {min_discordant}",
        "why": None
        if decided
        else f"the readings disagree on {disc} of {int(a.numel())} rows ({only_a} vs {only_b}): "
        "not enough to tell",
    }
