"""The static rules on a drafter checkpoint: what the load report, the config and the vocab map
already reveal, before any trace. One table (`RULES`), run by `hstrace check` (all of it) and
by replay's config stage (the non-advisory rules that cover the engine that recorded the trace).

Engine facts used here (shared/reference/sglang-internals.md §2, training-formats.md §6, §9):
SGLang ≤0.5.11 maps only `midlayer.*` (drops `layers.0.*` silently); `fc_norm` from 0.5.12;
`norm_before_fc`/`input_norm` from 0.5.17; `norm_before_residual`, sliding windows and qwen3
q/k-norm never (through 0.5.23); `hot_token_id = d2t + arange` (offsets); always the target's
embedding; the target's lm_head when `draft_vocab_size` is absent.

To add a rule: a `Rule(...)` in `RULES` with a unique name, a code from `hstrace.findings.CODES`,
`applies_to=engines(...)` when engine versions matter, and a predicate over `CheckpointFacts`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from hstrace.drafter.checkpoint import INPUT_NORM_SOURCE, LoadReport
from hstrace.drafter.config import DrafterConfig
from hstrace.drafter.dialects import DIALECT_CONVENTION
from hstrace.drafter.model import Eagle3Drafter
from hstrace.drafter.norm_output import POST_879, PRE_879, norm_output_meaning
from hstrace.drafter.vocab import CheckpointD2T, checkpoint_reading
from hstrace.findings import Finding
from hstrace.rules.table import Rule, RuleRun, run_rules
from hstrace.rules.versions import engines
from hstrace.training.conventions import hf_index

# Every SGLang release hstrace knows (none through 0.5.23 serves these).
SGLANG_ALL = engines(sglang="<=0.5.23")


@dataclass
class CheckpointFacts:
    """What the rules read: the load report, the drafter as loaded, the target's layer count
    (from --target), `resolve_norm_output`'s answer (when it ran) and the vocab map's reading."""

    rep: LoadReport
    model: Eagle3Drafter
    n_layers: int | None = None
    resolution: dict[str, Any] | None = None
    vocab: CheckpointD2T = field(init=False)
    # where SGLang reads the aux ids in this config (its spec's reading), and why SGLang cannot
    # load this layout as it is (None: it can)
    aux_source: dict[str, Any] = field(init=False)
    sglang_cannot_load: str | None = field(init=False)

    def __post_init__(self) -> None:
        from hstrace.engines.registry import engine_spec

        m, rep = self.model, self.rep
        self.vocab = checkpoint_reading(
            m.d2t, m.t2d, m.cfg.vocab_size, "d2t" in rep.loaded, "t2d" in rep.loaded
        )
        sglang = engine_spec("sglang")
        self.aux_source = sglang.aux_layer_source(rep.config, self.n_layers)
        self.sglang_cannot_load = sglang.cannot_load(rep.dialect, rep.config)

    @property
    def cfg(self) -> DrafterConfig:
        return self.model.cfg

    @property
    def dialect(self) -> str:
        return self.rep.dialect

    def src(self, flag: str) -> str:
        """Where a flag's value came from ("config:<key>" or "default:<library>")."""
        return self.rep.flags.get(flag, (None, "?"))[1]

    @property
    def keys(self) -> list[str]:
        return list(self.rep.key_map)


# -- weights ---------------------------------------------------------------------------------


def _never_loaded(f: CheckpointFacts) -> list[str]:
    rep = f.rep
    return [
        p
        for p in rep.missing
        if p not in ("d2t", "t2d")
        and not (p == "embed_tokens.weight" and rep.dialect != "speculators")
    ]


