"""MTP heads read where they live: inside a target checkpoint, by layout.

    mimo        `model.mtp_layers.{k}.*`               (MiMoForCausalLM; vLLM `mimo_mtp`)
    deepseek    `model.layers.{num_hidden_layers+k}.*` (DeepSeek-V3 / GLM-4.5 NextN;
                                                        `deepseek_mtp`, `glm4_moe_mtp`)
    qwen3_next  `mtp.layers.{k}.*`, `mtp.fc` ...       (Qwen3-Next; `qwen3_next_mtp`)
    standalone  the NextN layer saved on its own (`model.layers.{k}.*`, see `detect_layout`)

Every key under an MTP prefix is mapped to the head parameter it fills (`MTP_KEYS` for the
NextN parts, the block's own names for the decoder block) or to None; the embedding and the
output head come from the target (`model.embed_tokens`, `lm_head`) unless the MTP layer carries
its own (DeepSeek's `embed_tokens` / `shared_head.head` under the layer prefix).
Only the keys the head needs are read (`safe_open`), so a large sharded target costs its MTP
slice, not the whole checkpoint.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hstrace.drafter.checkpoint import read_config
from hstrace.drafter.mtp import MTP_KEYS, MTPConfig, MTPHead
from hstrace.errors import CheckpointError

SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale", "_scale", "scale")
BLOCK_PREFIXES = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")


@dataclass
class MTPLoadReport:
    path: str
    layout: str  # "mimo" | "deepseek" | "qwen3_next"
    n_predict: int  # num_nextn_predict_layers
    layer_prefixes: list[str]  # the checkpoint prefix of MTP layer k
    key_map: dict[str, str | None]  # checkpoint key under an MTP prefix -> head parameter / None
    loaded: list[str]  # head parameters that received a tensor
    missing: list[str]  # head parameters no key filled
    embed_source: str  # the checkpoint key the embedding came from
    head_source: str  # the checkpoint key the output head came from
    scales: list[str]  # quantization-scale keys under the MTP prefixes
    key_dtypes: dict[str, str] = field(default_factory=dict)  # MTP keys: the stored dtype
    # own embedding / head copies under the MTP prefix -> whether they equal the target's
    own_copy_equals_target: dict[str, bool] = field(default_factory=dict)
    quantized: bool = False  # the config declares a quantization_config
    notes: list[str] = field(default_factory=list)
    # biases the checkpoint saved on projections the layout's architecture has without one:
    # the reference head carries them (training computed with them)
    added_biases: list[str] = field(default_factory=list)
    standalone: bool = False  # the MTP layers saved without the target's layers
    shared_from_target: list[str] = field(default_factory=list)  # head params not in this dir
    head_computed: bool = True  # the reference MTPHead computes this head's block

    @property
    def unmapped(self) -> list[str]:
        """Keys under the MTP prefix that fill nothing; RoPE's `inv_freq` is a buffer every
        engine recomputes, not a weight."""
        return [
            k
            for k, v in self.key_map.items()
            if v is None and not k.endswith("rotary_emb.inv_freq")
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "layout": self.layout,
            "n_predict": self.n_predict,
            "layer_prefixes": self.layer_prefixes,
            "key_map": self.key_map,
            "loaded": self.loaded,
            "missing": self.missing,
            "unmapped": self.unmapped,
            "embed_source": self.embed_source,
            "head_source": self.head_source,
            "scales": self.scales,
            "key_dtypes": self.key_dtypes,
            "own_copy_equals_target": self.own_copy_equals_target,
            "quantized": self.quantized,
            "notes": self.notes,
            "added_biases": self.added_biases,
            "standalone": self.standalone,
            "shared_from_target": self.shared_from_target,
            "head_computed": self.head_computed,
        }


def weight_index(ckpt_dir: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file holding it (single file or sharded index)."""
    from safetensors import SafetensorError, safe_open

    index = ckpt_dir / "model.safetensors.index.json"
    try:
        if index.is_file():
            wm = json.loads(index.read_text()).get("weight_map", {})
            return {k: ckpt_dir / f for k, f in wm.items()}
        single = ckpt_dir / "model.safetensors"
        if not single.is_file():
            raise CheckpointError(
                f"{ckpt_dir}: no model.safetensors or model.safetensors.index.json"
            )
        with safe_open(str(single), "pt") as st:
            return dict.fromkeys(st.keys(), single)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{ckpt_dir}: cannot list checkpoint keys ({exc})") from None


