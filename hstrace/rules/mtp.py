"""The static rules on an MTP head inside a target checkpoint (`hstrace check TARGET_DIR`):
what the MTP load report (`hstrace.drafter.mtp_checkpoint`) and vLLM's loader reading of every
key (`hstrace.engines.vllm.mtp_load`: mimo_mtp, deepseek_mtp, glm4_moe_mtp, qwen3_next_mtp)
reveal before anything is served.
One table, `MTP_RULES`, in the style of `hstrace.rules.checkpoint`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hstrace.drafter.checkpoint import read_config
from hstrace.drafter.mtp_checkpoint import MTPLoadReport, is_scale
from hstrace.engines.vllm.mtp_load import LOAD_ERROR, KeyFate, vllm_mtp_load
from hstrace.rules.table import Rule, RuleRun, run_rules

# a key that names an MTP / NextN part, wherever it was saved
_MTP_NAME = re.compile(r"(^|\.)(mtp|nextn|mtp_layers|eh_proj|enorm|hnorm|shared_head)(\.|_|$)")
# linear weights an FP8 / block-quantized checkpoint pairs with a scale tensor
_LINEAR = re.compile(r"(proj|input_proj|eh_proj|experts\.\d+\.\w+)\.weight$")
_FP8 = ("F8_E4M3", "F8_E5M2", "F8_E4M3FN")


@dataclass
class MTPFacts:
    rep: MTPLoadReport
    keys: list[str]  # every key of the checkpoint
    raw: dict[str, Any] | None = None  # config.json (read from rep.path when not given)
    model_type: str | None = field(init=False)  # the vLLM MTP model type serving this head
    vllm: dict[str, KeyFate] = field(init=False)  # MTP-looking keys -> vLLM's fate
    vllm_unfilled: list[str] = field(init=False)

    def __post_init__(self) -> None:
        raw = self.raw if self.raw is not None else read_config(Path(self.rep.path))
        load = vllm_mtp_load(raw)
        self.model_type = load.model_type if load else None
        if load is None:  # a layout vLLM 0.32 serves with no loader hstrace models
            self.vllm, self.vllm_unfilled = {}, []
            return
        prefixes = tuple(self.rep.layer_prefixes) + tuple(load.layer_prefixes())
        scope = [
            k
            for k in self.keys
            if k.startswith(prefixes)
            or _MTP_NAME.search(k)
            or k in ("model.embed_tokens.weight", "lm_head.weight")
        ]
        self.vllm = {k: load.fate(k) for k in scope}
        self.vllm_unfilled = load.unfilled(self.keys)

    def stops(self) -> list[str]:
        """Keys vLLM has no parameter for, and parameters no key fills: vLLM refuses to start."""
        return sorted(
            {k for k, fate in self.vllm.items() if fate.fate == LOAD_ERROR}
            | set(self.vllm_unfilled)
        )


def _silent(f: MTPFacts) -> list[str]:
    """MTP tensors vLLM serves without, saying nothing (moot when the load stops)."""
    if f.stops():
        return []
    return [k for k, fate in f.vllm.items() if fate.lost]


def _missing_scales(f: MTPFacts) -> list[str]:
    """FP8 MTP linear weights with no scale tensor next to them."""
    have = set(f.rep.key_map)
    out = []
    for k, dt in f.rep.key_dtypes.items():
        if dt in _FP8 and _LINEAR.search(k):
            stem = k.removesuffix(".weight")
            if not any(f"{stem}.{s}" in have for s in ("weight_scale_inv", "weight_scale")):
                out.append(k)
    return out


_FIX_NAMES = {
    "mimo_mtp": "`model.mtp_layers.{k}.` with the MiMo names (`token_layernorm`, "
    "`hidden_layernorm`, `input_proj`, `final_layernorm` and the block's Qwen2 names)",
    "deepseek_mtp": "`model.layers.{num_hidden_layers + k}.` (`enorm`, `hnorm`, `eh_proj`, "
    "`shared_head.norm`, `shared_head.head` and the block's DeepSeek-V3 MLA / MoE names)",
    "glm4_moe_mtp": "`model.layers.{num_hidden_layers + k}.` (`enorm`, `hnorm`, `eh_proj`, "
    "`shared_head.norm` and the block's GLM-4.5 names)",
    "qwen3_next_mtp": "`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, "
    "`mtp.norm` and `mtp.layers.{k}.` with the Qwen3-Next block's names",
}


def _where(f: MTPFacts) -> str:
    return _FIX_NAMES.get(f.model_type or "", "the layout vLLM's loader reads")


MTP_RULES: list[Rule[MTPFacts]] = [
    Rule(
        "mtp-keys-skipped-by-vllm",
        "weights-dropped",
        when=_silent,
        summary=lambda f, m: (
            f"{len(m)} MTP tensor(s) that vLLM's {f.model_type} loader skips without a word; "
            "the head serves without them"
        ),
        evidence=lambda f, m: {
            "skipped_keys": m[:20],
            "why": {k: f.vllm[k].fate for k in m[:20]},
            "vllm_model_type": f.model_type,
        },
        fix=lambda f, m: (
            f"Save the MTP layer under {_where(f)}, with no parameter vLLM's "
            "module lacks (a bias training saved: train without it, or fold it where the served "
            "architecture has one); a skipped quantization scale: declare the quantization in "
            "config.json."
        ),
    ),
    Rule(
        "mtp-vllm-cannot-load",
        "weights-dropped",
        when=lambda f: f.stops(),
        summary=lambda f, m: (
            f"vLLM's {f.model_type} loader stops on this checkpoint: {len(m)} key(s) it has no "
            "parameter for or parameters no key fills"
        ),
        evidence=lambda f, m: {
            "unknown_keys": [k for k in m if k in f.vllm][:20],
            "parameters_not_filled": [k for k in m if k in f.vllm_unfilled][:20],
            "skipped_keys": [k for k, fate in f.vllm.items() if fate.lost][:20],
            "why": {k: fate.fate for k, fate in f.vllm.items() if fate.lost or k in m[:20]},
            "vllm_model_type": f.model_type,
        },
        fix=lambda f, m: f"Rename the keys to {_where(f)}.",
    ),
    Rule(
        "mtp-parameters-not-loaded",
        "weights-dropped",
        when=lambda f: f.rep.missing,
        summary=lambda f, m: (
            f"{len(m)} MTP head parameter(s) received no tensor from the checkpoint"
        ),
        evidence=lambda f, m: {"parameters_not_loaded": m[:20], "layout": f.rep.layout},
        fix="Export the MTP layer again; every NextN parameter (enorm, hnorm, eh_proj, the "
        "block, the final norm) must be saved under the layer's prefix.",
    ),
    Rule(
        "mtp-unmapped-keys",
        "weights-dropped",
        when=lambda f: [k for k in f.rep.unmapped if not is_scale(k)],
        summary=lambda f, m: f"{len(m)} tensor(s) under the MTP prefix map to no head parameter",
        evidence=lambda f, m: {"unmapped_keys": m[:20], "layer_prefixes": f.rep.layer_prefixes},
        fix="Rename the keys to the layout's NextN names (see `hstrace check --json` key_map).",
    ),
    Rule(
        "mtp-scales-missing",
        "weights-dropped",
        when=_missing_scales,
        summary=lambda f, m: (
            f"{len(m)} FP8 MTP weight(s) saved without their scale tensor: the engine "
            "multiplies by a default or uninitialised scale"
        ),
        evidence=lambda f, m: {
            "weights_without_scale": m[:20],
            "scales_present": f.rep.scales[:20],
        },
        fix="Export the MTP layer with its `weight_scale_inv` / `weight_scale` tensors (or in "
        "bf16), and list it in the quantization config the way the target's layers are.",
    ),
    Rule(
        "mtp-own-embed-head",
        "embed-head-source",
        when=lambda f: [k for k, same in f.rep.own_copy_equals_target.items() if not same],
        summary="the MTP layer carries its own embedding / head that differ from the target's; "
        "vLLM's MTP proposer always shares the target's",
        evidence=lambda f, m: {
            "own_copies": m,
            "embed_source": f.rep.embed_source,
            "head_source": f.rep.head_source,
        },
        fix="Train the MTP head with the target's embedding and head frozen and shared, or "
        "serve with an engine that loads the MTP layer's own copies.",
    ),
]


def run_mtp_rules(rep: MTPLoadReport, keys: list[str]) -> RuleRun:
    return run_rules(MTP_RULES, MTPFacts(rep, keys))