WEIGHT_RULES: list[Rule[CheckpointFacts]] = [
    Rule(
        "unmapped-keys",
        "weights-dropped",
        when=lambda f: f.rep.unmapped,
        summary=lambda f, m: f"{len(m)} checkpoint tensor(s) map to no drafter parameter",
        evidence=lambda f, m: {"unmapped_keys": m[:20]},
        fix="Rename the keys to the drafter layout (`layers.0.*` or `midlayer.*`, `fc`, `norm`, "
        "`lm_head`, `d2t`, `t2d`) and re-save.",
    ),
    Rule(
        "parameters-not-loaded",
        "weights-dropped",
        when=_never_loaded,
        summary=lambda f, m: (
            f"{len(m)} drafter parameter(s) received no tensor and keep their initial values"
        ),
        evidence=lambda f, m: {"parameters_not_loaded": m[:20]},
        fix="Export the checkpoint again from the training run; every parameter must be saved.",
    ),
    Rule(
        "layers0-prefix",
        "weights-dropped",
        when=lambda f: [k for k in f.keys if k.startswith("layers.0.")],
        summary="decoder layer saved as `layers.0.*`; SGLang before 0.5.12 maps only "
        "`midlayer.*` and drops it without an error",
        evidence=lambda f, m: {"example_key": m[0], "n_keys": len(m)},
        fix="Serve with SGLang >= 0.5.12, or rename `layers.0.` -> `midlayer.` "
        "(`hstrace.drafter.save_drafter(model, out, dialect='specforge')`).",
        applies_to=engines(sglang="<0.5.12"),
    ),
    Rule(
        "qk-norm-weights",
        "weights-dropped",
        when=lambda f: [k for k in f.keys if k.endswith(("q_norm.weight", "k_norm.weight"))],
        summary="qwen3-style q_norm/k_norm weights; SGLang's EAGLE-3 draft is a Llama layer and "
        "drops them",
        evidence=lambda f, m: {"keys": m},
        fix="Serve this drafter with vLLM (Eagle3Qwen3ForCausalLM) or retrain with "
        "draft_arch=llama.",
        applies_to=SGLANG_ALL,
    ),
    Rule(
        "extra-decoder-layers",
        "weights-dropped",
        when=lambda f: sorted(
            {k.split(".")[1] for k in f.keys if re.match(r"layers\.[1-9]\d*\.", k)}
        ),
        summary="more than one draft decoder layer; SGLang before 0.5.12 supports exactly one",
        evidence=lambda f, m: {"extra_layers": m},
        fix="Serve with SGLang >= 0.5.12 or vLLM.",
        applies_to=engines(sglang="<0.5.12"),
    ),
]


# -- flags -----------------------------------------------------------------------------------


def _specforge_norm_output(f: CheckpointFacts) -> bool:
    return f.dialect == "specforge" and "norm_output" in f.rep.config


def _norm_output(f: CheckpointFacts) -> bool:
    return bool(f.rep.config.get("norm_output"))


def _reading(f: CheckpointFacts) -> str | None:
    return f.resolution.get("reading") if f.resolution else None


def _both_readings(f: CheckpointFacts) -> dict[str, Any]:
    value = _norm_output(f)
    return {
        "norm_output": value,
        "meaning_before_pr_879": norm_output_meaning(value, PRE_879),
        "meaning_after_pr_879": norm_output_meaning(value, POST_879),
        "engines_serve": "logits lm_head(norm(h)); next step gets norm(h) iff norm_output "
        "(SGLang >= 0.5.23, vLLM; older SGLang always h)",
    }


def _unknown_reading_summary(f: CheckpointFacts, _: Any) -> str:
    value = _norm_output(f)
    return (
        f"SpecForge `norm_output: {str(value).lower()}` changed meaning in SpecForge PR "
        "#879 (2026-09-15) and this checkpoint does not say which SpecForge trained it: "
        f"before #879 (specforge <= 0.2.0) {norm_output_meaning(value, PRE_879)}; after "
        f"it {norm_output_meaning(value, POST_879)}"
    )


def _unknown_reading_fix(f: CheckpointFacts, _: Any) -> str:
    if f.resolution:
        return (
            "Check the SpecForge commit of the training run (PR #879 or later means the "
            "new reading) and write the config accordingly."
        )
    return (
        "Run `hstrace check DRAFTER --against TRAINING_DIR --target TARGET_DIR`: "
        "hstrace scores both readings on the training tensors and names the one the "
        "weights were trained with; or check the SpecForge commit of the training run "
        "(PR #879 or later means the new reading)."
    )


