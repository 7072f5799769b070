#!/usr/bin/env python3
"""How far bf16 serving moves the second world's target from its fp32 self:
`python traces/second-world/routing_drift.py`.

Runs the DeepSeek-V3 target on the 20 stored samples in fp32 and in bf16 and prints (a) how many
(token, MoE layer) routings pick other experts in bf16 (the router's top-k indices) and (b) the
mean per-token cosine between the two runs at every HF `hidden_states` index. A measurement for
people (what `target-drift` has to tolerate here), not a test.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main() -> int:
    from transformers import DeepseekV3ForCausalLM

    from hstrace.training import open_training

    td = open_training(HERE / "training-speculators")
    ids = torch.stack([td[i].input_ids for i in range(len(td))])
    runs = {}
    for dt in (torch.float32, torch.bfloat16):
        model = DeepseekV3ForCausalLM.from_pretrained(HERE / "target", dtype=dt).eval()
        picks: list[torch.Tensor] = []
        hooks = [
            layer.mlp.gate.register_forward_hook(
                lambda _m, _i, o, picks=picks: picks.append(o[2].sort(-1).values)
            )
            for layer in model.model.layers
            if hasattr(layer.mlp, "gate")
        ]
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
        for h in hooks:
            h.remove()
        runs[dt] = (picks, [h.float().flatten(0, 1) for h in out.hidden_states])
    (p32, h32), (p16, h16) = runs[torch.float32], runs[torch.bfloat16]
    flips = sum(int((a != b).any(-1).sum()) for a, b in zip(p32, p16, strict=True))
    total = sum(a.shape[0] for a in p32)
    cos = [
        round(float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean()), 6)
        for a, b in zip(h32, h16, strict=True)
    ]
    print(
        json.dumps(
            {
                "routing_differs": f"{flips} of {total} (token, MoE layer)",
                "cos_fp32_vs_bf16_by_hf_index": cos,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
