"""Which SGLang releases hstrace can hook, and where: the patch-point table, chosen by version.

Pure data + lookups; importing this never imports SGLang. Signatures per release come from
the released wheels (shared/reference/sglang-internals.md §3.3, §6); the CPU test suite checks
the 0.5.23 rows against the real package with `inspect.signature`.
"""

from __future__ import annotations

import re

from hstrace.engines import hooks_common
from hstrace.errors import EngineError

MIN_SUPPORTED = (0, 5, 13)  # v1 eagle_worker.py removed; EAGLEWorkerV2 always runs
MAX_SUPPORTED = (0, 5, 23)
PLUGIN_ENTRY_POINTS_SINCE = (0, 5, 11)  # sglang.srt.plugins entry-point group
PLUGIN_GROUP = "sglang.srt.plugins"

Version = tuple[int, int, int]


def parse_version(text: str) -> Version:
    match = re.match(r"^\s*(\d+)\.(\d+)\.(\d+)", text)
    if not match:
        raise EngineError(f"cannot read SGLang version {text!r}")
    return int(match[1]), int(match[2]), int(match[3])


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


def check_supported_version(version_text: str) -> Version:
    """The parsed version, or an `EngineError` naming the supported range."""
    version = parse_version(version_text)
    if not (MIN_SUPPORTED <= version <= MAX_SUPPORTED):
        lo = ".".join(map(str, MIN_SUPPORTED))
        hi = ".".join(map(str, MAX_SUPPORTED))
        raise EngineError(
            f"SGLang {version_text} is not supported by this hstrace (patch tables cover {lo}-{hi}); "
            f"install sglang=={hi} or an hstrace release that knows {version_text}"
        )
    return version


def patch_points_for(version: Version) -> tuple[PatchPoint, ...]:
    chosen = tuple(p for p in PATCH_POINTS if p.applies_to(version))
    targets = [p.target for p in chosen]
    duplicated = {t for t in targets if targets.count(t) > 1}
    if duplicated:  # a table bug, not bad input
        raise AssertionError(f"patch table has overlapping rows for {sorted(duplicated)}")
    return chosen


def has_plugin_entry_points(version: Version) -> bool:
    return version >= PLUGIN_ENTRY_POINTS_SINCE