FLAG_RULES: list[Rule[CheckpointFacts]] = [
    Rule(
        "norm-before-residual-sglang",
        "norm-flag-mismatch",
        when=lambda f: f.cfg.norm_before_residual,
        summary="trained with norm_before_residual=True; SGLang has no such flag and serves it "
        "as False",
        evidence=lambda f, m: {
            "norm_before_residual": True,
            "source": f.src("norm_before_residual"),
        },
        fix="Serve with vLLM (honours it), or retrain with norm_before_residual=False for SGLang.",
        applies_to=SGLANG_ALL,
    ),
    Rule(
        "norm-before-fc-old-sglang",
        "norm-flag-mismatch",
        when=lambda f: f.cfg.norm_before_fc,
        summary="norm_before_fc=True (input_norm.weight); SGLang before 0.5.17 skips the input norm",
        evidence=lambda f, m: {"norm_before_fc": True, "source": f.src("norm_before_fc")},
        fix="Serve with SGLang >= 0.5.17 (PR #32334) or vLLM with PR #38111.",
        applies_to=engines(sglang="<0.5.17"),
    ),
    Rule(
        "norm-before-fc-absent",
        "norm-flag-mismatch",
        when=lambda f: f.src("norm_before_fc") == INPUT_NORM_SOURCE,
        summary="the checkpoint holds input_norm.weight (a drafter built with norm_before_fc) "
        "but config.json has no norm_before_fc: vLLM and SGLang read the absent key as False "
        "and skip input_norm.weight without a word",
        evidence=lambda f, m: {
            "norm_before_fc": None,
            "inferred_from": "input_norm.weight",
            "engines_read_absent_as": False,
            "skipped_key": "input_norm.weight",
        },
        fix='Set "norm_before_fc": true in the draft config.json if the drafter was trained '
        "with it, as its input_norm.weight says (`hstrace check DRAFTER --against "
        "TRAINING_DIR` scores both values on the training tensors).",
        severity="warning",
    ),
    Rule(
        "fc-norm-old-sglang",
        "norm-flag-mismatch",
        when=lambda f: f.cfg.fc_norm,
        summary="fc_norm=True (per-slot norms before fc); SGLang before 0.5.12 skips them",
        evidence=lambda f, m: {"fc_norm": True, "source": f.src("fc_norm")},
        fix="Serve with SGLang >= 0.5.12.",
        applies_to=engines(sglang="<0.5.12"),
    ),
    Rule(  # SpecForge's norm_output: see its own rules below
        "speculators-norm-output",
        "norm-flag-mismatch",
        when=lambda f: f.cfg.feed_normed and f.dialect != "specforge",
        summary="speculators norm_output=True: steps >= 1 must receive the normed state; engines "
        "without norm_output plumbing feed the pre-norm state",
        evidence=lambda f, m: {
            "norm_output": True,
            "meaning": "feed norm(h) back",
            "source": f.src("feed_normed"),
        },
        fix="Serve with an engine that reads norm_output (vLLM with PR #46488; SGLang 0.5.23 "
        "reads it, older versions not verified).",
        severity="warning",
        applies_to=engines(sglang="<0.5.23"),
    ),
    # SpecForge `norm_output` changed meaning in PR #879; which reading the weights were trained
    # with is `resolve_norm_output`'s answer on the training tensors (`CheckpointFacts.resolution`).
    Rule(
        "specforge-norm-output-unknown",
        "norm-flag-mismatch",
        when=lambda f: _specforge_norm_output(f) and _reading(f) is None,
        summary=_unknown_reading_summary,
        evidence=lambda f, m: {
            **_both_readings(f),
            "reading": "unknown",
            "hstrace_loads_it_as": PRE_879,
            "tested_on_training_data": f.resolution.get("why") if f.resolution else "not run",
        },
        fix=_unknown_reading_fix,
        severity="warning",
        advisory=True,  # a question, not a verdict: replay judges it with the what-if search
    ),
    Rule(
        "specforge-norm-output-before-879-true",
        "norm-flag-mismatch",
        when=lambda f: _specforge_norm_output(f) and _reading(f) == PRE_879 and _norm_output(f),
        summary="trained before SpecForge PR #879: `norm_output: true` meant 'norm before "
        "lm_head, feed h back' (EAGLE-3), but SGLang >= 0.5.23 and vLLM read it as 'feed "
        "norm(h) back' (EAGLE-3.1): steps >= 1 get another input than in training",
        evidence=lambda f, m: {**_both_readings(f), "reading": PRE_879},
        fix="Drop `norm_output` from the served config.json (the norm before lm_head is "
        "applied anyway; absent = feed h back, as trained).",
        applies_to=engines(sglang=">=0.5.23", vllm=""),
    ),
    Rule(
        "specforge-norm-output-before-879-false",
        "norm-flag-mismatch",
        when=lambda f: _specforge_norm_output(f) and _reading(f) == PRE_879 and not _norm_output(f),
        summary="trained before SpecForge PR #879 with `norm_output: false`: lm_head on the "
        "un-normed state, which no engine serves (they always norm before lm_head)",
        evidence=lambda f, m: {**_both_readings(f), "reading": PRE_879},
        fix="Retrain (SpecForge >= PR #879, or norm_output true before it); engines cannot "
        "serve lm_head(h).",
    ),
    Rule(  # after #879, true = EAGLE-3.1: served as trained where norm_output is read
        "specforge-eagle-3.1-old-sglang",
        "norm-flag-mismatch",
        when=lambda f: _specforge_norm_output(f) and _reading(f) == POST_879 and _norm_output(f),
        summary="EAGLE-3.1 drafter (SpecForge >= PR #879, `norm_output: true`: feed norm(h) "
        "back); SGLang before 0.5.23 feeds h",
        evidence=lambda f, m: {**_both_readings(f), "reading": POST_879},
        fix="Serve with SGLang >= 0.5.23 or vLLM with PR #46488.",
        severity="warning",
        applies_to=engines(sglang="<0.5.23"),
    ),
    Rule(
        "lm-head-unnormed",
        "norm-flag-mismatch",
        when=lambda f: not _specforge_norm_output(f) and not f.cfg.logits_use_norm,
        summary="trained with norm_output=false (lm_head on the un-normed state); every engine "
        "applies the final norm before lm_head",
        evidence=lambda f, m: {"logits_use_norm": False, "source": f.src("logits_use_norm")},
        fix="Retrain with norm_output true, the only form engines serve.",
    ),
    Rule(
        "speculators-norm-before-residual-default",
        "norm-flag-mismatch",
        when=lambda f: f.dialect == "speculators" and "norm_before_residual" not in f.rep.config,
        summary="config has no norm_before_residual: speculators' class default is False, vLLM's "
        "update_eagle3 default is True",
        evidence=lambda f, m: {"speculators_default": False, "vllm_default": True},
        fix="Write norm_before_residual explicitly into config.json, with the value the drafter "
        "was trained with (its training config; `hstrace replay --against TRAINING_DIR` "
        "checks which value reproduces training).",
        severity="warning",
        applies_to=engines(vllm=""),
    ),
    Rule(
        "sliding-window-sglang",
        "attention-window",
        when=lambda f: f.cfg.sliding_window is not None,
        summary=lambda f, m: (
            f"trained with a {f.cfg.sliding_window}-token sliding window; "
            "SGLang's EAGLE-3 draft uses full attention"
        ),
        evidence=lambda f, m: {
            "sliding_window": f.cfg.sliding_window,
            "layer_types": f.cfg.layer_types,
        },
        fix="Expect divergence past the window on long contexts; serve with vLLM (reads "
        "layer_types/sliding_window) or retrain without the window.",
        severity="warning",
        applies_to=SGLANG_ALL,
    ),
    Rule(
        "eagle-rope-theta",
        "rope-mismatch",
        when=lambda f: (
            f.dialect == "eagle"
            and f.cfg.extra.get("config_rope_theta") is not None
            and float(f.cfg.extra["config_rope_theta"]) != 10000.0
        ),
        summary=lambda f, m: (
            f"config.json says rope_theta={f.cfg.extra['config_rope_theta']}, "
            "but EAGLE-3 trained with base 10000 whatever the config says; engines read the config"
        ),
        evidence=lambda f, m: {
            "config_rope_theta": f.cfg.extra["config_rope_theta"],
            "training_rope_theta": 10000.0,
        },
        fix="Remove rope_theta from config.json (or set it to 10000) for serving.",
    ),
]


