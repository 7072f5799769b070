"""The DeepSeek-V3 NextN block of the reference head (MLA + MoE, `hstrace.drafter.block`) vs
HF transformers' own `DeepseekV3DecoderLayer`, fp32, on CPU, no engine.

A second, independent implementation of the same block: HF computes MLA through its latent
"expand_kv" and its interleaved-RoPE helper, and routes through `DeepseekV3TopkRouter` and
fused 3-D expert tensors. The weights are seeded random (not a trained head); HF's layer at
index N = num_hidden_layers is a MoE layer (>= first_k_dense_replace), as the NextN layer is.
The live cross-check against vLLM's own `deepseek_mtp` forward is tests/test_vllm_mtp_deepseek.py.
"""

from __future__ import annotations

import pytest
import torch

deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")

from helpers.deepseek import MOE_ROUTING, seeded  # noqa: E402

from hstrace.drafter.block import DecoderBlock, MLAttention, MoE, Rope  # noqa: E402
from hstrace.drafter.mtp import MTPConfig, MTPHead  # noqa: E402

T = 11
BLOCK = ("input_layernorm.", "self_attn.", "post_attention_layernorm.", "mlp.")  # not enorm...
SMALL = {
    "model_type": "deepseek_v3",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    **MOE_ROUTING,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
}


def _pair(hf: dict) -> tuple[MTPHead, torch.nn.Module, torch.nn.Module]:
    """The reference NextN layer and HF's decoder layer at index N, HF's weights copied from
    the reference's under the checkpoint's names (experts fused as HF stores them)."""
    head = MTPHead(MTPConfig.deepseek(hf))
    seeded(head, 7)
    config = deepseek.DeepseekV3Config(**{k: v for k, v in hf.items() if k != "model_type"})
    config._attn_implementation = "eager"
    layer = deepseek.DeepseekV3DecoderLayer(config, layer_idx=hf["num_hidden_layers"]).eval()
    ours = head.layers[0]
    sd = {k: v for k, v in ours.state_dict().items() if k.startswith(BLOCK)}
    E = hf["n_routed_experts"]
    experts = [ours.mlp.experts[e] for e in range(E)]
    for e in range(E):
        for part in ("gate_proj", "up_proj", "down_proj"):
            del sd[f"mlp.experts.{e}.{part}.weight"]
    sd["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([x.gate_proj.weight, x.up_proj.weight]) for x in experts]
    )
    sd["mlp.experts.down_proj"] = torch.stack([x.down_proj.weight for x in experts])
    missing, unexpected = layer.load_state_dict(sd, strict=False)
    assert unexpected == [] and missing == []
    return head, layer, deepseek.DeepseekV3RotaryEmbedding(config)


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q-lora", "q-proj"])
def test_the_mla_moe_block_matches_hf_deepseek_v3_decoder_layer(q_lora_rank):
    hf = dict(SMALL, q_lora_rank=q_lora_rank)
    head, layer, hf_rope = _pair(hf)
    ours = head.layers[0]
    assert isinstance(ours.self_attn, MLAttention) and isinstance(ours.mlp, MoE)
    z = torch.randn(1, T, hf["hidden_size"], generator=torch.Generator().manual_seed(1))
    pos = torch.arange(T)[None]
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want = layer(
            z, attention_mask=causal, position_ids=pos, position_embeddings=hf_rope(z, pos)
        )
        rope = Rope.at(pos, head.inv_freq, z.dtype, interleaved=head.cfg.rope_interleave)
        mask0 = torch.ones(T, T, dtype=torch.bool).tril()[None]
        got = DecoderBlock.forward(ours, z, rope, [], [], mask0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_routing_matches_hf_topk_router_and_is_not_degenerate():
    """Same experts and weights as HF's `DeepseekV3TopkRouter` on 200 rows; the group limit
    and the selection bias each decide some rows (so the agreement covers both)."""
    head, layer, _ = _pair(SMALL)
    gate = head.layers[0].mlp.gate
    x = torch.randn(200, SMALL["hidden_size"], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        w, idx = gate(x)
        _, hw, hidx = layer.mlp.gate(x)
        order, horder = idx.argsort(-1), hidx.argsort(-1)
        assert torch.equal(idx.gather(1, order), hidx.gather(1, horder))
        torch.testing.assert_close(w.gather(1, order), hw.gather(1, horder), atol=1e-6, rtol=1e-6)
        gate.spec.topk_group = gate.spec.n_group
        free = gate(x)[1]
        gate.spec.topk_group = SMALL["topk_group"]
        bias = gate.e_score_correction_bias.detach().clone()
        gate.e_score_correction_bias.zero_()
        unbiased = gate(x)[1]
        gate.e_score_correction_bias.copy_(bias)
    sort = lambda t: t.sort(-1).values  # noqa: E731
    assert (sort(idx) != sort(free)).any(-1).sum() > 0
    assert (sort(idx) != sort(unbiased)).any(-1).sum() > 0


def test_a_dense_deepseek_config_keeps_the_gqa_block():
    """No MLA dims and no experts: the NextN layer stays the dense Llama-like block."""
    hf = {k: v for k, v in SMALL.items() if not k.startswith(("q_", "kv_", "qk_", "v_", "n_"))}
    cfg = MTPConfig.deepseek(dict(hf, n_routed_experts=None))
    assert cfg.mla is None and cfg.moe is None and not cfg.rope_interleave
    cfg = MTPConfig.deepseek(dict(SMALL, first_k_dense_replace=5))  # MTP index 1 < 5: dense
    assert cfg.moe is None and cfg.mla is not None
