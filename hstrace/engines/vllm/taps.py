"""Per-step taps: what vLLM's V1 runner and EAGLE-3 proposer hand over -> trace rows (pure).

One vLLM step is one `GPUModelRunner.propose_draft_token_ids` call. The hooks collect, inside
it, the proposer's inputs (`SpecDecodeBaseProposer.propose`: the target's token ids, positions
and aux concat before `fc`, the next tokens, the rows it samples) and every drafter forward /
logits call; `step_rows` turns one such step into rows of the five tables. vLLM batches
prefill chunks and verifies together: a step's requests with scheduled drafts are a target
verify (mode 1), the others a prefill/extend chunk (mode 0), written as two `target` events.
Nothing here imports vLLM: the inputs are tensors and plain lists (duck-typed in tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hstrace.engines import tapmath
from hstrace.engines.rows import (
    TableWrite,
    aux_hidden_attrs,
    request_keys,
    requests_write,
    sampling_row,
)

TOPK = 8  # draft top-k recorded per sampled row (vLLM computes the full draft logits anyway)
PLACEHOLDER = -1  # vLLM's rejected / padding slot in sampled_token_ids


# Every torch call on the tap thread gives up the GIL and takes it back from the serving
# thread (a hand-over each way): calls that would change nothing are not made.
def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as `dtype` where it is (a CUDA tensor stays on its device: the writer copies)."""
    return t if t.dtype is dtype else t.to(dtype)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` on the CPU as `dtype` (itself when it already is)."""
    return _cast(t if t.is_cpu else t.cpu(), dtype)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return _cast(t, torch.float32)


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)


_FILLED: dict[tuple[int, float | str, torch.dtype], torch.Tensor] = {}


def filled(n: int, value: float, dtype: torch.dtype) -> torch.Tensor:
    """A column of `n` rows all `value` (-1, NaN, 1: what a row has where nothing was tapped),
    made once per shape and shared: such a column is only ever read (staged, compared), never
    written in place."""
    key = (n, value if value == value else "nan", dtype)  # NaN != NaN: one key for it
    t = _FILLED.get(key)
    if t is None:
        if len(_FILLED) >= 256:  # shapes come and go with the batch: keep the cache small
            _FILLED.clear()
        t = _FILLED[key] = torch.full((n,), value, dtype=dtype)
    return t


def _counts(values: list[int]) -> torch.Tensor:
    """An int64 column of per-request counts; a decode batch's (every request the same: the
    drafts verified, the tokens a request ran) is the shared `filled` column."""
    if values and values.count(values[0]) == len(values):
        return filled(len(values), values[0], torch.int64)
    return torch.tensor(values, dtype=torch.int64)


def _first(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` rows of `t` (itself when it has exactly those)."""
    return t if t.shape[0] == n else t[:n]


@dataclass
class NewRequest:
    rid: str
    prompt_ids: list[int]
    n_cached: int  # prompt tokens served from the prefix cache (scheduled num_computed_tokens)
    # vLLM's resolved SamplingParams as `rows.sampling_row` reads them (None: not tapped)
    sampling: dict[str, float | int] | None = None


@dataclass
class DraftCall:
    """One drafter forward of a proposal, and the top-k of the logits it led to."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    hidden_in: torch.Tensor | None
    topk: dict[str, torch.Tensor] | None = None
    # the logits `compute_logits` returned (a fresh tensor vLLM never writes again) and its
    # draft->target map: `topk` is taken from them off the serving thread (`finish_topk`)
    logits: torch.Tensor | None = None
    d2t: torch.Tensor | None = None
    # `topk` already holds a draft extend's rows (every target row, `_expand_topk`'s layout)
    expanded: bool = False