# -- embedding and lm_head -------------------------------------------------------------------

HEAD_RULES: list[Rule[CheckpointFacts]] = [
    Rule(
        "no-draft-vocab-size",
        "embed-head-source",
        when=lambda f: (
            f.dialect != "speculators" and not f.cfg.extra.get("draft_vocab_size_in_config", True)
        ),
        summary="config.json has no draft_vocab_size: SGLang replaces the trained lm_head with "
        "the target's",
        evidence=lambda f, m: {
            "lm_head_in_checkpoint": any(v == "lm_head.weight" for v in f.rep.key_map.values())
        },
        fix="Add draft_vocab_size to config.json.",
        applies_to=SGLANG_ALL,
    ),
    Rule(
        "tied-embeddings",
        "embed-head-source",
        when=lambda f: f.cfg.extra.get("tie_word_embeddings"),
        summary="tie_word_embeddings=true: engines use the (target) embedding as lm_head and "
        "drop the trained one",
        evidence=lambda f, m: {"tie_word_embeddings": True},
        fix="Set tie_word_embeddings to false in config.json.",
    ),
    Rule(
        "trained-embedding-sglang",
        "embed-head-source",
        when=lambda f: f.dialect == "speculators" and f.cfg.extra.get("embed_requires_grad"),
        summary="the embedding was trained (embed_requires_grad) but SGLang always uses the "
        "target's embedding",
        evidence=lambda f, m: {"embed_requires_grad": True},
        fix="Serve with vLLM (uses the draft's embedding) or retrain with a frozen embedding.",
        applies_to=SGLANG_ALL,
    ),
]


