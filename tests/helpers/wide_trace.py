"""A trace with Kimi-K2.5-wide aux rows and mostly rejected verify drafts, written through the
real TraceWriter (in-process mode). Shared by tests/test_replay_rows.py and bench/replay_rows.py.

hidden 7168 x 3 slots in bf16 is 43 KB a row: 64-row chunks (schema.unit_rows) inside 2048-row
shards, so a verify block of more target rows than a chunk leaves whole chunks of rejected
drafts that replay need not read. Values are random (a read test, not a replay one).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def write_wide_trace(
    path: Path, steps: int, batch: int, draft_tokens: int, accept: int, hidden: int
) -> None:
    from hstrace.trace import TraceWriter, create_trace, request_key

    create_trace(path, engine={"name": "reference", "version": "bench"}, command_line=["bench"])
    w = TraceWriter(path, rank=0, process=False)
    keys = torch.tensor([request_key(f"r{i}") for i in range(batch)], dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    lens = [64] * batch
    attrs = {"tok/aux_hidden": {"layer_ids": [2, 30, 57], "slot_width": hidden}}

    def rows(n: int) -> torch.Tensor:
        return torch.randn(n, 3 * hidden, generator=g).to(torch.bfloat16)

    def step(mode: int, n_tok: list[int], starts: list[int]) -> None:
        pos = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, n_tok, strict=True)])
        ids = torch.from_numpy((pos * 7 + 1) % 500)
        w.write(
            "target",
            step={"mode": mode},
            req={"req_key": keys, "n_tok": torch.tensor(n_tok)},
            tok={
                "input_ids": ids,
                "positions": torch.from_numpy(pos),
                "aux_hidden": rows(len(pos)),
            },
            column_attrs=attrs,
        )

    def extend(n_tok: list[int], starts: list[int]) -> None:
        pos = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, n_tok, strict=True)])
        k = torch.from_numpy(((pos[:, None] + np.arange(4)) % 256).astype(np.int64))
        w.write(
            "draft_extend",
            req={"req_key": keys, "n_tok": torch.tensor(n_tok)},
            tok={
                "input_ids": torch.from_numpy((pos * 7 + 1) % 500),
                "positions": torch.from_numpy(pos),
                "hidden_in": rows(len(pos)),
                "topk_draft_ids": k,
                "topk_target_ids": k,
                "topk_logprobs": torch.zeros(len(pos), 4),
            },
        )

    step(0, lens, [0] * batch)
    extend(lens, [0] * batch)
    for _ in range(steps):
        starts = [n - 1 for n in lens]
        step(1, [draft_tokens] * batch, starts)
        w.write(
            "verify",
            req={
                "req_key": keys,
                "accept_len": torch.full((batch,), accept),
                "bonus_id": torch.zeros(batch, dtype=torch.int64),
                "n_proposed": torch.full((batch,), draft_tokens - 1),
                "n_accepted": torch.full((batch,), accept),
            },
            proposed={"ids": torch.zeros(batch * (draft_tokens - 1), dtype=torch.int64)},
            accepted={"ids": torch.zeros(batch * accept, dtype=torch.int64)},
        )
        extend([1 + accept] * batch, [n for n in lens])
        lens = [n + 1 + accept for n in lens]
    w.close()