def read_dtypes(where: dict[str, Path], keys: list[str]) -> dict[str, str]:
    """The stored dtype of each key (safetensors names: BF16, F8_E4M3, ...), no data read."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, str] = {}
    by_file: dict[Path, list[str]] = {}
    for k in keys:
        by_file.setdefault(where[k], []).append(k)
    for f, ks in by_file.items():
        try:
            with safe_open(str(f), "pt") as st:
                for k in ks:
                    out[k] = st.get_slice(k).get_dtype()
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{f}: cannot read tensor headers ({exc})") from None
    return out


def read_keys(where: dict[str, Path], keys: list[str]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for k in keys:
        by_file.setdefault(where[k], []).append(k)
    for f, ks in by_file.items():
        try:
            with safe_open(str(f), "pt") as st:
                for k in ks:
                    out[k] = st.get_tensor(k)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{f}: cannot read tensors ({exc})") from None
    return out


# Qwen3-Next keeps its NextN parts beside the layers, shared by them: `mtp.{name}` -> role
QWEN3_NEXT_KEYS = {
    "fc.weight": "eh_proj.weight",
    "pre_fc_norm_embedding.weight": "enorm.weight",
    "pre_fc_norm_hidden.weight": "hnorm.weight",
    "norm.weight": "final_norm.weight",
}
# block keys that are not the dense GQA + SwiGLU block: MLA attention, MoE experts and router,
# per-head q/k norms. The reference computes DeepSeek-V3's MLA / MoE block when config.json
# says so (`block_not_computed`); GLM-4.5's and Qwen3-Next's q/k norms it has no place for
_NOT_DENSE = re.compile(
    r"(kv_a_proj_with_mqa|kv_b_proj|q_a_proj|q_b_proj|\.experts\.|mlp\.gate\.|shared_expert|"
    r"q_norm|k_norm)"
)

_QK_NORM = re.compile(r"(q_norm|k_norm|shared_expert_gate)")  # GLM-4.5 / Qwen3-Next, not DeepSeek


@dataclass(frozen=True)
class Layout:
    name: str  # "mimo" | "deepseek" | "qwen3_next"
    prefixes: list[str]  # the checkpoint prefix of MTP layer k
    standalone: bool = False  # the MTP layers saved on their own, without the target's layers
    note: str = ""


def detect_layout(raw: dict[str, Any], keys: list[str]) -> Layout:
    """The layout and the prefix of each MTP layer, from the config and the key names:

    mimo        `model.mtp_layers.{k}.*`                      MiMoForCausalLM
    deepseek    `model.layers.{num_hidden_layers + k}.*`      DeepSeek-V3 / GLM-4.5 NextN
    qwen3_next  `mtp.layers.{k}.*` + `mtp.{fc,pre_fc_norm_*,norm}`
    standalone  `model.layers.{k}.*` with no layer N + k: the NextN layer exported on its own
                (SGLang's `scripts/export_deepseek_nextn.py` renames it to `model.layers.0`,
                sets num_hidden_layers 1 and leaves out `embed_tokens` / `shared_head.head`)
    """
    n = int(raw.get("num_nextn_predict_layers") or 0)
    arch = str((raw.get("architectures") or [""])[0])
    if any(k.startswith("model.mtp_layers.") for k in keys) or arch == "MiMoForCausalLM":
        found = sorted(
            {int(m.group(1)) for k in keys if (m := re.match(r"model\.mtp_layers\.(\d+)\.", k))}
        )
        count = n or len(found)
        return Layout("mimo", [f"model.mtp_layers.{k}." for k in range(count)])
    if any(k.startswith("mtp.") for k in keys) or str(raw.get("model_type", "")).startswith(
        "qwen3_next"
    ):
        return Layout("qwen3_next", [f"mtp.layers.{k}." for k in range(n or 1)])
    if n and "num_hidden_layers" in raw:
        base = int(raw["num_hidden_layers"])
        inside = [f"model.layers.{base + k}." for k in range(n)]
        if any(key.startswith(tuple(inside)) for key in keys):
            return Layout("deepseek", inside)
        alone = [f"model.layers.{k}." for k in range(n)]
        if any(key.startswith(p + "eh_proj.") for p in alone for key in keys):
            return Layout(
                "deepseek",
                alone,
                standalone=True,
                note=f"standalone NextN checkpoint: the MTP layer is saved as {alone[0]}* "
                f"(num_hidden_layers {base}), not as {inside[0]}*; its embedding and head are "
                "the target's",
            )
        return Layout("deepseek", inside)
    raise CheckpointError(
        "no MTP head in this checkpoint: no model.mtp_layers.* / mtp.* keys and no "
        "num_nextn_predict_layers"
    )


def is_scale(key: str) -> bool:
    last = key.rsplit(".", 1)[-1]
    return any(last.endswith(s) for s in SCALE_SUFFIXES) and last != "weight"


def nextn_keys(layout: str) -> dict[str, str]:
    return QWEN3_NEXT_KEYS if layout == "qwen3_next" else MTP_KEYS[layout]


def map_layer_key(layout: str, rel: str, k: int) -> str | None:
    """The head parameter a key (relative to MTP layer k's prefix) fills, or None."""
    nextn = nextn_keys(layout)
    if rel in nextn and layout != "qwen3_next":
        return f"layers.{k}.{nextn[rel]}"
    stem = rel.removesuffix(".bias")
    if stem != rel and f"{stem}.weight" in nextn:  # e.g. `input_proj.bias` -> eh_proj.bias
        return f"layers.{k}.{nextn[stem + '.weight'].removesuffix('.weight')}.bias"
    if rel.startswith(BLOCK_PREFIXES) and not is_scale(rel):
        return f"layers.{k}.{rel}"
    if layout == "deepseek" and rel == "embed_tokens.weight":
        return "embed_tokens.weight"
    if layout == "deepseek" and rel == "shared_head.head.weight":
        return "lm_head.weight"
    return None


def map_keys(layout: Layout, keys: list[str]) -> dict[str, str | None]:
    """Every key under an MTP prefix (and Qwen3-Next's shared `mtp.*` parts) -> the head
    parameter it fills, or None."""
    key_map: dict[str, str | None] = {}
    for k, prefix in enumerate(layout.prefixes):
        for key in keys:
            if key.startswith(prefix):
                key_map[key] = map_layer_key(layout.name, key[len(prefix) :], k)
    if layout.name == "qwen3_next":  # one fc / norm pair / final norm, used by layer 0 here
        for key in keys:
            rel = key.removeprefix("mtp.")
            if key.startswith("mtp.") and not key.startswith("mtp.layers."):
                name = QWEN3_NEXT_KEYS.get(rel)
                if name is None and rel.endswith(".bias"):
                    name = map_layer_key("qwen3_next", rel, 0)
                key_map[key] = f"layers.0.{name}" if name and "layers." not in name else name
    return key_map


def block_not_computed(layout: Layout, raw: dict[str, Any], key_map: dict[str, Any]) -> str:
    """Why the reference `MTPHead` cannot compute this head's block, or ""."""
    if layout.name == "qwen3_next":
        return (
            "Qwen3-Next's MTP block (gated attention with q/k norms, (1 + w) RMSNorms, MoE) is "
            "not the reference's dense block"
        )
    odd = sorted(k for k in key_map if _NOT_DENSE.search(k))
    if layout.name == "deepseek" and not any(_QK_NORM.search(k) for k in odd):
        # DeepSeek-V3's own block: the reference has MLA and grouped-top-k MoE
        # (`MTPConfig.deepseek`), unscaled RoPE only; the config decides which block it is
        try:
            cfg = mtp_config(raw, "deepseek", len(layout.prefixes))
        except (ValueError, KeyError, TypeError) as exc:
            return f"the DeepSeek block is not in the reference: {exc}"
        for part, in_config, marker in (
            ("MLA attention", cfg.mla is not None, "kv_a_proj_with_mqa"),
            ("an MoE block", cfg.moe is not None, ".experts."),
        ):
            if in_config != any(marker in k for k in key_map):
                said = "says" if in_config else "does not say"
                return f"config.json {said} {part}, the layer's keys disagree"
        odd = []
    if odd:
        return f"the block is not dense GQA + SwiGLU ({odd[0]}, ...: MLA / MoE / q-k norms)"
    if float(raw.get("partial_rotary_factor") or 1.0) != 1.0:
        return "partial rotary (partial_rotary_factor) is not in the reference block"
    return ""


def grow_saved_biases(
    head: MTPHead, key_map: dict[str, str | None], where: dict[str, Path]
) -> list[str]:
    """Give each bias-free `nn.Linear` of the head the bias its checkpoint saved (key
    `<proj>.bias` next to a mapped `<proj>.weight`); returns the head parameters added."""
    from safetensors import safe_open

    added: list[str] = []
    for key, name in key_map.items():
        if name is None or not name.endswith(".bias"):
            continue
        try:
            module = head.get_submodule(name.removesuffix(".bias"))
        except AttributeError:
            continue
        if not isinstance(module, nn.Linear) or module.bias is not None:
            continue
        with safe_open(str(where[key]), "pt") as st:
            shape = st.get_slice(key).get_shape()
        if list(shape) != [module.out_features]:
            continue  # not this projection's bias: left unmapped
        module.bias = nn.Parameter(torch.zeros(module.out_features, dtype=module.weight.dtype))
        added.append(name)
    return sorted(added)


def mtp_config(raw: dict[str, Any], layout: str, n_predict: int) -> MTPConfig:
    hf = dict(raw, num_nextn_predict_layers=n_predict)
    return MTPConfig.mimo(hf) if layout == "mimo" else MTPConfig.deepseek(hf)


def read_mtp_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[MTPHead | None, MTPLoadReport]:
    """The MTP head of a checkpoint directory, as the reference `MTPHead` (None where the
    reference does not compute its block: the report then maps names only), with the report
    of which key fills which parameter."""
    ckpt_dir = Path(path)
    if ckpt_dir.is_file():
        ckpt_dir = ckpt_dir.parent
    raw = read_config(ckpt_dir)
    where = weight_index(ckpt_dir)
    keys = sorted(where)
    layout = detect_layout(raw, keys)
    prefixes = layout.prefixes
    key_map = map_keys(layout, keys)
    notes = [layout.note] if layout.note else []
    why_not = block_not_computed(layout, raw, key_map)
    own_embed = [k for k, v in key_map.items() if v == "embed_tokens.weight"]
    own_head = [k for k, v in key_map.items() if v == "lm_head.weight"]
    shared_from_target: list[str] = []
    embed_source = own_embed[0] if own_embed else "model.embed_tokens.weight"
    head_source = own_head[0] if own_head else "lm_head.weight"
    if head_source not in where and raw.get("tie_word_embeddings"):
        head_source = "model.embed_tokens.weight"
    if layout.standalone:  # not in this checkpoint: the target's, shared when served
        shared_from_target = [
            name
            for name, src in (
                ("embed_tokens.weight", embed_source),
                ("lm_head.weight", head_source),
            )
            if src not in where
        ]
    common = {
        "path": str(ckpt_dir),
        "layout": layout.name,
        "n_predict": len(prefixes),
        "layer_prefixes": prefixes,
        "embed_source": embed_source,
        "head_source": head_source,
        "scales": sorted(k for k in key_map if is_scale(k)),
        "key_dtypes": read_dtypes(where, sorted(key_map)),
        "quantized": bool(raw.get("quantization_config")),
        "standalone": layout.standalone,
        "shared_from_target": shared_from_target,
    }
    if why_not:
        notes.append(f"reference head not built: {why_not}; keys are mapped by name only")
        mapped = sorted({v for v in key_map.values() if v is not None})
        own_equal = _own_equal(where, own_embed, own_head)
        report = MTPLoadReport(
            key_map=key_map,
            loaded=mapped,
            missing=[],
            own_copy_equals_target=own_equal,
            notes=notes,
            head_computed=False,
            **common,
        )
        return None, report

    try:
        cfg = mtp_config(raw, layout.name, len(prefixes))
        head = MTPHead(cfg).to(dtype)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{ckpt_dir}: {exc}") from None
    # a bias training saved on a projection the served architecture has without one (an
    # `nn.Linear(2H, H)` left at bias=True): the reference computes what training computed
    added_biases = grow_saved_biases(head, key_map, where)
    params = dict(head.named_parameters())
    key_map = {key: (name if name in params else None) for key, name in key_map.items()}
    fills = {key: name for key, name in key_map.items() if name is not None}
    fills.setdefault(embed_source, "embed_tokens.weight")
    fills.setdefault(head_source, "lm_head.weight")
    present = [key for key in fills if key in where]
    tensors = read_keys(where, present)
    loaded: list[str] = []
    with torch.no_grad():
        for key in present:
            name, t = fills[key], tensors[key]
            if name in loaded:
                continue
            if tuple(t.shape) != tuple(params[name].shape):
                raise CheckpointError(
                    f"{ckpt_dir}: {key} has shape {list(t.shape)}, the MTP head's {name} is "
                    f"{list(params[name].shape)}"
                )
            params[name].copy_(t.to(dtype))
            loaded.append(name)
    report = MTPLoadReport(
        key_map=key_map,
        loaded=sorted(loaded),
        missing=sorted(set(params) - set(loaded) - set(shared_from_target)),
        own_copy_equals_target=_own_equal(where, own_embed, own_head),
        notes=notes,
        added_biases=added_biases,
        **common,
    )
    return head.eval(), report


def _own_equal(where: dict[str, Path], own_embed: list[str], own_head: list[str]) -> dict:
    """An MTP layer's own embedding / head copy -> whether it equals the target's."""
    out: dict[str, bool] = {}
    for own, shared in ((own_embed, "model.embed_tokens.weight"), (own_head, "lm_head.weight")):
        if own and shared in where:
            t = read_keys(where, [own[0], shared])
            a, b = t[own[0]], t[shared]
            out[own[0]] = a.shape == b.shape and torch.equal(a, b)
    return out


def load_mtp_head(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[MTPHead, MTPLoadReport]:
    """The reference `MTPHead` of a checkpoint; a head whose block the reference does not
    compute is refused in one line (`hstrace check` still maps its keys)."""
    head, report = read_mtp_checkpoint(path, dtype)
    if head is None:
        raise CheckpointError(f"{report.path}: {report.notes[-1]}")
    return head, report
