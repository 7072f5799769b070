"""Batched step-0 forwards of the reference drafter (the serving "draft extend").

Sequences of different lengths are packed into one padded batch (padding rows carry document
id -1, so they attend only to themselves and never to real rows) and run under
`torch.inference_mode()`. Only what the comparisons need leaves this module: per-row logits in
fp32, never a full-vocab softmax.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# Rows per forward: large enough to keep the matmuls efficient, small enough for the
# attention scores [B, heads, T, T] to stay modest on CPU.
DEFAULT_BATCH_TOKENS = 4096
# Below this hidden size one thread is faster than several (see `threads_for`).
SMALL_HIDDEN = 512


@dataclass(frozen=True)
class Step0Input:
    input_ids: torch.Tensor  # [T] token fed with aux row t (the token at t+1)
    aux: (
        torch.Tensor | None
    )  # [T, W] hidden input (fc's, or H wide when fc is skipped); None: unrecorded
    positions: torch.Tensor  # [T]
    # Rows the drafter attends over before these (a prefix-cache hit's cached span, rebuilt
    # from recorded captures): run as context, no logits returned for them.
    prefix: Step0Input | None = None

    def with_prefix(self) -> Step0Input:
        """The rows with their prefix in front (one sequence), or self without one."""
        p = self.prefix
        if p is None:
            return self
        return Step0Input(
            torch.cat(
                [torch.as_tensor(p.input_ids).long(), torch.as_tensor(self.input_ids).long()]
            ),
            torch.cat([p.aux.to(self.aux.dtype), self.aux]) if self.aux is not None else None,
            torch.cat(
                [torch.as_tensor(p.positions).long(), torch.as_tensor(self.positions).long()]
            ),
        )


def _batches(items: Sequence[Step0Input], batch_tokens: int) -> list[list[int]]:
    order = sorted(range(len(items)), key=lambda i: -len(items[i].input_ids))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = len(items[current[0]].input_ids) if current else len(items[i].input_ids)
        if current and longest * (len(current) + 1) > batch_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def plan_batches(
    items: Sequence[Step0Input], batch_tokens: int = DEFAULT_BATCH_TOKENS
) -> list[list[int]]:
    """The batches `step0_logits` runs `items` in (indices, longest first), from their lengths
    alone: the items may carry no aux yet. `step0_logits` on one batch's items, in this order,
    runs that same batch, so a caller can read each batch's inputs just before it runs."""
    return _batches([it.with_prefix() for it in items], batch_tokens)


@torch.inference_mode()
def step0_logits(
    model: torch.nn.Module,
    items: Sequence[Step0Input],
    dtype: torch.dtype = torch.float32,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    on_batch: Callable[[int], None] | None = None,
) -> list[torch.Tensor]:
    """Draft-vocab logits [T_i, Vd] (fp32) for every item, in the order given (an item's
    prefix rows are attended over, and left out of its logits)."""
    skip = [len(it.prefix.input_ids) if it.prefix is not None else 0 for it in items]
    items = [it.with_prefix() for it in items]
    out: list[torch.Tensor | None] = [None] * len(items)
    # The batch lives where the model's weights do (CPU in replay; a GPU in bench/replay.py).
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    for group in _batches(items, batch_tokens):
        T = max(len(items[i].input_ids) for i in group)
        B = len(group)
        width = items[group[0]].aux.shape[-1]
        ids = torch.zeros(B, T, dtype=torch.long, device=device)
        aux = torch.zeros(B, T, width, dtype=dtype, device=device)
        pos = torch.zeros(B, T, dtype=torch.long, device=device)
        docs = torch.full((B, T), -1, dtype=torch.long, device=device)
        for b, i in enumerate(group):
            n = len(items[i].input_ids)
            ids[b, :n] = items[i].input_ids
            aux[b, :n] = items[i].aux.to(dtype)
            pos[b, :n] = items[i].positions
            docs[b, :n] = 0
        # Padding positions keep increasing so RoPE stays finite and no row is special.
        logits = model(ids, aux, positions=pos, document_ids=docs).logits.float()
        for b, i in enumerate(group):
            out[i] = logits[b, skip[i] : len(items[i].input_ids)].clone()
        if on_batch is not None:
            on_batch(sum(len(items[i].input_ids) for i in group))
    return [o for o in out if o is not None]


def argmax_rows(logits: Sequence[torch.Tensor]) -> torch.Tensor:
    return (
        torch.cat([lg.argmax(-1) for lg in logits]) if logits else torch.zeros(0, dtype=torch.long)
    )


@contextmanager
def threads_for(hidden_size: int) -> Iterator[None]:
    """One intra-op thread for small models: their matmuls are too small to split, and on a
    busy machine a second spinning thread makes each one ~20x slower (measured: 27 us vs
    610 us for a [60, 64] x [64, 128] linear on 2 shared cores)."""
    before = torch.get_num_threads()
    if hidden_size < SMALL_HIDDEN:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
