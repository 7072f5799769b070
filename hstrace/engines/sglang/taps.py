"""Per-step taps: SGLang's batch/result objects -> rows of the trace tables (pure logic).

Each function reads only attributes (duck-typed: real SGLang objects in serving and in the CPU
tests) and returns `TableWrite`s; the hooks pass them to `TraceWriter.write`. Tensors are handed
over as they are (the writer copies asynchronously on CUDA); only small index math happens here.
"""

from __future__ import annotations

from typing import Any

import torch

# The row type and the rows built the same way for every engine (hstrace.engines.rows).
from hstrace.engines.rows import TableWrite, request_keys, requests_write, sampling_row


def _rids(batch: Any) -> list[str]:
    return [str(r.rid) for r in batch.reqs]


HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # sglang.srt.constants (0.5.x): /health's own request


def all_health_checks(rids: Any) -> bool:
    """True when every request of a step is one of SGLang's health-check generations."""
    rids = [str(r) for r in rids]
    return bool(rids) and all(r.startswith(HEALTH_CHECK_RID_PREFIX) for r in rids)


def _prefix_lens(batch: Any) -> list[int]:
    """Per request of an extend batch, the tokens already in the KV cache before it (radix-cache
    hits, earlier chunks): `ScheduleBatch.prefix_lens`, what `ForwardBatch.init_new` builds
    positions from."""
    prefix = getattr(batch, "prefix_lens", None)
    if prefix is None:
        prefix = [
            len(r.prefix_indices) if getattr(r, "prefix_indices", None) is not None else 0
            for r in batch.reqs
        ]
    return [int(p) for p in prefix]


def _extend_positions(batch: Any) -> torch.Tensor:
    """Positions of an extend batch: each request continues from its cached prefix."""
    prefix = _prefix_lens(batch)
    return torch.cat(
        [
            torch.arange(int(p), int(p) + int(n), dtype=torch.int64)
            for p, n in zip(prefix, batch.extend_lens, strict=True)
        ]
    )


