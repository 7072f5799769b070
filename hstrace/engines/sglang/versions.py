"""Which SGLang releases hstrace can hook, and where: the patch-point table, chosen by version.

Pure data + lookups; importing this never imports SGLang. Signatures per release come from
the released wheels (shared/reference/sglang-internals.md §3.3, §6);
tests/test_sglang_patch_points.py checks the 0.5.23 rows against the real package
(`inspect.signature`; the capture rows against its sources: every class defining
`set_eagle3_layers_to_capture` must have one).
"""

from __future__ import annotations

from hstrace.engines import support

MIN_SUPPORTED = (0, 5, 13)  # v1 eagle_worker.py removed; EAGLEWorkerV2 always runs
MAX_SUPPORTED = (0, 5, 23)
PLUGIN_ENTRY_POINTS_SINCE = (0, 5, 11)  # sglang.srt.plugins entry-point group
PLUGIN_GROUP = "sglang.srt.plugins"

Version = support.Version
# The patch-point row type is shared with vLLM's table (hstrace.engines.support).
PatchPoint = support.PatchPoint


_W2 = "sglang.srt.speculative.eagle_worker_v2"
_V = MIN_SUPPORTED
_END = MAX_SUPPORTED

# Every target class SGLang 0.5.23 defines `set_eagle3_layers_to_capture(self, layer_ids)` on
# (module:Class under sglang.srt.models; read from the 0.5.23 sources): the architectures an
# EAGLE-3 drafter can be served against. Subclasses that inherit the method (e.g. Mistral from
# Llama) are covered through their base. Classes that only forward to an inner language model
# (Gemma3/Llama4/Kimi-K2.5 multimodal, MindSpore) are patched too: the inner call records the
# capture, the outer one records it again under the class SGLang was asked to serve. Not listed:
# the inner model classes some targets delegate to (`Qwen2MoeModel`, `Qwen3NextModel`,
# `qwen3_5.Qwen3_5ForCausalLM`: they take `layers_to_capture`, already resolved, not the ids).
# Llama's row holds since the oldest supported release; the others are checked on 0.5.23 only.
CAPTURE_TARGETS: tuple[tuple[str, Version], ...] = (
    ("llama:LlamaForCausalLM", _V),
    *(
        (target, (0, 5, 23))
        for target in (
            "apertus:ApertusForCausalLM",
            "bailing_moe:BailingMoEForCausalLM",
            "deepseek_v2:DeepseekV2ForCausalLM",
            "exaone_moe:ExaoneMoEForCausalLM",
            "gemma3_causal:Gemma3ForCausalLM",
            "gemma3_mm:Gemma3ForConditionalGeneration",
            "gemma4_causal:Gemma4ForCausalLM",
            "gemma4_mm:Gemma4ForConditionalGeneration",
            "glm4_moe:Glm4MoeForCausalLM",
            "glm4_moe_lite:Glm4MoeLiteForCausalLM",
            "glm5_next:Glm5NextForConditionalGeneration",
            "gpt_oss:GptOssForCausalLM",
            "kimi_k25:KimiK25ForConditionalGeneration",
            "longcat_flash:LongcatFlashForCausalLM",
            "mindspore:MindSporeForCausalLM",
            "minimax_m2:MiniMaxM2ForCausalLM",
            "minimax_m3:MiniMaxM3SparseForCausalLM",
            "minimax_m3_vl:MiniMaxM3SparseForConditionalGeneration",
            "mllama4:Llama4ForConditionalGeneration",
            "qwen2:Qwen2ForCausalLM",
            "qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
            "qwen2_moe:Qwen2MoeForCausalLM",
            "qwen3:Qwen3ForCausalLM",
            "qwen3_5_text:Qwen3_5ForCausalLM",
            "qwen3_moe:Qwen3MoeForCausalLM",
            "qwen3_next:Qwen3NextForCausalLM",
            "qwen3_vl:Qwen3VLForConditionalGeneration",
        )
    ),
)

