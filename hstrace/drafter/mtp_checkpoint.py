"""MTP heads read where they live: inside a target checkpoint, by layout.

    mimo       `model.mtp_layers.{k}.*`              (MiMoForCausalLM; vLLM `mimo_mtp`)
    deepseek   `model.layers.{num_hidden_layers+k}.*` (DeepSeek-V3 / GLM NextN; `deepseek_mtp`)

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
    layout: str  # "mimo" | "deepseek"
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

    @property
    def unmapped(self) -> list[str]:
        return [k for k, v in self.key_map.items() if v is None]

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


def detect_layout(raw: dict[str, Any], keys: list[str]) -> tuple[str, list[str]]:
    """(layout, the prefix of each MTP layer) from the config and the key names."""
    n = int(raw.get("num_nextn_predict_layers") or 0)
    arch = (raw.get("architectures") or [""])[0]
    if any(k.startswith("model.mtp_layers.") for k in keys) or arch == "MiMoForCausalLM":
        found = sorted(
            {int(m.group(1)) for k in keys if (m := re.match(r"model\.mtp_layers\.(\d+)\.", k))}
        )
        count = n or len(found)
        return "mimo", [f"model.mtp_layers.{k}." for k in range(count)]
    if n and "num_hidden_layers" in raw:
        base = int(raw["num_hidden_layers"])
        return "deepseek", [f"model.layers.{base + k}." for k in range(n)]
    raise CheckpointError(
        "no MTP head in this checkpoint: no model.mtp_layers.* keys and no num_nextn_predict_layers"
    )


def is_scale(key: str) -> bool:
    last = key.rsplit(".", 1)[-1]
    return any(last.endswith(s) for s in SCALE_SUFFIXES) and last != "weight"


def map_layer_key(layout: str, rel: str, k: int) -> str | None:
    """The head parameter a key (relative to MTP layer k's prefix) fills, or None."""
    nextn = MTP_KEYS[layout]
    if rel in nextn:
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
        module = head.get_submodule(name.removesuffix(".bias"))
        if not isinstance(module, nn.Linear) or module.bias is not None:
            continue
        with safe_open(str(where[key]), "pt") as st:
            shape = st.get_slice(key).get_shape()
        if list(shape) != [module.out_features]:
            continue  # not this projection's bias: left unmapped, shape named by the check
        module.bias = nn.Parameter(torch.zeros(module.out_features, dtype=module.weight.dtype))
        added.append(name)
    return sorted(added)


def mtp_config(raw: dict[str, Any], layout: str, n_predict: int) -> MTPConfig:
    hf = dict(raw, num_nextn_predict_layers=n_predict)
    return MTPConfig.mimo(hf) if layout == "mimo" else MTPConfig.deepseek(hf)


def load_mtp_head(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[MTPHead, MTPLoadReport]:
    """The MTP head of a target checkpoint directory, as the reference `MTPHead`, with the
    report of which key filled which parameter."""
    ckpt_dir = Path(path)
    if ckpt_dir.is_file():
        ckpt_dir = ckpt_dir.parent
    raw = read_config(ckpt_dir)
    where = weight_index(ckpt_dir)
    keys = sorted(where)
    layout, prefixes = detect_layout(raw, keys)
    cfg = mtp_config(raw, layout, len(prefixes))
    head = MTPHead(cfg).to(dtype)
    params = dict(head.named_parameters())

    key_map: dict[str, str | None] = {}
    for k, prefix in enumerate(prefixes):
        for key in keys:
            if key.startswith(prefix):
                key_map[key] = map_layer_key(layout, key[len(prefix) :], k)
    # a bias training saved on a projection the served architecture has without one (an
    # `nn.Linear(2H, H)` left at bias=True): the reference computes what training computed
    added_biases = grow_saved_biases(head, key_map, where)
    params = dict(head.named_parameters())
    key_map = {key: (name if name in params else None) for key, name in key_map.items()}
    own_embed = [k for k, v in key_map.items() if v == "embed_tokens.weight"]
    own_head = [k for k, v in key_map.items() if v == "lm_head.weight"]
    embed_source = own_embed[0] if own_embed else "model.embed_tokens.weight"
    head_source = own_head[0] if own_head else "lm_head.weight"
    if head_source not in where and raw.get("tie_word_embeddings"):
        head_source = "model.embed_tokens.weight"
    fills = {key: name for key, name in key_map.items() if name is not None}
    fills.setdefault(embed_source, "embed_tokens.weight")
    fills.setdefault(head_source, "lm_head.weight")
    present = [key for key in fills if key in where]
    tensors = read_keys(where, present)
    loaded: list[str] = []
    notes: list[str] = []
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
    own_equal: dict[str, bool] = {}
    for own, shared in ((own_embed, "model.embed_tokens.weight"), (own_head, "lm_head.weight")):
        if own and shared in where:
            a, b = tensors.get(own[0]), read_keys(where, [shared])[shared]
            own_equal[own[0]] = a is not None and a.shape == b.shape and torch.equal(a, b)
    report = MTPLoadReport(
        path=str(ckpt_dir),
        layout=layout,
        n_predict=len(prefixes),
        layer_prefixes=prefixes,
        key_map=key_map,
        loaded=sorted(loaded),
        missing=sorted(set(params) - set(loaded)),
        embed_source=embed_source,
        head_source=head_source,
        scales=sorted(k for k in key_map if is_scale(k)),
        key_dtypes=read_dtypes(where, sorted(key_map)),
        own_copy_equals_target=own_equal,
        quantized=bool(raw.get("quantization_config")),
        notes=notes,
        added_biases=added_biases,
    )
    return head.eval(), report
