"""A small EAGLE-3-shaped trace written through the real `TraceWriter` (in-process mode).

Not a test module; shared by the bundle, diff and HTML-report tests. Values are a pure function
of (token, position, slot) so two "runs" with the same prompts agree exactly, and a variant can
perturb one stream to check that `diff` names it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hstrace.trace import TraceWriter, create_trace, request_key

K, H, TOPK, VOCAB, N_DRAFT = 3, 32, 4, 200, 3
LAYER_IDS = [1, 4, 7]


def _hidden(ids: np.ndarray, pos: np.ndarray, slots: int, shift: int = 0) -> torch.Tensor:
    g = torch.Generator()
    out = torch.empty(len(ids), slots * H)
    for i, (t, p) in enumerate(zip(ids.tolist(), pos.tolist(), strict=True)):
        g.manual_seed(1000003 * int(t) + 7919 * int(p) + 17)
        base = torch.randn(slots + 2, H, generator=g) * (1 + torch.arange(slots + 2)[:, None])
        out[i] = base[shift : shift + slots].reshape(-1)
    return out.to(torch.bfloat16)


def write_demo_trace(
    path: Path,
    *,
    seed: int = 0,
    n_requests: int = 3,
    rounds: int = 6,
    prompt_len: int = 12,
    rid_prefix: str = "req",
    slot_shift_from_round: int | None = None,
    accept_seed: int | None = None,
    engine: str = "reference",
) -> Path:
    """Prefill, then `rounds` verify rounds of chain drafting with N_DRAFT tokens."""
    rng = np.random.default_rng(seed)
    acc_rng = np.random.default_rng(seed if accept_seed is None else accept_seed)
    create_trace(
        path,
        engine={"name": engine, "version": "test"},
        command_line=["test"],
        static={"spec": {"num_steps": N_DRAFT}},
    )
    w = TraceWriter(path, rank=0, process=False)
    rids = [f"{rid_prefix}-{i}" for i in range(n_requests)]
    keys = torch.tensor([request_key(r) for r in rids], dtype=torch.int64)
    prompts = [rng.integers(1, VOCAB, prompt_len) for _ in rids]
    rid_bytes = [np.frombuffer(r.encode(), np.uint8) for r in rids]
    w.write(
        "requests",
        req={
            "req_key": keys,
            "n_prompt": torch.full((n_requests,), prompt_len),
            "rid_len": torch.tensor([len(b) for b in rid_bytes]),
        },
        tok={"prompt_ids": torch.from_numpy(np.concatenate(prompts))},
        rid={"bytes": torch.from_numpy(np.concatenate(rid_bytes))},
    )
    aux_attrs = {"tok/aux_hidden": {"layer_ids": LAYER_IDS, "slot_width": H}}
    seqs = [list(p) for p in prompts]
    last = [int(p[-1]) for p in prompts]

    def target(mode: int, toks: list[np.ndarray], poss: list[np.ndarray], rnd: int) -> None:
        ids = np.concatenate(toks)
        pos = np.concatenate(poss)
        shift = 1 if slot_shift_from_round is not None and rnd >= slot_shift_from_round else 0
        w.write(
            "target",
            step={"mode": mode},
            req={"req_key": keys, "n_tok": torch.tensor([len(t) for t in toks])},
            tok={
                "input_ids": torch.from_numpy(ids),
                "positions": torch.from_numpy(pos),
                "aux_hidden": _hidden(ids, pos, K, shift),
            },
            column_attrs=aux_attrs,
        )

    def drafting(toks: list[np.ndarray], poss: list[np.ndarray]) -> list[np.ndarray]:
        ids = np.concatenate(toks)
        pos = np.concatenate(poss)
        h = _hidden(ids, pos, K)
        topk = torch.from_numpy(((ids[:, None] * 31 + np.arange(TOPK)) % VOCAB).astype(np.int64))
        lp = torch.log_softmax(
            torch.arange(TOPK, 0, -1, dtype=torch.float32).repeat(len(ids), 1), -1
        )
        w.write(
            "draft_extend",
            req={"req_key": keys, "n_tok": torch.tensor([len(t) for t in toks])},
            tok={
                "input_ids": torch.from_numpy(ids),
                "positions": torch.from_numpy(pos),
                "hidden_in": h,
                "topk_draft_ids": topk,
                "topk_target_ids": topk,
                "topk_logprobs": lp,
                "lse": torch.zeros(len(ids)),
            },
        )
        proposals = [[] for _ in rids]
        cur = [int(t[-1]) for t in toks]
        cur_pos = [int(p[-1]) + 1 for p in poss]
        for s in range(N_DRAFT):
            nxt = [(c * 31 + 1) % VOCAB for c in cur]
            ids1 = np.array(nxt, np.int64)
            pos1 = np.array(cur_pos, np.int64)
            w.write(
                "draft_step",
                step={"step_index": s},
                req={"req_key": keys, "n_tok": torch.ones(n_requests, dtype=torch.int64)},
                tok={
                    "input_ids": torch.from_numpy(ids1),
                    "positions": torch.from_numpy(pos1),
                    "hidden_in": _hidden(ids1, pos1, 1),
                    "topk_draft_ids": torch.from_numpy(
                        ((ids1[:, None] * 31 + np.arange(TOPK)) % VOCAB).astype(np.int64)
                    ),
                    "topk_target_ids": torch.from_numpy(
                        ((ids1[:, None] * 31 + np.arange(TOPK)) % VOCAB).astype(np.int64)
                    ),
                    "topk_logprobs": lp[: len(ids1)],
                    "lse": torch.zeros(len(ids1)),
                },
            )
            for i in range(n_requests):
                proposals[i].append(nxt[i])
            cur = nxt
            cur_pos = [p + 1 for p in cur_pos]
        return [np.array(p, np.int64) for p in proposals]

    target(0, prompts, [np.arange(prompt_len) for _ in rids], 0)
    proposals = drafting([p[1:] for p in prompts], [np.arange(1, prompt_len) for _ in rids])
    for rnd in range(1, rounds + 1):
        toks = [
            np.concatenate([[last[i]], proposals[i]]).astype(np.int64) for i in range(n_requests)
        ]
        poss = [
            np.arange(len(seqs[i]) - 1, len(seqs[i]) + N_DRAFT, dtype=np.int64)
            for i in range(n_requests)
        ]
        target(1, toks, poss, rnd)
        acc = acc_rng.integers(0, N_DRAFT + 1, n_requests)
        accepted = [proposals[i][: acc[i]] for i in range(n_requests)]
        bonus = np.array(
            [(int(toks[i][acc[i]]) * 7 + 3) % VOCAB for i in range(n_requests)], np.int64
        )
        w.write(
            "verify",
            req={
                "req_key": keys,
                "accept_len": torch.from_numpy(acc.astype(np.int64)),
                "bonus_id": torch.from_numpy(bonus),
                "n_proposed": torch.full((n_requests,), N_DRAFT),
                "n_accepted": torch.from_numpy(acc.astype(np.int64)),
            },
            proposed={"ids": torch.from_numpy(np.concatenate(proposals))},
            accepted={"ids": torch.from_numpy(np.concatenate(accepted).astype(np.int64))},
        )
        new_toks, new_pos = [], []
        for i in range(n_requests):
            committed = [*accepted[i].tolist(), int(bonus[i])]
            start = len(seqs[i])
            seqs[i].extend(committed)
            last[i] = committed[-1]
            new_toks.append(np.array(committed, np.int64))
            new_pos.append(np.arange(start, start + len(committed), dtype=np.int64))
        proposals = drafting(new_toks, new_pos)
    w.close()
    return path


def copy_trace(
    src: Path, dst: Path, transform=None, engine: str | None = None, static: dict | None = None
) -> Path:
    """Rewrite `src` event by event through the real writer, passing each column through
    `transform(table, axis, column, value) -> value` (a controlled perturbation); `static`
    entries are added to the trace's static audit."""
    from hstrace.bundle.select import plan_rank
    from hstrace.trace import open_trace

    tr = open_trace(src)
    meta = tr.root_meta
    eng = dict(meta["engine"])
    if engine:
        eng["name"] = engine
    create_trace(
        dst,
        engine=eng,
        command_line=meta["command_line"],
        static={**meta["static"], **(static or {})},
    )
    for r in tr.ranks:
        view = tr.rank(r)
        w = TraceWriter(dst, rank=r, process=False)
        for ev in plan_rank(view, r).events:
            t = view.table(ev.table)
            axes = {}
            for axis, cols in t.step(ev.step).items():
                axes[axis] = {}
                for col, v in cols.items():
                    v = (
                        v
                        if isinstance(v, torch.Tensor)
                        else torch.from_numpy(np.ascontiguousarray(v))
                    )
                    if transform is not None:
                        v = transform(ev.table, axis, col, v)
                    axes[axis][col] = v[0] if axis == "step" else v
            attrs = {
                f"tok/{c}": {
                    k: x for k, x in t.column_attrs("tok", c).items() if k != "hstrace_dtype"
                }
                for c in t.columns.get("tok", [])
            }
            w.write(ev.table, column_attrs=attrs, **axes)
        w.close()
    return dst
