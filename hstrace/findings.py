"""One language for `hstrace check`, `hstrace replay` and `hstrace diff`: findings with stable codes.

A finding names what diverges, where in the dataflow, the evidence (numbers), and a concrete fix.
Codes are stable API: scripts match on them, `docs/findings.md` documents each one.

`REGISTRY` is the one place a code is declared: its stage, default severity, meaning, the doc
anchor, the checks that may emit it, and its fix templates. Checks build findings with
`finding(code, summary, evidence, variant=..., **fields)`: the fix is the registry's template
for that variant filled with `fields`. Adding a code = one `Code(...)` here, its check, and its
section in docs/findings.md (`tests/test_findings_registry.py` holds all three together).
Findings are put in order in one place: `in_dataflow_order`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any

# Dataflow order: a report leads with the earliest stage that diverges.
STAGES: tuple[str, ...] = (
    "config",
    "weights",
    "vocab-map",
    "target-capture",
    "draft-input",
    "draft-logits",
    "acceptance",
)
SEVERITIES = ("fault", "warning", "info")
FINDINGS_DOC = "docs/findings.md"


@dataclass(frozen=True)
class Code:
    """One finding code, declared once. `checks` name the functions that may emit it
    (`"diagnose.capture:aux_order"` = `hstrace.diagnose.capture.aux_order`; `"rules.checkpoint"`
    = a rule of that table, which replay runs through `diagnose.config.checkpoint_findings`;
    `"evaluation.slots"` = `hstrace check --against`'s slot checks), in precedence order: when
    two of them find the code, the first keeps its summary and fix and the others add their
    evidence (`hstrace.diagnose.merge`). The diagnose checks run are the ones named here.
    `fix` maps a variant name ("" the default) to a `str.format` template."""

    code: str
    stage: str
    meaning: str
    checks: tuple[str, ...]
    severity: str = "fault"
    fix: Mapping[str, str] = field(default_factory=dict)
    # The what-if hypotheses (`hstrace.replay` search names their kind) that confirm this code;
    # their fix is the variant "what-if", filled with the hypothesis' parameters.
    hypotheses: tuple[str, ...] = ()
    # The engines' audit facts (`{"fact": name, "summary", "evidence", "fix"?}`, recorded by the
    # hooks) that are this code: `from_fact` maps them. An engine states facts, never codes.
    facts: tuple[str, ...] = ()

    @property
    def anchor(self) -> str:
        """Where the code is documented (a GitHub heading anchor of docs/findings.md)."""
        return f"{FINDINGS_DOC}#{self.code}"

    def fix_text(self, variant: str = "", **fields: Any) -> str:
        if variant not in self.fix:
            raise KeyError(f"finding code {self.code!r} has no fix variant {variant!r}")
        return self.fix[variant].format(**fields)


# `engine_ids`: what each serving engine's draft config needs to capture those layers (the
# engines' own key names and id conventions; `diagnose.capture` fills it).
_LAYERS_FIX = (
    "make serving capture the training layers (HF hidden_states {train_hf}): in the draft "
    "config.json set {engine_ids}; or regenerate the training data with the layers serving "
    "captures"
)
_DRIFT_FIX = (
    "serve the same target weights, dtype and quantisation as at data generation (FP8 or "
    "another checkpoint drifts), or regenerate the training hidden states with the serving target"
)
# The what-if search's hypotheses (diagnose.config:whatif_findings maps each to its code).
_WHATIF = "diagnose.config:whatif_findings"
_RULES = "rules.checkpoint"
_MTP_RULES = "rules.mtp"  # the MTP head's table (hstrace.rules.mtp.MTP_RULES)

_ALL: tuple[Code, ...] = (
    Code(
        "acceptance-simulated",
        "config",
        "a simulated/synthetic acceptance switch is on in the engine: every accept number is fake",
        ("diagnose.measurement:acceptance_simulated",),
        fix={
            "": "record again with the switch off: unset SGLANG_SIMULATE_ACC_LEN / "
            'SGLANG_SIMULATE_ACC_METHOD (SGLang), drop "rejection_sample_method": "synthetic" '
            "from --speculative-config (vLLM), unset TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS "
            "(TensorRT-LLM); judge the drafter only from a run without it"
        },
    ),
    Code(
        "spec-params-adjusted",
        "config",
        "the engine silently changed speculative settings (e.g. num_draft_tokens)",
        ("diagnose.config:spec_params", "diagnose.config:static_load_findings"),
        severity="warning",
        fix={
            "": "pass the effective values explicitly (with topk=1, num_draft_tokens must be "
            "num_steps+1)"
        },
        facts=("spec-adjusted",),
    ),
    Code(
        "norm-flag-mismatch",
        "config",
        "a norm flag the drafter was trained with is ignored or read differently by the engine",
        (_RULES, _WHATIF, "diagnose.config:fed_back_state"),
        fix={
            "what-if": "the engine behaves as if {flag}={served}; the drafter was trained with "
            '{flag}={trained}: set "{key}": {trained_json} in the draft config.json and serve '
            "with an engine version that reads it",
            "fed-back": 'set "norm_output": {trained_json} (speculators/vLLM meaning: feed the '
            "normed state back) in the draft config.json and serve with an engine version that "
            "reads it, or retrain with the state the engine feeds back",
        },
        hypotheses=("norm-flag",),
    ),
    Code(
        "attention-window",
        "config",
        "training and serving use different attention windows for the drafter",
        (_RULES, _WHATIF),
        fix={
            "what-if": "the engine's drafter uses {served}; it was trained with {trained}: set "
            '"sliding_window" ({window}) and "layer_types" in the draft config so the engine '
            "attends like training"
        },
        hypotheses=("sliding-window",),
    ),
    Code(
        "rope-mismatch",
        "config",
        "the drafter's RoPE settings differ between training and serving",
        (_RULES, _WHATIF),
        fix={
            "what-if": "the engine uses rope_theta={served:g}; the drafter was trained with "
            '{trained:g}: set "rope_theta": {trained:g} in the draft config.json'
        },
        hypotheses=("rope-theta",),
    ),
    Code(
        "weights-dropped",
        "weights",
        "checkpoint tensors were not loaded (key prefix or name the engine does not map)",
        (
            "diagnose.config:static_load_findings",
            _RULES,
            _MTP_RULES,
            "diagnose.weights:weights_dropped",
        ),
        fix={
            "": "rename the checkpoint keys to the names the engine maps (SGLang: fc.*, "
            "midlayer.* or layers.0.*, norm.*, lm_head.*, d2t); unknown keys are dropped "
            "silently and the parameters keep their initial values — `hstrace check DRAFTER` "
            "lists each key and what took it"
        },
        facts=("weights-not-loaded",),
    ),
    Code(
        "embed-head-source",
        "weights",
        "embeddings or lm_head come from another source than in training",
        (_RULES, _MTP_RULES, _WHATIF),
        fix={
            "what-if": "the engine replaces the drafter's trained embed_tokens with the "
            "target's (SGLang set_embed); serve with an engine that loads the draft embedding, "
            "or train with the target's embedding frozen (embed_requires_grad: false)"
        },
        hypotheses=("target-embedding",),
    ),
    Code(
        "d2t-direct-table",
        "vocab-map",
        "d2t holds offsets but is read as a direct draft->target table (or vice versa)",
        (_RULES, "diagnose.vocab:vocab_mapping"),
        fix={
            "": "map draft id i to target id i + d2t[i] (SGLang: hot_token_id = d2t + arange); "
            "if a converter wrote absolute ids into d2t, store offsets instead "
            "(d2t = ids - arange(draft_vocab_size))",
            "unknown": "compare the engine's d2t / hot_token_id with the checkpoint's d2t "
            "(`hstrace check DRAFTER`)",
        },
    ),
    Code(
        "vocab-map-missing",
        "vocab-map",
        "the draft vocab is smaller than the target's but no d2t mapping is applied",
        (_RULES, "diagnose.vocab:vocab_mapping"),
        fix={
            "": "ship the vocab mapping in the checkpoint (key `d2t`, int64 offsets, "
            "{draft_vocab_size} entries) and make sure the engine loads it"
        },
    ),
    Code(
        "vocab-map-inconsistent",
        "vocab-map",
        "t2d and d2t describe different draft vocabularies (training and serving use different "
        "ones)",
        (_RULES,),
    ),
    Code(
        "batch-coupling",
        "target-capture",
        "a request's aux rows or draft inputs belong to another request of the same batch",
        ("diagnose.batch:batch_coupling",),
        fix={
            "": "the engine indexes the batch wrongly when it hands rows to the drafter (a "
            "gather over the wrong group, offsets after a reorder or padding): confirm by "
            "serving with --max-running-requests 1 (SGLang) / --max-num-seqs 1 (vLLM) and "
            "without --enable-dp-attention; known fixes: sglang PR #20492 (eagle3 gather under "
            "attention-DP), vllm-ascend PR #2794 (proposer source indices), TensorRT-LLM PR "
            "#10654"
        },
    ),
    Code(
        "aux-layers-default",
        "target-capture",
        "the engine captured its default aux layers, not the ones the drafter was trained on",
        ("diagnose.config:static_load_findings", _RULES, "diagnose.capture:aux_layers_default"),
        fix={
            "": _LAYERS_FIX,
            "top-level-ids": 'move the ids into "eagle_config": '
            '{{"eagle_aux_hidden_state_layer_ids": [...]}} in the draft config.json',
        },
        facts=("aux-ids-ignored",),
    ),
    Code(
        "aux-layer-shift",
        "target-capture",
        "captured aux layers are shifted by a layer (index convention off by one)",
        (_RULES, _WHATIF, "diagnose.capture:aux_layer_shift"),
        fix={
            "": _LAYERS_FIX,
            "what-if": "the engine fed aux layers shifted by {shift:+d} from training: fix the "
            "layer-id convention (SGLang adds +1 to explicit ids)",
        },
        hypotheses=("aux-layer-shift",),
    ),
    Code(
        "aux-order",
        "target-capture",
        "aux slots are concatenated in another order than in training",
        (_RULES, "diagnose.capture:aux_order"),
        fix={
            "": "concatenate the aux states in ascending layer order on both sides (engines "
            "capture inside the layer loop; the training pipeline must not follow the id list's "
            "order), or permute fc.weight's input blocks by {permutation}"
        },
    ),
    Code(
        "slot-layout",
        "target-capture",
        "a slot is missing or extra (e.g. the embedding slot), or the stored layout differs",
        (_RULES, "diagnose.capture:slot_layout", "evaluation.slots"),
        fix={
            "": _LAYERS_FIX,
            "count": "train and serve on the same slots: compare the capture list with the "
            "stored slots (a final-state or embedding slot counted as aux is the usual cause)",
            "embedding-slot": "train on the layers serving captures (drop the embedding slot "
            "and read the last stored slot as the teacher, not as aux), or capture the "
            "embedding in serving (SGLang id -1, 0.5.22+)",
            "no-target": "give --target DIR to fingerprint each slot against the target's layers",
            "stored-count": "Check which stored slots the trainer fed (speculators: all but the "
            "last; the last is the teacher's state).",
            "stored-layers": "Use data captured at the drafter's layers, or fix "
            "eagle_aux_hidden_state_layer_ids to the layers it was trained on (mind each "
            "library's id convention).",
            "stored-embedding": "Regenerate the training data at the layers the drafter is "
            "served with (no embedding slot) and retrain; or, if the drafter is meant to take "
            "the embedding, make the served config capture it (vLLM: id 0; SGLang >= 0.5.22: "
            "layers_to_capture 0).",
        },
    ),
    Code(
        "hidden-corrupt",
        "target-capture",
        "aux hidden states are zeros, constant, or belong to another request",
        ("diagnose.capture:hidden_corrupt",),
        fix={
            "slots": "the target's aux capture is inactive or stale (a CUDA-graph buffer "
            "captured before the layers were configured, sglang PR #22836; a hybrid model that "
            "writes nothing): rerun with --disable-cuda-graph to confirm, then upgrade",
            "rows": "the capture skipped part of these requests{prefix_hint}; a producer must "
            "record only rows it computed (a cached prefix has no target rows, see "
            "docs/trace-format.md), never zeros in their place",
            "crossed": "the capture writes rows of another request (batch indexing after a "
            "reorder or padding): check the row order of the aux buffer against the batch's "
            "requests",
            "unrelated": "check which tensor the capture returns for these rows (truncation, "
            "wrong rows, a pipeline-parallel layer index restarting at 0)",
        },
    ),
    Code(
        "target-drift",
        "target-capture",
        "the target's hidden states differ from training beyond precision noise",
        ("diagnose.capture:target_drift",),
        fix={"": _DRIFT_FIX},
    ),
    Code(
        "fc-skipped",
        "draft-input",
        "the drafter's fc projection was skipped (a width check passed)",
        (_WHATIF, "diagnose.draft_input:fc_skipped"),
        fix={
            "": "serve with --speculative-algorithm EAGLE3 (not EAGLE) so the target captures "
            "the {num_aux} aux layers and delivers {fc_in} values per token",
            "what-if": "the drafter got one H-wide state and skipped fc: serve with "
            "--speculative-algorithm EAGLE3 so the target delivers the aux concat",
        },
        hypotheses=("no-fc",),
    ),
    Code(
        "token-shift",
        "draft-input",
        "draft input tokens or positions are shifted relative to training",
        (_WHATIF, "diagnose.draft_input:token_shift"),
        fix={
            "": "pair the aux state of position t with the token at t+1 (shift the input ids "
            "left by one before the draft extend, as EAGLE-3 trains)",
            "positions": "feed each draft row the position of its aux state",
            "position-offset": "none needed unless the drafter uses a sliding window or "
            "absolute position scaling",
            "what-if": "the engine pairs aux row t with token t{pairing:+d} instead of t+1: feed "
            "the token that follows each aux row (EAGLE-3 pairing)",
        },
        hypotheses=("token-shift",),
    ),
    Code(
        "chunk-boundary-token",
        "draft-input",
        "at chunked-prefill seams the drafter got the target's prediction, not the next prompt "
        "token",
        ("diagnose.draft_input:chunk_boundary_token",),
        fix={
            "": "at the end of a non-final prefill chunk the draft input's last token must be "
            "the first token of the next chunk, not the target's sampled prediction: upgrade "
            "SGLang to a version with PR #26800 (the fix of PR #26329), or serve with a "
            "--chunked-prefill-size larger than the prompts to confirm"
        },
    ),
    Code(
        "draft-kv-stale",
        "draft-logits",
        "after a prefix-cache hit the drafter attends over stale, zero or foreign KV",
        ("diagnose.cache:draft_kv_stale",),
        fix={
            "": "confirm: {confirm}; if the cache-hit requests' acceptance recovers, the "
            "engine's draft KV for cached prefixes is stale: upgrade to a version with the fix "
            "(known upstream fixes: sglang PR #19897 (spec-v2 draft KV uninitialised on radix "
            "hits), PR #17338 and #30393 (HiCache did not manage the draft KV), PR #11215 "
            "(HiCache) and #11231 (SWA radix cache); vllm#41838 (block hashes committed before "
            "the forward wrote the KV); TensorRT-LLM PR #5285 (last draft token's KV never "
            "written)), or keep the prefix cache off for the drafter"
        },
    ),
    Code(
        "rank-divergence",
        "draft-logits",
        "the same request and step gets different draft ids, states or drafters on different "
        "tensor-parallel ranks",
        ("diagnose.ranks:rank_divergence",),
        fix={
            "": "every rank must build the same drafter and draft the same ids: compare the "
            "ranks' load audits and serve with the draft tensor-parallel size equal to the "
            "target's (known: vllm #50158 ranks disagreeing on the shared embedding, vllm PR "
            "#31886 and vllm-ascend PR #5519 draft TP forced to the target's, ROCm/ATOM PR "
            "#2049 ranks accepting different counts on 1-ULP ties)",
            "local-argmax": "rank {rank} takes its draft argmax over its own vocab shard "
            "[{start}, {end}): gather the drafter's logits across the tensor-parallel group "
            "(all-gather) before the argmax, as TensorRT-LLM PR #16440 does",
            "load-audit": "the ranks built different drafters ({items} differ between rank 0 "
            "and rank {rank}): load the same checkpoint and share the target's embedding and "
            "head on every rank or on none (vllm #50158; the collapse survives PR #50280)",
            "states": "the aux hidden states should be replicated after the all-reduce but "
            "differ on rank {rank}: check the tensor-parallel all-reduce of the captured layers "
            "and that every rank captures the same layer ids",
        },
    ),
    Code(
        "teacher-norm",
        "acceptance",
        "the training teacher used another final norm than the target applies",
        ("diagnose.training_side:teacher_norm",),
        fix={
            "": "store the final state as the library expects: speculators wants the pre-norm "
            "final stream (vLLM capture id N, before model.norm), SpecForge the post-norm "
            "lm_head input; regenerate the dump or fix the generator's capture point"
        },
    ),
    Code(
        "metric-overstates",
        "acceptance",
        "the training metric overstates what greedy serving can accept",
        ("diagnose.training_side:metric_overstates",),
        severity="warning",
        fix={
            "": "judge the drafter by accuracy against the full-vocab target argmax; rebuild "
            "d2t/t2d from the serving traffic's token frequencies or raise draft_vocab_size"
        },
    ),
    Code(
        "spec-changes-output",
        "acceptance",
        "speculative decoding changes the engine's greedy output",
        ("diagnose.parity:spec_changes_output",),
        fix={
            "": "the engine's verify or its state rollback differs from plain decoding at "
            "request {request} position {position}: rerun that request with and without "
            "speculation and report it to the engine (a hybrid or stateful target whose state "
            "is not rolled back after a rejected draft, vllm PR #50146, is the known cause); "
            "serve without speculation until it is fixed"
        },
    ),
    Code(
        "no-wiring-fault",
        "acceptance",
        "serving and training agree; the drafter itself is weak",
        ("diagnose.training_side:no_wiring_fault",),
        severity="info",
        fix={
            "": "nothing to rewire: to raise acceptance, train the drafter longer or on data "
            "closer to the serving traffic"
        },
    ),
)

REGISTRY: Mapping[str, Code] = MappingProxyType({c.code: c for c in _ALL})
# code -> (stage, one-line meaning): the registry's short view (docs, `hstrace check`).
CODES: Mapping[str, tuple[str, str]] = MappingProxyType(
    {c.code: (c.stage, c.meaning) for c in _ALL}
)
# Codes that lead a report whatever else is found: they make every other number meaningless.
LEADING: tuple[str, ...] = ("acceptance-simulated",)
# what-if hypothesis kind -> the code it confirms
HYPOTHESES: Mapping[str, str] = MappingProxyType({h: c.code for c in _ALL for h in c.hypotheses})
# engine audit fact -> its code
FACTS: Mapping[str, str] = MappingProxyType({f: c.code for c in _ALL for f in c.facts})


@dataclass
class Finding:
    code: str
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    fix: str = ""
    severity: str = "fault"
    # Engine versions the finding applies to, when it depends on them (e.g. "sglang<0.5.17").
    applies_to: str | None = None

    def __post_init__(self) -> None:
        if self.code not in REGISTRY:
            raise ValueError(
                f"unknown finding code {self.code!r}; declare it in hstrace.findings.REGISTRY"
            )
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}")

    @property
    def stage(self) -> str:
        return REGISTRY[self.code].stage

    def to_json(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "stage": self.stage,
            **{k: v for k, v in asdict(self).items() if k != "code"},
        }


def finding(
    code: str,
    summary: str,
    evidence: dict[str, Any] | None = None,
    *,
    variant: str = "",
    severity: str | None = None,
    fix: str | None = None,
    applies_to: str | None = None,
    **fields: Any,
) -> Finding:
    """A finding of a registered code: severity defaults to the code's, the fix is the code's
    template for `variant` filled with `fields` (a rule of `hstrace.rules` passes its own)."""
    c = REGISTRY.get(code)
    if c is None:
        raise ValueError(f"unknown finding code {code!r}; declare it in hstrace.findings.REGISTRY")
    return Finding(
        code,
        summary,
        dict(evidence or {}),
        c.fix_text(variant, **fields) if fix is None else fix,
        severity=c.severity if severity is None else severity,
        applies_to=applies_to,
    )


def from_fact(fact: Mapping[str, Any]) -> Finding:
    """The finding an engine's audit fact is (`Code.facts`): its summary and evidence, the
    fact's own fix when the engine states one (its key names), else the code's template."""
    name = str(fact.get("fact"))
    if name not in FACTS:
        raise ValueError(f"unknown audit fact {name!r}; declare it in hstrace.findings.REGISTRY")
    return finding(
        FACTS[name],
        str(fact.get("summary", "")),
        dict(fact.get("evidence") or {}),
        fix=fact.get("fix"),
        severity=fact.get("severity"),
    )


def in_dataflow_order(findings: list[Finding]) -> list[Finding]:
    """`LEADING` codes first, then faults before warnings before info, each in dataflow order;
    stable otherwise. The one place findings are put in order."""
    return sorted(
        findings,
        key=lambda f: (
            f.code not in LEADING,
            SEVERITIES.index(f.severity),
            STAGES.index(f.stage),
        ),
    )
