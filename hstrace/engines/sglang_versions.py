"""Which SGLang releases hstrace can hook, and where: the patch-point table, chosen by version.

Pure data + lookups; importing this never imports SGLang. Signatures per release come from
the released wheels (shared/reference/sglang-internals.md §3.3, §6); the CPU test suite checks
the 0.5.23 rows against the real package with `inspect.signature`.
"""

from __future__ import annotations

from hstrace.engines import hooks_common

MIN_SUPPORTED = (0, 5, 13)  # v1 eagle_worker.py removed; EAGLEWorkerV2 always runs
MAX_SUPPORTED = (0, 5, 23)
PLUGIN_ENTRY_POINTS_SINCE = (0, 5, 11)  # sglang.srt.plugins entry-point group
PLUGIN_GROUP = "sglang.srt.plugins"

Version = hooks_common.Version
# The patch-point row type is shared with vLLM's table (hstrace.engines.hooks_common).
PatchPoint = hooks_common.PatchPoint


_W2 = "sglang.srt.speculative.eagle_worker_v2"
_V = MIN_SUPPORTED
_END = MAX_SUPPORTED

PATCH_POINTS: tuple[PatchPoint, ...] = (
    # static audit
    PatchPoint(
        "sglang.srt.models.llama_eagle3:LlamaForCausalLMEagle3.load_weights",
        ("self", "weights"),
        _V,
        _END,
        ("static.weights", "static.draft_config", "static.hot_token_id"),
    ),
    PatchPoint(
        "sglang.srt.models.llama:LlamaForCausalLM.set_eagle3_layers_to_capture",
        ("self", "layer_ids"),
        _V,
        _END,
        ("static.layers_to_capture",),
    ),
    PatchPoint(
        f"{_W2}:EAGLEWorkerV2.__init__",
        ("self", "server_args", "gpu_id", "nccl_port", "target_worker"),
        _V,
        _END,
        ("static.spec",),
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


SUPPORT = hooks_common.EngineSupport(
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
)
parse_version = SUPPORT.parse_version
check_supported_version = SUPPORT.check_supported_version
patch_points_for = SUPPORT.patch_points_for
installed_version = SUPPORT.installed_version


def has_plugin_entry_points(version: Version) -> bool:
    return version >= PLUGIN_ENTRY_POINTS_SINCE