def finish_topk(
    step: Step, expand: bool = False, between: Callable[[], None] | None = None
) -> None:
    """The draft top-k of every call whose logits were kept, then the logits dropped. Native
    (`tapmath`), one call each, and with `expand` (no `restrict` to follow) the first call's
    rows land straight in its draft extend's rows; through torch, one `draft_topk` over the
    step's calls stacked (same drafter, same vocabulary), split back. `between`: called
    between two native calls (the tap thread gives way there)."""
    todo = [c for c in step.calls if c.topk is None and c.logits is not None]
    if tapmath.native() is not None:
        first = step.calls[0] if step.calls else None
        rows = step.sample_rows
        for i, call in enumerate(todo):
            if i and between is not None:
                between()
            if (
                expand
                and call is first
                and rows is not None
                and step.target_ids is not None
                and int(call.logits.shape[0]) == len(rows)
            ):
                n_tok = int(step.target_ids.shape[0])
                call.topk = draft_topk(call.logits, call.d2t, dest=list(rows), n_out=n_tok)
                call.expanded = True
            else:
                call.topk = draft_topk(call.logits, call.d2t)
    elif len(todo) > 1 and all(
        c.d2t is todo[0].d2t and c.logits.shape[1:] == todo[0].logits.shape[1:] for c in todo
    ):
        sizes = [int(c.logits.shape[0]) for c in todo]
        both = draft_topk(torch.cat([c.logits for c in todo]), todo[0].d2t)
        parts = {name: col.split_with_sizes(sizes) for name, col in both.items()}
        for i, call in enumerate(todo):
            call.topk = {name: part[i] for name, part in parts.items()}
    else:
        for call in todo:
            call.topk = draft_topk(call.logits, call.d2t)
    for call in step.calls:
        call.logits = call.d2t = None


@dataclass
class Step:
    """Everything one `propose_draft_token_ids` call saw (filled by the wrappers)."""

    req_ids: list[str]
    num_draft_tokens: list[int]  # per request, drafts verified in this step (0: prefill chunk)
    new_requests: Sequence[NewRequest] = ()  # (empty: the shared tuple, not a list a step keeps)
    draft_token_ids: torch.Tensor | None = None  # [sum(num_draft_tokens)] the verified drafts
    # per request, the runner's sampled row (-1 = none): lists, or the runner's [B, k+1] tensor
    # as the hooks copy it (one object for a held step to keep, where lists were B + 1: read
    # through `sampled_rows`)
    sampled: list[list[int]] | torch.Tensor | None = None
    # from the proposer
    target_ids: torch.Tensor | None = None
    target_positions: torch.Tensor | None = None
    target_aux: torch.Tensor | None = None  # [T, K*H], before fc
    query_start: list[int] | None = None  # [B+1] row offsets per request
    sample_rows: list[int] | None = None  # row of each request the first pass samples from
    calls: list[DraftCall] = field(default_factory=list)
    # from the rejection sampler (run before the proposer in the same step): what each
    # request's verify rule used, as columns over the batch (None: not tapped)
    verify_probs: VerifyProbs | None = None
    _keys: torch.Tensor | None = field(default=None, repr=False)

    def keys(self, members: list[int] | None = None) -> torch.Tensor:
        """The `req_key` column of the requests at `members` (default: the whole batch),
        hashed once per step."""
        if self._keys is None:
            self._keys = request_keys(self.req_ids)
        if members is None or members == list(range(len(self.req_ids))):
            return self._keys
        return self._keys.index_select(0, torch.tensor(members, dtype=torch.int64))


# The verify rule a request was judged by (`verify.req.rule`).
RULE_GREEDY = 0  # accept while draft == argmax of the target's processed logits
RULE_ONE_HOT = 1  # rejection sampling, draft treated as one-hot: accept with p(token)
RULE_DRAFT_PROBS = 2  # rejection sampling with the draft's probabilities: min(1, p/q)
RULE_SYNTHETIC = 3  # vLLM's synthetic acceptance rates (not a function of p, q)
RULES = {
    RULE_GREEDY: "greedy",
    RULE_ONE_HOT: "one-hot",
    RULE_DRAFT_PROBS: "draft-probs",
    RULE_SYNTHETIC: "synthetic",
}
# Per-request sampling parameters the verify resolved (`verify.req.<name>`, NaN: unknown).
SAMPLING_PARAMS = (
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)
# Per drafted token (`verify.proposed.<name>`).
PROPOSED_FLOAT = ("p_target", "q_draft", "logit_raw", "logit_pen", "logit_proc")
PROPOSED_INT = ("target_argmax", "seen_prompt", "n_out")