# -- the vocab map (`hstrace.drafter.vocab.checkpoint_reading` decides the state) -------------


def _state(*states: str):
    return lambda f: f.vocab.state in states


def _inconsistent_summary(f: CheckpointFacts, _: Any) -> str:
    mm, Vd = f.vocab.mismatch or {}, f.cfg.draft_vocab_size
    return (
        f"t2d marks {mm['t2d_true']} target ids but d2t maps the {Vd} draft ids to "
        f"{mm['d2t_distinct_targets']} distinct ones, {mm['n_only_in_d2t']} "
        f"of them outside t2d and {mm['n_only_in_t2d']} t2d ids that no draft id "
        "reaches: training restricts the teacher with t2d, serving maps drafts with d2t, "
        "so they use different vocabularies"
    )


VOCAB_RULES: list[Rule[CheckpointFacts]] = [
    Rule(
        "vocab-map-missing",
        "vocab-map-missing",
        when=_state("missing", "zeros"),
        summary=lambda f, m: (
            f"draft vocab {f.cfg.draft_vocab_size} < target vocab "
            f"{f.cfg.vocab_size} but "
            + ("no d2t in the checkpoint" if f.vocab.state == "missing" else "d2t is all zeros")
        ),
        evidence=lambda f, m: dict(f.vocab.info),
        fix="Save the d2t/t2d built from the training data (speculators d2t.npy, SpecForge "
        "vocab_mapping.pt) into the checkpoint; without it draft id i is served as target id i.",
    ),
    Rule(
        "d2t-holds-target-ids",
        "d2t-direct-table",
        when=_state("direct-table"),
        summary="d2t holds target ids (a direct table), but every engine adds it to the draft id "
        "as an offset",
        evidence=lambda f, m: dict(f.vocab.info),
        fix="Store offsets: d2t = target_ids - arange(draft_vocab_size).",
    ),
    Rule(
        "t2d-d2t-inconsistent",
        "vocab-map-inconsistent",
        when=_state("inconsistent"),
        summary=_inconsistent_summary,
        evidence=lambda f, m: {**f.vocab.info, **(f.vocab.mismatch or {})},
        fix="Rebuild both from one vocab mapping: t2d = zeros(V, bool); t2d[arange(Vd) + d2t] "
        "= True (speculators d2t.npy/t2d.npy, SpecForge vocab_mapping.pt); retrain if the "
        "teacher was restricted with the wrong t2d.",
    ),
    Rule(
        "d2t-unsorted",
        "d2t-direct-table",
        when=_state("unsorted"),
        summary="d2t offsets are not non-decreasing; every library builds them from a sorted id "
        "list",
        evidence=lambda f, m: dict(f.vocab.info),
        fix="Rebuild d2t/t2d from the training data's vocab mapping.",
        severity="warning",
    ),
]


