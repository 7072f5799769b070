"""The CPU reference engine (an HF target and the reference drafter, `engine`): a third
producer of the trace schema, for tests, demos and "what acceptance should this drafter get".
It follows SGLang's conventions (its static audit is SGLang's shape) and has no hooks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hstrace.engines.sglang import SPEC as SGLANG
from hstrace.engines.spec import EngineSpec


class ReferenceSpec(EngineSpec):
    name = "reference"
    label = "the reference engine"
    adapter = "hstrace.engines.reference.engine:ReferenceEngine"
    judged = False  # not a serving engine: `hstrace check` does not judge drafters for it
    aux_ids_keys = SGLANG.aux_ids_keys

    def installed_version(self) -> str | None:
        from hstrace._version import __version__

        return __version__

    def aux_layer_source(
        self, draft_config: Mapping[str, Any], n_layers: int | None = None
    ) -> dict[str, Any]:
        return SGLANG.aux_layer_source(draft_config, n_layers)

    def aux_ids_fix(self, hf_ids: Sequence[int]) -> str:
        return SGLANG.aux_ids_fix(hf_ids)

    def spec_settings(self, raw: Mapping[str, Any], effective: Mapping[str, Any]) -> dict[str, Any]:
        return SGLANG.spec_settings(raw, effective)

    def spec_facts(self, settings: Mapping[str, Any]) -> list[dict[str, Any]]:
        return SGLANG.spec_facts(settings)  # it reproduces SGLang's adjustment


SPEC = ReferenceSpec()