@dataclass
class VerifyProbs:
    """One verify as the rejection sampler saw it, for every request of the batch, as columns:
    per request (`req`, [B]) its rule and the sampling parameters it resolved; per drafted
    token (`tok`, [N] = sum(num_draft_tokens), request by request) the target's raw logit, its
    logit and probability after the engine's transforms (penalties, temperature, top-k/top-p),
    the draft's probability (1 for a one-hot draft), the processed argmax, and the history the
    penalties count (token in the prompt 0/1, its count in the committed output; -1 unknown)."""

    num_draft_tokens: list[int]
    req: dict[str, torch.Tensor]  # "rule" (int64), SAMPLING_PARAMS (float32)
    tok: dict[str, torch.Tensor]  # PROPOSED_FLOAT (float32), PROPOSED_INT (int64)

    def select(self, members: list[int]) -> VerifyProbs:
        """The rows of the requests at batch indices `members`, in that order (the token
        columns as they are when those requests hold every drafted token: a step's verify)."""
        n = self.num_draft_tokens
        if members == list(range(len(n))):
            return self
        starts = [0]
        for k in n:
            starts.append(starts[-1] + k)
        spans = [(starts[i], starts[i + 1]) for i in members]
        at = torch.tensor(members, dtype=torch.int64)
        return VerifyProbs(
            [n[i] for i in members],
            {name: col.index_select(0, at) for name, col in self.req.items()},
            {name: _take(col, 0, spans) for name, col in self.tok.items()},
        )


def _ranges(spans: list[tuple[int, int]]) -> torch.Tensor:
    """The row indices of the half-open spans, in order (int64)."""
    parts = [torch.arange(a, b, dtype=torch.int64) for a, b in spans if b > a]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def draft_topk(
    logits_full: torch.Tensor,
    d2t: torch.Tensor | None,
    k: int = TOPK,
    dest: list[int] | None = None,
    n_out: int | None = None,
) -> dict[str, torch.Tensor]:
    """Top-k of vLLM's draft logits. `compute_logits` returns them in the target vocabulary
    (draft id i scattered to i + d2t[i], -inf elsewhere); read back the draft-space logits so
    both id spaces and the log-probs over the draft vocabulary are exact. With `dest`, row r
    of the result is row dest[r] of `n_out` rows, the others empty (`_expand_topk`)."""
    logits_full = _f32(logits_full)  # on its device: CUDA logits are never copied whole
    targets = _on(_draft_targets(d2t), logits_full.device) if d2t is not None else None
    n = int(targets.shape[0]) if targets is not None else int(logits_full.shape[-1])
    if n >= k and logits_full.shape[0]:  # CPU rows: one native call (tapmath)
        native = tapmath.topk_into(logits_full, targets, k, dest, n_out)
        if native is not None:
            return native
    if targets is not None:
        # index_select, not advanced indexing: the latter is a parallel TensorIterator kernel,
        # milliseconds per call on a busy CPU (measured: bench/live_overhead.py)
        draft = logits_full.index_select(1, targets)
    else:
        draft = logits_full
    kk = min(k, draft.shape[-1])
    lse = torch.logsumexp(draft, dim=-1)
    values, idx = draft.topk(kk, dim=-1)
    mapped = targets.take(idx) if targets is not None else idx
    out = {
        "topk_draft_ids": idx,  # int64, as topk returns them
        "topk_target_ids": mapped,
        "topk_logprobs": values.sub_(lse.unsqueeze(1)),
        "lse": lse,
    }
    if dest is not None:
        assert n_out is not None
        return _expand_topk(out, n_out, dest, k)
    return out