PATCH_POINTS: tuple[PatchPoint, ...] = (
    # static audit
    PatchPoint(
        "sglang.srt.models.llama_eagle3:LlamaForCausalLMEagle3.load_weights",
        ("self", "weights"),
        _V,
        _END,
        ("static.weights", "static.draft_config", "static.hot_token_id"),
    ),
    # an MTP head (`--speculative-algorithm EAGLE` with a MiMo target): its load audit; the MTP
    # record is taken by the worker's __init__ tap below (checked on 0.5.23 only)
    PatchPoint(
        "sglang.srt.models.mimo_mtp:MiMoMTP.load_weights",
        ("self", "weights"),
        (0, 5, 23),
        _END,
        ("static.weights",),
    ),
    # the target's capture: one row per target class that defines the method (`CAPTURE_TARGETS`)
    *(
        PatchPoint(
            f"sglang.srt.models.{target}.set_eagle3_layers_to_capture",
            ("self", "layer_ids"),
            since,
            _END,
            ("static.layers_to_capture",),
        )
        for target, since in CAPTURE_TARGETS
    ),
    PatchPoint(
        f"{_W2}:EAGLEWorkerV2.__init__",
        ("self", "server_args", "gpu_id", "nccl_port", "target_worker"),
        _V,
        _END,
        ("static.spec", "static.mtp"),
    ),
    # main process: server-argument resolution (0.5.13+ keeps the user's value in the field and
    # the adjusted one in a side stash; this also runs on CPU, unlike the worker's __init__)
    PatchPoint(
        "sglang.srt.server_args:ServerArgs.resolve_once",
        ("self",),
        _V,
        _END,
        ("static.spec_resolution",),
    ),
    # per-step taps at worker boundaries (they run whether or not CUDA graphs are used)
    PatchPoint(
        f"{_W2}:EagleDraftWorker._draft_extend_for_prefill",
        ("self", "batch", "target_hidden_states", "next_token_ids", "mm_input_embeds"),
        _V,
        (0, 5, 21),
        ("target", "draft_extend", "requests"),
    ),
    PatchPoint(
        f"{_W2}:EagleDraftWorker._draft_extend_for_prefill",
        (
            "self",
            "batch",
            "target_hidden_states",
            "next_token_ids",
            "mm_input_embeds",
            "kv_loc_plan",
        ),
        (0, 5, 22),
        _END,
        ("target", "draft_extend", "requests"),
    ),
    PatchPoint(
        f"{_W2}:EagleDraftWorker._draft_extend_for_decode",
        ("self", "batch", "batch_result"),
        _V,
        (0, 5, 21),
        ("draft_extend",),
    ),
    PatchPoint(
        f"{_W2}:EagleDraftWorker._draft_extend_for_decode",
        ("self", "batch", "batch_result", "kv_loc_plan"),
        (0, 5, 22),
        _END,
        ("draft_extend",),
    ),
    PatchPoint(
        f"{_W2}:EAGLEWorkerV2.verify", ("self", "batch"), _V, (0, 5, 16), ("target", "verify")
    ),
    PatchPoint(
        f"{_W2}:EAGLEWorkerV2.verify",
        ("self", "batch", "grammar_barrier"),
        (0, 5, 17),
        (0, 5, 20),
        ("target", "verify"),
    ),
    PatchPoint(
        f"{_W2}:EAGLEWorkerV2.verify",
        ("self", "batch", "pp_proxy_tensors", "grammar_barrier"),
        (0, 5, 21),
        _END,
        ("target", "verify"),
    ),
    # eager-only: the draft runner's forward (inside CUDA graphs it is not called; the
    # graph-level inputs are still recorded by the worker-boundary taps above)
    PatchPoint(
        "sglang.srt.model_executor.model_runner:ModelRunner.forward",
        (
            "self",
            "forward_batch",
            "skip_attn_backend_init",
            "pp_proxy_tensors",
            "reinit_attn_backend",
            "split_forward_count",
        ),
        _V,
        _END,
        ("draft_step", "logits"),
    ),
)


# The attributes the hooks read on the patched instances (hooks/sglang_patches.py), per class:
# checked from the source of a release outside the tested table (`EngineSupport.check_source`).
# Not listed: `ServerArgs` (its fields come from argument-group classes, and the hook reads them
# with getattr inside a guarded audit that records its own failure).
ATTRS_READ: dict[str, tuple[str, ...]] = {
    f"{_W2}:EAGLEWorkerV2": (
        "server_args",
        "speculative_num_steps",
        "topk",
        "speculative_num_draft_tokens",
        "_draft_worker",
        "_target_worker",
    ),
    f"{_W2}:EagleDraftWorker": ("hot_token_id", "topk", "speculative_num_draft_tokens"),
    "sglang.srt.model_executor.model_runner:ModelRunner": ("is_draft_worker",),
}


SUPPORT = support.EngineSupport(
    label="SGLang",
    distributions=("sglang",),
    min_supported=MIN_SUPPORTED,
    max_supported=MAX_SUPPORTED,
    install_hint=f"sglang=={'.'.join(map(str, MAX_SUPPORTED))}",
    patch_points=PATCH_POINTS,
    plugin_group=PLUGIN_GROUP,
    plugins_env="SGLANG_PLUGINS",
    plugins_since=PLUGIN_ENTRY_POINTS_SINCE,
    empty_env_allows_all=True,  # SGLang: an empty SGLANG_PLUGINS restricts nothing
    package="sglang",
    attrs_read=ATTRS_READ,
)
