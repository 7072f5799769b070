"""Make traces/example.zarr: a small synthetic trace that uses every table and column of
schema v1 (fixed seed), for the README's first command and the docs.

The numbers are synthetic (random tensors, a toy acceptance process), not a model's output:
the example shows the shape of a trace, not a diagnosis. Run: python traces/make_example.py
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from hstrace.trace import TraceWriter, create_trace, request_key
from hstrace.trace.schema import MODE_PREFILL, MODE_VERIFY

OUT = Path(__file__).with_name("example.zarr")
SEED = 20250101
HIDDEN = 64  # target hidden size H
SLOTS = 3  # aux layers K: the drafter's fc input is K*H wide
LAYER_IDS = [1, 3, 5]
TARGET_VOCAB = 512
DRAFT_VOCAB = 256
TOPK = 8
SPEC_STEPS = 3  # draft tokens proposed per verify
ROUNDS = 6
N_REQUESTS = 4


def _bf16(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def _draft_rows(g: torch.Generator, ids: torch.Tensor, pos: torch.Tensor, width: int) -> dict:
    n = ids.numel()
    logits = torch.randn(n, DRAFT_VOCAB, generator=g) * 3
    logprobs = torch.log_softmax(logits, dim=-1)
    top_lp, top_ids = logprobs.topk(TOPK, dim=-1)
    return {
        "input_ids": ids.to(torch.int32),
        "positions": pos.to(torch.int32),
        "hidden_in": _bf16(g, n, width),
        "topk_draft_ids": top_ids.to(torch.int32),
        "topk_target_ids": (top_ids * 2).to(torch.int32),  # synthetic d2t: target id = 2 * draft id
        "topk_logprobs": top_lp.to(torch.float32),
        "lse": torch.logsumexp(logits, dim=-1).to(torch.float32),
        "logits": logits.to(torch.bfloat16),
    }


def make(out: Path = OUT) -> Path:
    g = torch.Generator().manual_seed(SEED)
    if out.exists():
        shutil.rmtree(out)
    create_trace(
        out,
        engine={"name": "synthetic", "version": "0"},
        command_line=["python", "traces/make_example.py"],
        static={
            "synthetic": True,
            "target": {"hidden_size": HIDDEN, "vocab_size": TARGET_VOCAB, "num_layers": 8},
            "drafter": {"vocab_size": DRAFT_VOCAB, "aux_layer_ids": LAYER_IDS, "topk": TOPK},
            "speculative": {"num_steps": SPEC_STEPS, "topk": 1, "num_draft_tokens": SPEC_STEPS + 1},
        },
    )
    aux_attrs = {"tok/aux_hidden": {"layer_ids": LAYER_IDS, "slot_width": HIDDEN}}
    with TraceWriter(out, rank=0, process=False) as w:
        rids = [f"req-{i:04d}" for i in range(N_REQUESTS)]
        keys = torch.tensor([request_key(r) for r in rids], dtype=torch.int64)
        prompts = [
            torch.randint(0, TARGET_VOCAB, (int(n),), generator=g)
            for n in torch.randint(12, 40, (N_REQUESTS,), generator=g)
        ]
        for rid, key, prompt in zip(rids, keys, prompts, strict=True):
            rid_bytes = torch.tensor(list(rid.encode()), dtype=torch.uint8)
            w.write(
                "requests",
                req={
                    "req_key": key[None],
                    "n_prompt": torch.tensor([prompt.numel()]),
                    "rid_len": torch.tensor([rid_bytes.numel()]),
                },
                tok={"prompt_ids": prompt.to(torch.int32)},
                rid={"bytes": rid_bytes},
            )
        # Prefill: one batched extend of all prompts, then the drafter's extend over the same tokens.
        lens = torch.tensor([p.numel() for p in prompts])
        ids = torch.cat(prompts)
        pos = torch.cat([torch.arange(n) for n in lens.tolist()])
        w.write(
            "target",
            step={"mode": MODE_PREFILL},
            req={"req_key": keys, "n_tok": lens},
            tok={
                "input_ids": ids.to(torch.int32),
                "positions": pos.to(torch.int32),
                "aux_hidden": _bf16(g, ids.numel(), SLOTS * HIDDEN),
            },
            column_attrs=aux_attrs,
        )
        w.write(
            "draft_extend",
            req={"req_key": keys, "n_tok": lens},
            tok=_draft_rows(g, ids, pos, SLOTS * HIDDEN),
        )
        seq_len = lens.clone()
        last = torch.stack([p[-1] for p in prompts])
        for _ in range(ROUNDS):
            ones = torch.ones(N_REQUESTS, dtype=torch.int64)
            proposed = []
            for s in range(SPEC_STEPS):
                rows = _draft_rows(g, last if s == 0 else proposed[-1], seq_len + s, HIDDEN)
                w.write(
                    "draft_step",
                    step={"step_index": s},
                    req={"req_key": keys, "n_tok": ones},
                    tok=rows,
                )
                proposed.append(rows["topk_target_ids"][:, 0].to(torch.int64))
            prop = torch.stack(proposed, dim=1)  # [R, SPEC_STEPS]
            verify_ids = torch.cat([last[:, None], prop], dim=1).reshape(-1)
            verify_pos = (seq_len[:, None] + torch.arange(SPEC_STEPS + 1)).reshape(-1)
            n_tok = torch.full((N_REQUESTS,), SPEC_STEPS + 1)
            w.write(
                "target",
                step={"mode": MODE_VERIFY},
                req={"req_key": keys, "n_tok": n_tok},
                tok={
                    "input_ids": verify_ids.to(torch.int32),
                    "positions": verify_pos.to(torch.int32),
                    "aux_hidden": _bf16(g, verify_ids.numel(), SLOTS * HIDDEN),
                },
            )
            # Toy acceptance: each draft position is accepted with probability 0.7 while the chain holds.
            u = torch.rand(N_REQUESTS, SPEC_STEPS, generator=g) < 0.7
            accept_len = u.to(torch.int64).cumprod(dim=1).sum(dim=1)
            bonus = torch.randint(0, TARGET_VOCAB, (N_REQUESTS,), generator=g)
            accepted = [prop[i, : int(accept_len[i])] for i in range(N_REQUESTS)]
            w.write(
                "verify",
                req={
                    "req_key": keys,
                    "accept_len": accept_len,
                    "bonus_id": bonus,
                    "n_proposed": torch.full((N_REQUESTS,), SPEC_STEPS),
                    "n_accepted": accept_len,
                },
                proposed={"ids": prop.reshape(-1)},
                accepted={"ids": torch.cat(accepted)},
            )
            seq_len += accept_len + 1
            last = bonus
    return out


if __name__ == "__main__":
    path = make(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
    print(f"wrote {path}")
