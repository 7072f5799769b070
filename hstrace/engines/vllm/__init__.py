"""vLLM: the launcher (`engine`), the versions and patch table (`versions`), the pure row
builders (`taps`), the static audit (`audit`), and `SPEC`, what the rest of hstrace asks about
vLLM. The wrappers that run inside vLLM's processes: `hstrace.hooks.vllm_patches`. Importing
this package never imports vLLM."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from hstrace.engines.spec import EngineSpec
from hstrace.engines.vllm import audit
from hstrace.engines.vllm.versions import SUPPORT


class VLLMSpec(EngineSpec):
    name = "vllm"
    label = "vLLM"
    adapter = "hstrace.engines.vllm.engine:VLLMEngine"
    support = SUPPORT
    taps = "hstrace.engines.vllm.taps"
    patches = "hstrace.hooks.vllm_patches"
    prefix_cache_off = "--no-enable-prefix-caching"
    speculation_flags: ClassVar[tuple[str, ...]] = ("--speculative-config", "--speculative_config")
    # `GPUModelRunner._get_eagle3_aux_layers_from_config`: the top level first
    aux_ids_keys: ClassVar[tuple[str, ...]] = (
        "eagle_aux_hidden_state_layer_ids",
        "eagle_config.eagle_aux_hidden_state_layer_ids",
    )

    def serves(self, argv: Sequence[str]) -> bool:
        return any(w.startswith("vllm.") or w == "vllm" or Path(w).name == "vllm" for w in argv[:4])

    def aux_layer_source(
        self, draft_config: Mapping[str, Any], n_layers: int | None = None
    ) -> dict[str, Any]:
        source = audit.aux_layer_source(draft_config, n_layers)
        top = draft_config.get("eagle_aux_hidden_state_layer_ids")
        return {**source, "read": source["configured"], "top_level_ids": top}

    def aux_ids_fix(self, hf_ids: Sequence[int]) -> str:
        return (
            f"for vLLM write {list(hf_ids)} (HF hidden_states indices, no +1) as top-level "
            '"eagle_aux_hidden_state_layer_ids" (vLLM reads the top level before eagle_config)'
        )

    def spec_settings(self, raw: Mapping[str, Any], effective: Mapping[str, Any]) -> dict[str, Any]:
        # vLLM drafts a chain: only num_speculative_tokens is set, the rest follows from it
        return audit.spec_settings(raw.get("num_steps"), int(effective["num_steps"]))

    def spec_facts(self, settings: Mapping[str, Any]) -> list[dict[str, Any]]:
        # the one "spec-adjusted" wording (SGLang's audit), naming vLLM
        from hstrace.engines.sglang.audit import spec_facts

        return spec_facts(settings, self.label)


SPEC = VLLMSpec()