_TARGETS: list[Any] = []  # [d2t, its version, its target ids]: one drafter per process


def _draft_targets(d2t: torch.Tensor) -> torch.Tensor:
    """Draft id i -> target id i + d2t[i] (the drafter's buffer: computed once, not per step)."""
    cached = _TARGETS
    if cached and cached[0] is d2t and cached[1] == d2t._version:
        return cached[2]
    targets = torch.arange(d2t.numel(), device=d2t.device) + d2t.to(torch.int64)
    cached[:] = [d2t, d2t._version, targets]
    return targets


def _expand_topk(
    topk: dict[str, torch.Tensor] | None, n_rows: int, rows: list[int], k: int
) -> dict[str, torch.Tensor]:
    """Top-k columns for every row of a draft extend: real where vLLM computed logits (the
    sampled rows), ids -1 / log-prob -inf / lse NaN elsewhere (as SGLang's rows)."""
    if (
        topk is not None
        and len(rows) == n_rows
        and topk["topk_draft_ids"].shape == (n_rows, k)
        and rows == list(range(n_rows))
    ):  # every row sampled (a chain step): the columns as they are
        return {name: _as(col, _TOPK_DTYPES[name]) for name, col in topk.items()}
    ids = torch.full((n_rows, k), -1, dtype=torch.int64)
    tids = torch.full((n_rows, k), -1, dtype=torch.int64)
    lps = torch.full((n_rows, k), float("-inf"), dtype=torch.float32)
    lse = torch.full((n_rows,), float("nan"), dtype=torch.float32)
    if topk is not None and rows:
        at = torch.tensor(rows, dtype=torch.int64)
        kk = topk["topk_draft_ids"].shape[-1]
        for out, name in (
            (ids, "topk_draft_ids"),
            (tids, "topk_target_ids"),
            (lps, "topk_logprobs"),
        ):
            (out if kk == k else out[:, :kk]).index_copy_(0, at, _as(topk[name], out.dtype))
        lse.index_copy_(0, at, _as(topk["lse"], torch.float32))
    return {"topk_draft_ids": ids, "topk_target_ids": tids, "topk_logprobs": lps, "lse": lse}


_TOPK_DTYPES = {
    "topk_draft_ids": torch.int64,
    "topk_target_ids": torch.int64,
    "topk_logprobs": torch.float32,
    "lse": torch.float32,
}


