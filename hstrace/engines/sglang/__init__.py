"""SGLang: the launcher (`engine`), the versions and patch table (`versions`), the pure row
builders (`taps`), the static audit (`audit`), and `SPEC`, what the rest of hstrace asks about
SGLang. The wrappers that run inside SGLang's processes: `hstrace.hooks.sglang_patches`.
Importing this package never imports SGLang."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from hstrace.engines.sglang import audit
from hstrace.engines.sglang.versions import SUPPORT
from hstrace.engines.spec import EngineSpec


class SGLangSpec(EngineSpec):
    name = "sglang"
    label = "SGLang"
    adapter = "hstrace.engines.sglang.engine:SGLangEngine"
    support = SUPPORT
    taps = "hstrace.engines.sglang.taps"
    patches = "hstrace.hooks.sglang_patches"
    prefix_cache_off = "--disable-radix-cache"
    # --speculative-algorithm, --speculative-draft-model-path, --speculative-num-steps, ...
    speculation_flags: ClassVar[tuple[str, ...]] = ("--speculative-", "--speculative_")
    prefix_cache_off_note: ClassVar[str] = " (and without --enable-hierarchical-cache)"
    # the target reads only the nested key; a top-level one is ignored (`audit.aux_layer_source`)
    aux_ids_keys: ClassVar[tuple[str, ...]] = ("eagle_config.eagle_aux_hidden_state_layer_ids",)

    def serves(self, argv: Sequence[str]) -> bool:
        return any(w.startswith("sglang.") or Path(w).name == "sglang" for w in argv[:4])

    def cannot_load(self, dialect: str, config: Mapping[str, Any]) -> str | None:
        if dialect != "speculators":
            return None
        arch = (config.get("architectures") or ["?"])[0]
        return (
            f"{self.label} {self.default_version} cannot load a speculators-format drafter as it "
            f"is (architecture {arch}, layers in transformer_layer_config, aux ids at the top "
            "level): convert it to SGLang's EAGLE-3 layout (LlamaForCausalLMEagle3, ids under "
            "eagle_config) before serving it with SGLang"
        )

    def aux_layer_source(
        self, draft_config: Mapping[str, Any], n_layers: int | None = None
    ) -> dict[str, Any]:
        source = audit.aux_layer_source(draft_config)
        return {**source, "read": source["read_by_sglang"]}

    def aux_ids_fix(self, hf_ids: Sequence[int]) -> str:
        # SGLang's explicit ids are "output of layer k" = HF hidden_states k+1
        ids = [int(h) - 1 for h in hf_ids]
        return (
            f'"eagle_config": {{"eagle_aux_hidden_state_layer_ids": {ids}}} for SGLang (it adds +1)'
        )

    def spec_settings(self, raw: Mapping[str, Any], effective: Mapping[str, Any]) -> dict[str, Any]:
        return audit.spec_settings(raw, effective)

    def spec_facts(self, settings: Mapping[str, Any]) -> list[dict[str, Any]]:
        return audit.spec_facts(settings)


SPEC = SGLangSpec()
