"""What vLLM's `mimo_mtp` loader does with each checkpoint key (read from vLLM 0.32.0 and
0.33.0, identical there: `model_executor/models/mimo_mtp.py: MiMoMTP.load_weights`,
`models/utils.py: AutoWeightsLoader`, `model_loader/default_loader.py`):

1. `mtp_weights()` keeps only names containing `mtp_layers`, `embed_tokens` or `lm_head`;
   every other key is dropped without a word (the target's keys, but also an MTP layer saved
   under another name, e.g. `model.mtp.0.*`).
2. `hf_to_vllm_mapper` moves the block keys under `mtp_block.` and stacks q/k/v and gate/up;
   `model.mtp_layers.{i}.` for i < num_nextn_predict_layers is the only layer prefix mapped.
3. `AutoWeightsLoader` ignores unexpected keys ending in `.bias` (added for GPTQ checkpoints):
   an `input_proj.bias` or `o_proj.bias` the module has no place for is dropped silently;
   any other unknown key stops the load ("There is no module or parameter named ...").
4. For an unquantized model the loader then refuses to start when a parameter received no
   tensor ("Following weights were not initialized from checkpoint").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# the checkpoint keys (relative to `model.mtp_layers.{i}.`) that fill a parameter of vLLM's
# MiMoMultiTokenPredictorLayer (Qwen2 block: q/k/v biases, none on o_proj)
MIMO_LAYER_KEYS = frozenset(
    {
        "token_layernorm.weight",
        "hidden_layernorm.weight",
        "input_proj.weight",
        "final_layernorm.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    }
)
MIMO_FILTER = ("mtp_layers", "embed_tokens", "lm_head")
SHARED = ("model.embed_tokens.weight", "lm_head.weight")

LOADED = "loaded"
FILTERED = "skipped silently: the name has none of mtp_layers / embed_tokens / lm_head"
BIAS_IGNORED = "skipped silently: an unexpected .bias (AutoWeightsLoader ignores them)"
LOAD_ERROR = "load error: vLLM has no parameter for it and stops"


@dataclass(frozen=True)
class KeyFate:
    key: str
    fate: str  # one of the constants above
    silent: bool  # dropped without an error or warning


def mimo_mtp_fate(key: str, n_predict: int) -> KeyFate:
    if not any(s in key for s in MIMO_FILTER):
        return KeyFate(key, FILTERED, True)
    if key in SHARED:
        return KeyFate(key, LOADED, False)
    m = re.match(r"model\.mtp_layers\.(\d+)\.(.+)$", key)
    if m and int(m.group(1)) < n_predict and m.group(2) in MIMO_LAYER_KEYS:
        return KeyFate(key, LOADED, False)
    if key.endswith(".bias"):
        return KeyFate(key, BIAS_IGNORED, True)
    return KeyFate(key, LOAD_ERROR, False)


def mimo_mtp_unfilled(keys: list[str], n_predict: int) -> list[str]:
    """The vLLM parameters (as checkpoint keys) no key fills: vLLM refuses to start."""
    present = set(keys)
    need = [
        f"model.mtp_layers.{i}.{rel}" for i in range(n_predict) for rel in sorted(MIMO_LAYER_KEYS)
    ]
    return [k for k in need if k not in present]