def verify_probs(
    draft_ids: torch.Tensor,
    num_draft_tokens: list[int],
    raw_logits: torch.Tensor,
    pen_logit: torch.Tensor | None,
    proc_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: dict[str, torch.Tensor | None],
    rule: int,
    prompt_ids: torch.Tensor | None = None,
    output_ids: list[list[int]] | None = None,
) -> VerifyProbs:
    """What one verify's rule used, as columns over the batch. `raw_logits` and
    `proc_logits` are the target's rows at the drafted positions before and after the
    engine's transforms ([N, V], N = sum(num_draft_tokens)); `raw_logits` may instead be the
    raw logit at each drafted token ([N], taken as the gathers below take it: all the columns
    need of the raw rows, where no transform reran on them); `pen_logit` the logit at each
    drafted token after the penalties ([N]; None: no transform, the raw logit); `params` the
    per-request sampling tensors ([B] or None); `prompt_ids` ([B, P], padded with V) and
    `output_ids` the history the engine's penalties count (None when it applies none)."""
    ids = draft_ids.reshape(-1, 1)
    n_req, n_tok = len(num_draft_tokens), int(ids.shape[0])
    if sum(num_draft_tokens) != n_tok:
        raise ValueError(f"{n_tok} drafted tokens for num_draft_tokens {num_draft_tokens}")
    # computed where the rows are (CUDA rows are never copied whole); columns end on the CPU
    dev = raw_logits.device
    safe = _on(ids, dev)
    safe = safe if safe.dtype is torch.int64 else safe.long()
    raw, proc = _f32(raw_logits), _f32(_on(proc_logits, dev))
    at_token = raw.dim() == 1  # the raw logit at each token, taken already
    vocab = proc.shape[-1]
    # CPU rows: the gathers, p and argmax in one native call (tapmath; it clamps the same way)
    native = tapmath.verify_into(proc, proc if at_token else raw, safe.view(-1)) if n_tok else None
    if native is not None:
        p, zp, z, argmax = native
        if at_token:
            z = raw
    else:
        safe = safe.clamp(0, vocab - 1)
        z = raw.reshape(-1) if at_token else raw.gather(1, safe).view(-1)
        zp = proc.gather(1, safe).view(-1)
        # p(token) = exp(z - logsumexp(z)): the softmax row itself is never needed (a
        # full-vocab softmax per verify was the tap thread's costliest call)
        p = (zp - torch.logsumexp(proc, dim=-1)).exp_()
        argmax = proc.argmax(dim=-1)
    if draft_probs is None:
        q = filled(n_tok, 1.0, torch.float32)
    else:
        at = safe.clamp(0, vocab - 1)
        q = _f32(_on(draft_probs, dev)).gather(1, at).view(-1)
    pen = z if pen_logit is None else _as(pen_logit, torch.float32)
    tok = {
        "p_target": _as(p, torch.float32),
        "q_draft": _as(q, torch.float32),
        "logit_raw": _as(z, torch.float32),
        "logit_pen": pen if pen.dim() == 1 else pen.reshape(-1),
        "logit_proc": _as(zp, torch.float32),
        "target_argmax": _as(argmax, torch.int64),
    }
    if prompt_ids is not None and output_ids is not None:
        flat = ids.reshape(-1).tolist()
        seen, n_out, start = [], [], 0
        for i, n in enumerate(num_draft_tokens):
            toks = flat[start : start + n]
            prompt = set(prompt_ids[i].tolist()) if n else set()
            hist = list(output_ids[i]) if i < len(output_ids) else []
            seen += [int(t in prompt) for t in toks]
            n_out += [hist.count(t) for t in toks]
            start += n
        tok["seen_prompt"] = torch.tensor(seen, dtype=torch.int64)
        tok["n_out"] = torch.tensor(n_out, dtype=torch.int64)
    else:  # one column of -1 for both (the writer only reads it)
        tok["seen_prompt"] = tok["n_out"] = filled(n_tok, -1, torch.int64)
    req: dict[str, torch.Tensor] = {"rule": filled(n_req, rule, torch.int64)}  # first column
    unknown = None
    for name in SAMPLING_PARAMS:
        value = params.get(name)
        if value is None:  # one column of NaN for every parameter not in force
            if unknown is None:
                unknown = filled(n_req, float("nan"), torch.float32)
            req[name] = unknown
            continue
        value = _as(value, torch.float32)
        if value.dim() != 1:
            value = value.reshape(-1)
        if value.shape[0] != n_req:
            if value.shape[0] < n_req:
                raise ValueError(f"{name}: {value.shape[0]} values for {n_req} requests")
            value = value[:n_req]
        req[name] = value
    # a request at temperature 0 is judged greedily, whatever the batch's rule
    if params.get("temperature") is not None and rule not in (RULE_SYNTHETIC, RULE_GREEDY):
        at_zero = req["temperature"] < 1e-5
        req["rule"] = torch.full((n_req,), rule, dtype=torch.int64).masked_fill_(
            at_zero, RULE_GREEDY
        )
    return VerifyProbs(list(num_draft_tokens), req, tok)


