"""Per-step taps for vLLM 0.33's Model Runner V2 -> the same trace rows as the V1 taps (pure).

V2 (`vllm/v1/worker/gpu/`) hands the drafter its inputs in
`TargetDependentARSpeculator.propose(input_batch, ..., last_hidden_states, aux_hidden_states,
num_sampled, num_rejected, ...)` (spec_decode/target_dependent_ar/speculator.py; EAGLE-3's
`EagleSpeculator` and `MTPSpeculator` inherit it), and verifies in
`RejectionSampler.__call__(logits, input_batch, draft_logits, invalid_drafts)`
(spec_decode/rejection_sampler.py). What they hand over, by 0.33.0's code:

- `input_batch` (gpu/input_batch.py `InputBatch`): `req_ids` [num_reqs], `query_start_loc_np`
  [num_reqs+1], `num_tokens`, `input_ids` / `positions` [num_tokens_after_padding],
  `num_draft_tokens_per_req` (np [num_reqs] or None), `cu_num_logits_np` [num_reqs+1],
  `logits_indices` [num_logits];
- `aux_hidden_states`: one [num_tokens(_padded), hidden] tensor per captured layer (V1 hands
  the proposer their concat; here the concat is ours, in the same layer order);
- the sampler's `SamplerOutput.sampled_token_ids` [num_reqs, num_speculative_steps+1] (int64,
  `new_empty`: only the first `num_sampled[i]` entries are written) and `num_sampled`
  [num_reqs] (0 for a request still chunk-prefilling);
- a request's drafts are the input ids at its logits rows after the first
  (`gather_draft_sampled`: row j>0 of a request's logits is the draft it verifies).

The rows are built by the V1 builders (`taps.target_rows`, `taps.verify_rows`) from a
`taps.Step` filled here, so the schema is the same by construction. Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hstrace.engines.rows import TableWrite
from hstrace.engines.vllm import taps


def _ints(x: Any) -> list[int]:
    return [int(v) for v in (x.tolist() if hasattr(x, "tolist") else x)]


def target_step(
    input_batch: Any,
    aux_hidden_states: Sequence[torch.Tensor],
    last_hidden_states: torch.Tensor | None = None,
) -> taps.Step:
    """The target forward V2 hands to `propose`, as a V1 `Step` (target rows only). An MTP
    speculator (`MTPSpeculator`) gets no aux states: it is fed `last_hidden_states`
    [num_tokens(_padded), hidden], the target's forward output (one slot)."""
    n_req = int(input_batch.num_reqs)
    req_ids = [str(r) for r in list(input_batch.req_ids)[:n_req]]
    qs = _ints(input_batch.query_start_loc_np)[: n_req + 1]
    n_tok = int(input_batch.num_tokens)
    if qs[-1] != n_tok:
        raise ValueError(f"query_start_loc ends at {qs[-1]}, input_batch has {n_tok} tokens")
    per_req = input_batch.num_draft_tokens_per_req
    ndraft = _ints(per_req)[:n_req] if per_req is not None else [0] * n_req
    if aux_hidden_states:
        aux = torch.cat([h[:n_tok] for h in aux_hidden_states], dim=-1)
    elif last_hidden_states is not None:  # MTP: a view of the runner's output, copied now
        aux = last_hidden_states[:n_tok].detach().clone()
    else:
        raise ValueError("no aux hidden states: the target captured no layer for EAGLE-3")
    return taps.Step(
        req_ids=req_ids,
        num_draft_tokens=ndraft,
        target_ids=input_batch.input_ids[:n_tok].detach().clone(),
        target_positions=input_batch.positions[:n_tok].detach().clone(),
        target_aux=aux,
        query_start=qs,
        sample_rows=[q - 1 for q in qs[1:]],
    )


def verify_rows(
    input_batch: Any, sampled_token_ids: torch.Tensor, num_sampled: torch.Tensor
) -> TableWrite | None:
    """The verify outcome of one V2 step (None when no request verified drafts)."""
    n_req = int(input_batch.num_reqs)
    req_ids = [str(r) for r in list(input_batch.req_ids)[:n_req]]
    cu = _ints(input_batch.cu_num_logits_np)[: n_req + 1]
    rows = input_batch.logits_indices.to(torch.int64).cpu()
    ids = input_batch.input_ids.to(torch.int64).cpu()
    got = _ints(num_sampled)[:n_req]
    sampled = sampled_token_ids.to(torch.int64).cpu()
    ndraft = [cu[i + 1] - cu[i] - 1 for i in range(n_req)]
    drafts, rows_out = [], []
    for i in range(n_req):
        drafts.append(ids.index_select(0, rows[cu[i] + 1 : cu[i + 1]]))
        k = got[i]
        rows_out.append(sampled[i, :k].tolist() + [taps.PLACEHOLDER] * (sampled.shape[1] - k))
    members = [i for i in range(n_req) if ndraft[i] > 0 and got[i] > 0]
    if not members:
        return None
    step = taps.Step(
        req_ids=req_ids,
        num_draft_tokens=ndraft,
        draft_token_ids=torch.cat(drafts) if drafts else torch.zeros(0, dtype=torch.int64),
        sampled=rows_out,
    )
    return taps.verify_rows(step, members)