# -- aux slots -------------------------------------------------------------------------------


def sglang_default_hf_layers(n_layers: int) -> list[int]:
    """SGLang's (and vLLM's) default capture with no ids: HF hidden_states [2, N//2, N-3]."""
    return [2, n_layers // 2, n_layers - 3]


def _top_level_ids(f: CheckpointFacts) -> list[int] | None:
    """Aux layer ids at the config's top level with no `eagle_config`: SGLang's target reads
    only `eagle_config.eagle_aux_hidden_state_layer_ids` and captures its defaults instead (the
    recorder's audit says the same at record time: `sglang.audit.aux_layer_facts`). Not for
    a layout SGLang cannot load as it is (speculators): it would never read these ids, and the
    conversion it needs first decides where they go (`hstrace check` says so once)."""
    src = f.aux_source
    if f.sglang_cannot_load is not None:
        return None
    if src["read"] is not None or src["top_level_ids"] is None:
        return None
    return [int(i) for i in src["top_level_ids"]]


def _trained_hf(f: CheckpointFacts, ids: list[int]) -> list[int]:
    return [hf_index(i, DIALECT_CONVENTION[f.dialect]) for i in ids]


def _top_level_ids_vs_default(f: CheckpointFacts) -> list[int] | None:
    ids = _top_level_ids(f)
    if ids is None or f.n_layers is None:
        return None
    if sglang_default_hf_layers(f.n_layers) == _trained_hf(f, ids):
        return None  # SGLang's default is what the drafter was trained on: harmless
    return ids


def _aux_source_evidence(f: CheckpointFacts, ids: list[int]) -> dict[str, Any]:
    evidence: dict[str, Any] = {
        "top_level_ids": ids,
        "eagle_config": f.rep.config.get("eagle_config"),
        "id_convention": DIALECT_CONVENTION[f.dialect],
        "trained_hf_indices": _trained_hf(f, ids),
        "read_by_sglang": None,
    }
    if f.n_layers is not None:
        evidence |= {
            "target_layers": f.n_layers,
            "sglang_default_hf_indices": sglang_default_hf_layers(f.n_layers),
        }
    return evidence


_AUX_SOURCE_FIX = (
    'Add "eagle_config": {"eagle_aux_hidden_state_layer_ids": [...]} to the draft '
    "config.json, the ids in SGLang's convention (output of layer k, HF index k+1)."
)


SLOT_RULES: list[Rule[CheckpointFacts]] = [
    Rule(
        "aux-ids-top-level-vs-default",
        "aux-layers-default",
        when=_top_level_ids_vs_default,
        summary=lambda f, ids: (
            f"aux layer ids {ids} sit at the config's top level, which SGLang "
            f"ignores: the target captures its default HF hidden_states "
            f"{sglang_default_hf_layers(f.n_layers or 0)} instead of {_trained_hf(f, ids)}"
        ),
        evidence=_aux_source_evidence,
        fix=_AUX_SOURCE_FIX,
        applies_to=SGLANG_ALL,
        advisory=True,  # replay judges the capture from the recorded audit
    ),
    Rule(
        "aux-ids-top-level",
        "aux-layers-default",
        when=lambda f: _top_level_ids(f) if f.n_layers is None else None,
        summary=lambda f, ids: (
            f"aux layer ids {ids} sit at the config's top level, which SGLang "
            "ignores: the target captures its default HF hidden_states [2, N//2, N-3] instead of "
            f"{_trained_hf(f, ids)} (--target gives N and says whether they happen to agree)"
        ),
        evidence=_aux_source_evidence,
        fix=_AUX_SOURCE_FIX,
        # a fault for SGLang: its own (flat) format with the ids where it never reads them
        applies_to=SGLANG_ALL,
        advisory=True,
    ),
    Rule(
        "fc-width-note",
        "slot-layout",
        when=lambda f: f.rep.notes,
        many=True,
        summary=lambda f, note: note,
        evidence=lambda f, m: {
            "fc_in_features": f.model.fc.in_features,
            "aux_layer_ids": f.cfg.aux_layer_ids,
        },
        fix="Make eagle_aux_hidden_state_layer_ids / target_hidden_size in config.json match the "
        "fc weight.",
    ),
    Rule(
        "aux-ids-count",
        "slot-layout",
        when=lambda f: (
            f.cfg.aux_layer_ids is not None
            and len(f.cfg.aux_layer_ids) != f.cfg.num_aux
            and not f.rep.notes
        ),
        summary=lambda f, m: (
            f"config lists {len(f.cfg.aux_layer_ids or [])} aux layer ids but "
            f"fc takes {f.cfg.num_aux} slots"
        ),
        evidence=lambda f, m: {
            "aux_layer_ids": f.cfg.aux_layer_ids,
            "fc_in_features": f.model.fc.in_features,
        },
        fix="Make eagle_aux_hidden_state_layer_ids match the slots the drafter was trained on.",
    ),
]

# Table order is report order within a severity and stage (`in_dataflow_order` is stable).
RULES: list[Rule[CheckpointFacts]] = [
    *WEIGHT_RULES,
    *FLAG_RULES,
    *HEAD_RULES,
    *VOCAB_RULES,
    *SLOT_RULES,
]


def run_static(
    rep: LoadReport,
    model: Eagle3Drafter,
    n_layers: int | None = None,
    norm_output_resolution: dict[str, Any] | None = None,
    *,
    advisory: bool = False,
    engine: str | None = None,
    version: str | None = None,
) -> tuple[RuleRun, dict[str, Any]]:
    """`RULES` on one checkpoint. `n_layers`: the target's decoder layer count (from --target),
    for SGLang's defaults. `norm_output_resolution`: `resolve_norm_output`'s answer when it ran.
    `advisory` (what `hstrace check` asks for, before anything is served): also the rules that
    only say what to verify. Replay leaves them out: it judges both questions from the recorded
    data (the capture audit, the what-if search), and a question is not a verdict. `engine`,
    `version`: rules that do not cover them go to `RuleRun.other_versions`. Returns the run and
    the metrics (`{"vocab": ...}`)."""
    facts = CheckpointFacts(rep, model, n_layers, norm_output_resolution)
    run = run_rules(RULES, facts, advisory=advisory, engine=engine, version=version)
    return run, {"vocab": facts.vocab.info}


def static_findings(
    rep: LoadReport,
    model: Eagle3Drafter,
    n_layers: int | None = None,
    norm_output_resolution: dict[str, Any] | None = None,
    advisory: bool = False,
    engine: str | None = None,
    version: str | None = None,
) -> tuple[list[Finding], dict[str, Any]]:
    """`run_static`'s findings (those for `engine` at `version` when given) and metrics. A rule
    that failed internally raises (`RuntimeError` naming it): a caller that gets a list got
    every rule's answer."""
    run, metrics = run_static(
        rep,
        model,
        n_layers,
        norm_output_resolution,
        advisory=advisory,
        engine=engine,
        version=version,
    )
    if run.failed:
        raise RuntimeError("; ".join(f"{name}: {why}" for name, why in run.failed.items()))
    return run.findings, metrics