def _verify_sampling_columns(
    step: Step, members: list[int]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The rule columns of a verify: per request (`rule`, the sampling parameters) and per
    drafted token; NaN / -1 where the sampler was not tapped, or tapped another batch (the
    columns are always there: a trace's columns are fixed by its first write)."""
    probs = step.verify_probs
    if probs is not None and probs.num_draft_tokens == list(step.num_draft_tokens):
        chosen = probs.select(members)
        return chosen.req, chosen.tok
    n_req, n_tok = len(members), sum(step.num_draft_tokens[i] for i in members)
    req = {"rule": torch.full((n_req,), -1, dtype=torch.int64)}
    req |= {k: torch.full((n_req,), float("nan")) for k in SAMPLING_PARAMS}
    tok = {k: torch.full((n_tok,), float("nan")) for k in PROPOSED_FLOAT}
    tok |= {k: torch.full((n_tok,), -1, dtype=torch.int64) for k in PROPOSED_INT}
    return req, tok


def new_request(nr: Any) -> NewRequest:
    """A `NewRequest` from vLLM's `NewRequestData` (V1 and V2 schedulers): its id, prompt,
    prefix-cache hit and the `SamplingParams` the engine resolved for it (the API server has
    merged the request's fields with the model's generation-config defaults by then)."""
    return NewRequest(
        str(nr.req_id),
        list(nr.prompt_token_ids or []),
        int(nr.num_computed_tokens),
        sampling_row(getattr(nr, "sampling_params", None)),
    )


def restrict(step: Step, keep: list[int]) -> Step:
    """The step as if only the requests at batch indices `keep` had run (`record
    --sample-every K`: the others are not recorded). Every per-request piece is cut the same
    way: ids, drafts, sampled rows, the target rows and aux concat, the drafter's first pass
    (all target rows) and its chain passes (one row per request), and their top-k."""
    qs = step.query_start
    n_req = len(step.req_ids)
    if keep == list(range(n_req)):
        return step
    starts = [0]
    for n in step.num_draft_tokens:
        starts.append(starts[-1] + n)
    drafts = None
    if step.draft_token_ids is not None:
        drafts = torch.cat(
            [step.draft_token_ids[starts[i] : starts[i + 1]] for i in keep]
            or [step.draft_token_ids[:0]]
        )
    out = Step(
        req_ids=[step.req_ids[i] for i in keep],
        num_draft_tokens=[step.num_draft_tokens[i] for i in keep],
        new_requests=step.new_requests,  # already only the kept ones (the hooks choose)
        draft_token_ids=drafts,
        sampled=[sampled[i] for i in keep] if (sampled := sampled_rows(step)) is not None else None,
        verify_probs=step.verify_probs.select(keep) if step.verify_probs is not None else None,
    )
    if qs is None or step.target_ids is None:
        return out
    rows = _rows_of(step, keep)
    new_qs = [0]
    for i in keep:
        new_qs.append(new_qs[-1] + qs[i + 1] - qs[i])
    out.query_start = new_qs
    out.target_ids = step.target_ids.index_select(0, rows.to(step.target_ids.device))
    if step.target_positions is not None:
        out.target_positions = step.target_positions.index_select(
            -1, rows.to(step.target_positions.device)
        )
    if step.target_aux is not None:
        out.target_aux = step.target_aux.index_select(0, rows.to(step.target_aux.device))
    if step.sample_rows is not None:
        out.sample_rows = [step.sample_rows[i] - qs[i] + new_qs[j] for j, i in enumerate(keep)]
    at = torch.tensor(keep, dtype=torch.int64)
    for k, call in enumerate(step.calls):
        # the first pass holds every target row; a chain pass one row per request
        sel = rows if k == 0 else at
        n_first = int(step.target_ids.shape[0])
        ids = call.input_ids[:n_first] if k == 0 else call.input_ids
        pos = call.positions[..., :n_first] if k == 0 else call.positions
        topk = None
        if call.topk is not None:  # one row per request in both passes
            topk = {c: v.index_select(0, at.to(v.device)) for c, v in call.topk.items()}
        out.calls.append(
            DraftCall(
                input_ids=ids.index_select(0, sel.to(ids.device)),
                positions=pos.index_select(-1, sel.to(pos.device)),
                hidden_in=None
                if call.hidden_in is None
                else call.hidden_in.index_select(0, at.to(call.hidden_in.device)),
                topk=topk,
            )
        )
    return out


def requests_rows(new: Sequence[NewRequest]) -> TableWrite | None:
    if not new:
        return None
    sampling = [r.sampling or sampling_row(None) for r in new]
    return requests_write(
        [r.rid for r in new], [r.prompt_ids for r in new], [r.n_cached for r in new], sampling
    )


def _rows_of(step: Step, members: list[int]) -> torch.Tensor:
    qs = step.query_start
    assert qs is not None
    return _ranges([(qs[i], qs[i + 1]) for i in members])


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _take(x: torch.Tensor, dim: int, spans: list[tuple[int, int]]) -> torch.Tensor:
    """The rows of `x` (along `dim`) in the half-open spans, in order: one slice when they
    follow each other (a decode batch: every request), else one `index_select`."""
    if all(spans[j][1] == spans[j + 1][0] for j in range(len(spans) - 1)) and spans:
        start, n = spans[0][0], spans[-1][1] - spans[0][0]
        return x if start == 0 and n == x.shape[dim] else x.narrow(dim, start, n)
    return x.index_select(dim, _ranges(spans).to(x.device))


def target_rows(
    step: Step, capture_layers: list[int] | None, convention: str | None = None
) -> list[TableWrite]:
    """The target forward of one step: prefill/extend chunks (mode 0), then verifies (mode 1),
    each at its true positions (a prefix-cache hit runs only the suffix). `convention` names
    what the captured state is when it is not HF `hidden_states[k]` (an MTP head is handed
    the target's forward output, e.g. before the final norm)."""
    qs = step.query_start
    assert qs is not None and step.target_ids is not None and step.target_positions is not None
    n_req = len(qs) - 1
    if n_req != len(step.req_ids):
        raise ValueError(f"{n_req} request blocks for {len(step.req_ids)} request ids")
    n_tok = int(step.target_ids.shape[0])
    if qs[-1] != n_tok:  # only the padded drafter batch keeps every scheduled row
        raise ValueError(
            f"proposer got {n_tok} target rows for {qs[-1]} scheduled tokens "
            "(disable_padded_drafter_batch is not supported)"
        )
    lens = [qs[i + 1] - qs[i] for i in range(n_req)]
    ndraft = step.num_draft_tokens or [0] * n_req
    aux = step.target_aux
    assert aux is not None
    attrs = None
    if capture_layers:
        attrs = {"tok/aux_hidden": aux_hidden_attrs(capture_layers, int(aux.shape[-1]), convention)}
    ids = _cast(step.target_ids, torch.int64)
    pos = _cast(step.target_positions, torch.int64)
    writes = []
    for mode in (0, 1):
        members = [i for i in range(n_req) if (ndraft[i] > 0) == (mode == 1)]
        if not members:
            continue
        spans = [(qs[i], qs[i + 1]) for i in members]
        writes.append(
            TableWrite(
                "target",
                step={"mode": mode},
                req={
                    "req_key": step.keys(members),
                    "n_tok": _counts([lens[i] for i in members]),
                },
                tok={
                    "input_ids": _take(ids, 0, spans),
                    "positions": _contiguous(_take(pos, -1, spans)),
                    "aux_hidden": _take(aux, 0, spans),
                },
                column_attrs=attrs,
            )
        )
    return writes


def step_rows(step: Step, capture_layers: list[int] | None) -> list[TableWrite]:
    """All rows of one vLLM step, in engine order: new requests, the target forward, the
    verify outcome, the draft extend, the draft chain (the hooks write each group as its own
    tap; this is the same sequence in one call)."""
    writes: list[TableWrite] = []
    req = requests_rows(step.new_requests)
    if req is not None:
        writes.append(req)
    if step.target_ids is None or step.query_start is None:
        return writes
    qs = step.query_start
    writes.extend(target_rows(step, capture_layers))
    verifying = [i for i, n in enumerate(step.num_draft_tokens) if n > 0]
    if verifying:
        writes.append(verify_rows(step, verifying))
    writes.extend(draft_rows(step, [qs[i + 1] - qs[i] for i in range(len(qs) - 1)]))
    return writes


def sampled_rows(step: Step) -> list[list[int]] | None:
    """The step's sampled rows as lists (`Step.sampled` may hold the runner's tensor)."""
    s = step.sampled
    return s.tolist() if isinstance(s, torch.Tensor) else s


def verify_rows(step: Step, members: list[int]) -> TableWrite:
    """Accepted drafts per verified request from the runner's sampled rows: valid tokens are
    the accepted drafts then the bonus (the target's own next token); -1 pads the rest."""
    sampled = sampled_rows(step)
    assert sampled is not None and step.draft_token_ids is not None
    ndraft = step.num_draft_tokens
    starts = [0]
    for n in ndraft:
        starts.append(starts[-1] + n)
    accept, bonus, accepted = [], [], []
    for i in members:
        row = [t for t in sampled[i] if t != PLACEHOLDER]
        if not row:
            raise ValueError(f"request {step.req_ids[i]} has no sampled token after a verify")
        accept.append(len(row) - 1)
        bonus.append(row[-1])
        accepted += row[:-1]
    drafts = _as(step.draft_token_ids, torch.int64)
    rule_req, rule_tok = _verify_sampling_columns(step, members)
    n_accepted = torch.tensor(accept, dtype=torch.int64)
    return TableWrite(
        "verify",
        req={
            "req_key": step.keys(members),
            "accept_len": n_accepted,
            "bonus_id": torch.tensor(bonus, dtype=torch.int64),
            "n_proposed": _counts([ndraft[i] for i in members]),
            "n_accepted": n_accepted,
            **rule_req,
        },
        other={
            "proposed": {
                "ids": _take(drafts, 0, [(starts[i], starts[i + 1]) for i in members]),
                **rule_tok,
            },
            "accepted": {"ids": torch.tensor(accepted, dtype=torch.int64)},
        },
    )


def draft_rows(step: Step, lens: list[int]) -> list[TableWrite]:
    """The first drafter pass (every target row: ids shifted by one with the next token at the
    sampled row, the target's positions, the aux concat before fc) and the K-1 chain steps."""
    if not step.calls:
        return []
    keys = step.keys()
    n_tok = int(step.target_ids.shape[0])  # type: ignore[union-attr]
    first = step.calls[0]
    sample_rows = step.sample_rows or []
    ext = TableWrite(
        "draft_extend",
        req={"req_key": keys, "n_tok": _counts(lens)},
        tok={
            "input_ids": _cast(_first(first.input_ids, n_tok), torch.int64),
            "positions": _cast(_first(first.positions, n_tok), torch.int64),
            "hidden_in": step.target_aux,
            **(
                first.topk
                if first.expanded and first.topk is not None
                else _expand_topk(first.topk, n_tok, sample_rows, TOPK)
            ),
        },
    )
    out = [ext]
    batch = len(step.req_ids)
    every, ones = list(range(batch)), filled(batch, 1, torch.int64)
    for k, call in enumerate(step.calls[1:], start=1):
        topk = _expand_topk(call.topk, batch, every, TOPK)
        out.append(
            TableWrite(
                "draft_step",
                step={"step_index": k},
                req={"req_key": keys, "n_tok": ones},
                tok={
                    "input_ids": _cast(_first(call.input_ids, batch), torch.int64),
                    "positions": _cast(_first(call.positions, batch), torch.int64),
                    "hidden_in": _first(call.hidden_in, batch)
                    if call.hidden_in is not None
                    else None,
                    **topk,
                },
            )
        )
    return out