def draft_topk(
    topk_p: torch.Tensor, topk_index: torch.Tensor, hot_token_id: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Top-k in draft space, mapped to target ids the way SGLang maps them (hot_token_id[idx])."""
    mapped = (
        hot_token_id.to(topk_index.device)[topk_index] if hot_token_id is not None else topk_index
    )
    return {
        "topk_draft_ids": topk_index.to(torch.int64),
        "topk_target_ids": mapped.to(torch.int64),
        "topk_logprobs": torch.log(topk_p.float().clamp_min(torch.finfo(torch.float32).tiny)),
    }


# SGLang's `SamplingParams` names for the trace's sampling columns where they differ
SAMPLING_ALIASES = {"max_tokens": "max_new_tokens", "seed": "sampling_seed"}


def requests_rows(batch: Any, seen: set[str]) -> TableWrite | None:
    """One `requests` row per request not seen before (its id and prompt token ids), in the
    extend batch that first schedules it. `n_cached`: the prompt tokens SGLang served from its
    radix cache, i.e. the request's prefix length in that batch (its first chunk's prefix; what
    SGLang adds to `cached_tokens` / meta_info)."""
    prefix = _prefix_lens(batch)
    new_at = [i for i, r in enumerate(batch.reqs) if str(r.rid) not in seen]
    if not new_at:
        return None
    new = [batch.reqs[i] for i in new_at]
    seen.update(str(r.rid) for r in new)
    return requests_write(
        [str(r.rid) for r in new],
        [r.origin_input_ids for r in new],
        [prefix[i] for i in new_at],
        [sampling_row(getattr(r, "sampling_params", None), SAMPLING_ALIASES) for r in new],
    )


def prefill_rows(
    batch: Any,
    target_input_ids: torch.Tensor,
    draft_input_ids: torch.Tensor,
    target_hidden_states: torch.Tensor,
) -> list[TableWrite]:
    """Target prefill (the exact aux concat the drafter got) and the draft-extend inputs.

    `_draft_extend_for_prefill` replaces `batch.input_ids` with the ids shifted left by one per
    request plus a tail token (the sampled token, or the next prompt token for a non-final
    chunk); the hook hands over both tensors, so nothing is re-derived here.
    """
    rids = _rids(batch)
    lens = [int(n) for n in batch.extend_lens]
    positions = _extend_positions(batch).to(target_input_ids.device)
    req = {"req_key": request_keys(rids), "n_tok": torch.tensor(lens, dtype=torch.int64)}
    target = TableWrite(
        "target",
        step={"mode": 0},
        req=dict(req),
        tok={
            "input_ids": target_input_ids.to(torch.int64),
            "positions": positions,
            "aux_hidden": target_hidden_states,
        },
    )
    draft = TableWrite(
        "draft_extend",
        req=dict(req),
        tok={
            "input_ids": draft_input_ids.to(torch.int64),
            "positions": positions,
            "hidden_in": target_hidden_states,
        },
    )
    return [target, draft]


def draft_extend_topk_rows(
    draft_input: Any,
    hot_token_id: torch.Tensor | None,
    total: int,
    rows: torch.Tensor,
    logprobs_known: bool = True,
) -> dict[str, torch.Tensor]:
    """The top-k the draft-extend produced (one per request, at row `rows[b]`), spread over the
    extend's `total` token rows: rows without a top-k get ids -1 and log-prob -inf.

    `logprobs_known=False` when SGLang took the argmax-only path (topk == 1 after a verify: it
    sets `topk_p = 1` without computing a probability); those log-probs are stored as NaN rather
    than as a made-up 0."""
    k = draft_input.topk_index.shape[-1]
    device = draft_input.topk_index.device
    per_req = draft_topk(draft_input.topk_p, draft_input.topk_index, hot_token_id)
    if not logprobs_known:
        per_req["topk_logprobs"] = torch.full_like(per_req["topk_logprobs"], float("nan"))
    out = {
        "topk_draft_ids": torch.full((total, k), -1, dtype=torch.int64, device=device),
        "topk_target_ids": torch.full((total, k), -1, dtype=torch.int64, device=device),
        "topk_logprobs": torch.full((total, k), float("-inf"), dtype=torch.float32, device=device),
    }
    for name, value in per_req.items():
        out[name][rows.to(value.device)] = value
    return out


def verify_rows(batch: Any, verify_input: Any, result: Any) -> list[TableWrite]:
    """Target verify (aux concat over every draft token) and the verify outcome per request.

    `accept_lens` in SGLang includes the bonus token; the trace's `accept_len` excludes it.
    """
    rids = _rids(batch)
    bs = len(rids)
    ndt = int(verify_input.draft_token_num)
    keys = request_keys(rids)
    proposed = verify_input.draft_token.to(torch.int64)
    predict = result.next_token_ids.to(torch.int64)
    accept_lens = result.accept_lens.to(torch.int64)
    accept_index = result.accept_index.to(torch.int64).reshape(bs, -1)
    accepted_rows = []
    bonus = []
    for b in range(bs):
        idx = accept_index[b, : int(accept_lens[b])]
        tokens = predict[idx]
        accepted_rows.append(tokens[:-1])  # draft tokens the target agreed with
        bonus.append(tokens[-1:])  # the target's own next token
    n_accepted = accept_lens - 1
    target = TableWrite(
        "target",
        step={"mode": 1},
        req={"req_key": keys, "n_tok": torch.full((bs,), ndt, dtype=torch.int64)},
        tok={
            "input_ids": proposed,
            "positions": verify_input.positions.to(torch.int64),
            "aux_hidden": result.logits_output.hidden_states,
        },
    )
    verify = TableWrite(
        "verify",
        req={
            "req_key": keys,
            "accept_len": n_accepted,
            "bonus_id": torch.cat(bonus),
            "n_proposed": torch.full((bs,), ndt - 1, dtype=torch.int64),
            "n_accepted": n_accepted,
        },
        other={
            "proposed": {"ids": torch.cat([proposed.reshape(bs, ndt)[b, 1:] for b in range(bs)])},
            "accepted": {"ids": torch.cat(accepted_rows)},
        },
    )
    return [target, verify]


def draft_forward_rows(
    table: str,
    forward_batch: Any,
    logits: torch.Tensor,
    hot_token_id: torch.Tensor | None,
    topk: int,
    rids: list[str],
    with_logits: bool,
    step_index: int | None = None,
) -> TableWrite:
    """One eager draft-model forward: its exact inputs (ids, positions, hidden and its width) and
    its top-k with log-probs; the full logits only when asked for."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top_lp, top_idx = logprobs.topk(topk, dim=-1)
    mapped = hot_token_id.to(top_idx.device)[top_idx] if hot_token_id is not None else top_idx
    hidden = forward_batch.spec_info.hidden_states
    n = logits.shape[0]
    per_req = max(1, n // max(1, len(rids)))
    tok: dict[str, Any] = {
        "input_ids": forward_batch.input_ids.to(torch.int64)[:n]
        if forward_batch.input_ids.shape[0] >= n
        else forward_batch.input_ids.to(torch.int64),
        "positions": forward_batch.positions.to(torch.int64)[:n]
        if forward_batch.positions.shape[0] >= n
        else forward_batch.positions.to(torch.int64),
        "hidden_in": hidden[:n] if hidden.shape[0] >= n else hidden,
        "topk_draft_ids": top_idx.to(torch.int64),
        "topk_target_ids": mapped.to(torch.int64),
        "topk_logprobs": top_lp,
        "lse": torch.logsumexp(logits.float(), dim=-1),
    }
    if with_logits:
        tok["logits"] = logits
    step: dict[str, Any] = {"step_index": step_index} if step_index is not None else {}
    return TableWrite(
        table,
        step=step,
        req={
            "req_key": request_keys(rids),
            "n_tok": torch.full((len(rids),), per_req, dtype=torch.int64),
        },
        tok=tok,
    )


def last_rows(lens: list[int]) -> torch.Tensor:
    return torch.tensor(lens, dtype=torch.int64).cumsum(0) - 1


def decode_extend_rows(
    batch: Any,
    result: Any,
    draft_input: Any,
    hot_token_id: torch.Tensor | None,
    num_draft_tokens: int,
    input_ids: torch.Tensor,
    hidden_in: torch.Tensor,
    seq_lens: torch.Tensor,
    logprobs_known: bool = True,
) -> TableWrite:
    """Draft-extend after a verify: the drafter runs over all `num_draft_tokens` verified
    positions of each request (ids = the target's predictions, hidden = the verify aux concat,
    positions = seq_len + 0..ndt-1) and keeps the top-k of the last accepted row
    (`select_index = b*ndt + accept_lens[b] - 1`); `draft_input` is the next `EagleDraftInput`,
    filled in place by `_draft_extend_for_decode`."""
    rids = _rids(batch)
    bs = len(rids)
    device = input_ids.device
    accept_lens = result.accept_lens.to(device=device, dtype=torch.int64)
    base = torch.arange(bs, dtype=torch.int64, device=device) * num_draft_tokens
    rows = base + accept_lens - 1  # stays on the device: no sync with the serving stream
    offsets = torch.arange(num_draft_tokens, dtype=torch.int64, device=device)
    positions = (seq_lens.to(device=device, dtype=torch.int64)[:, None] + offsets).reshape(-1)
    tok: dict[str, Any] = {
        "input_ids": input_ids.to(torch.int64),
        "positions": positions,
        "hidden_in": hidden_in,
    }
    tok.update(
        draft_extend_topk_rows(
            draft_input, hot_token_id, bs * num_draft_tokens, rows, logprobs_known
        )
    )
    return TableWrite(
        "draft_extend",
        req={
            "req_key": request_keys(rids),
            "n_tok": torch.full((bs,), num_draft_tokens, dtype=torch.int64),
        },
        tok=tok,
    )
