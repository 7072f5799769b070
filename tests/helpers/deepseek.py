"""What the DeepSeek-V3 NextN tests share: the MoE routing of their tiny configs, and seeded
weights scaled so activations stay O(1) and the router's choice is not a tie."""

from __future__ import annotations

import torch

# DeepSeek-V3's routing, shrunk: sigmoid scores, `noaux_tc` selection bias, 4 groups of 2 of
# 8 routed experts, one shared expert; layer 0 dense (so the NextN layer is MoE).
MOE_ROUTING = {
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
}


def seeded(model: torch.nn.Module, seed: int, embedding_unscaled: bool = False) -> None:
    """Every parameter drawn from one seeded generator: norms 1 + 0.2 z, the selection bias
    0.05 z, matrices z / sqrt(fan_in) (the router's 4x: sharp but not saturated); the
    embedding z when `embedding_unscaled` (a target whose states must be O(1) from token 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * z)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * z)
            elif embedding_unscaled and "embed_tokens" in name:
                p.copy_(z)
            elif name.endswith("gate.weight"):
                p.copy_(4 * z / p.shape[1] ** 0.5)
            else:
                p.copy_(z / p.shape[-1] ** 0.5)
