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
from typing import Any

import torch

from hstrace.drafter.checkpoint import LoadReport
from hstrace.drafter.model import Eagle3Drafter
from hstrace.findings import Finding

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


def training_findings(
    model: Eagle3Drafter, td: Any, max_samples: int = 8, steps: int = 3
) -> tuple[list[Finding], dict[str, Any]]:
    """Stored slots vs the config, and teacher-forced accuracy against the data's own next tokens
    (`acc_vs_data_k`: step-k draft, mapped to target ids, == the token k+2 after the aux row,
    over loss-masked rows; a teacher-free figure, so it states its convention)."""
    cfg, out = model.cfg, []
    n = min(len(td), max_samples)
    if n == 0:
        return [], {"samples": 0}
    first = td[0]
    n_slots, width = int(first.aux.shape[1]), int(first.aux.shape[2])
    if (n_slots, width) != (cfg.num_aux, cfg.aux_width):
        out.append(
            Finding(
                "slot-layout",
                f"training data stores {n_slots} aux slots of width {width}; the drafter's fc takes {cfg.num_aux} of width {cfg.aux_width}",
                {
                    "stored_slots": n_slots,
                    "stored_width": width,
                    "fc_slots": cfg.num_aux,
                    "fc_width": cfg.aux_width,
                    "stored_layer_ids": first.slot_layer_ids,
                    "config_layer_ids": cfg.aux_layer_ids,
                    "provenance": first.provenance,
                },
                "Check which stored slots the trainer fed (speculators: all but the last; the last is the teacher's state).",
            )
        )
        return out, {"samples": n, "format": getattr(td, "format", None)}
    hits, total = [0] * steps, [0] * steps
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        for i in range(n):
            s = td[i]
            x, mask = s.input_ids.long(), s.loss_mask.bool()
            T = x.shape[0] - 1
            if T < 2:
                continue
            outs = model.ttt(x[1:], s.aux_concat[:-1].to(dtype), steps=steps)
            for k, o in enumerate(outs):
                rows = T - 1 - k  # row t predicts x[t+2+k]
                if rows <= 0:
                    continue
                pred = model.draft_to_target(o.logits[:rows].argmax(-1))
                m = mask[2 + k : 2 + k + rows]
                hits[k] += int(((pred == x[2 + k : 2 + k + rows]) & m).sum())
                total[k] += int(m.sum())
    acc = [h / t if t else None for h, t in zip(hits, total, strict=True)]
    return out, {
        "samples": n,
        "format": getattr(td, "format", None),
        "acc_vs_data": acc,
        "acc_vs_data_convention": "teacher-forced, unconditional, target-space draft argmax vs the data's next token, loss-masked rows",
    }
