"""The wrappers hstrace puts around vLLM functions inside its processes (V1 model runner;
Model Runner V2 of 0.33+ at the end: tapped, not run here).

Patch points come from `hstrace.engines.vllm.versions` (chosen by the installed version); row
building is pure (`hstrace.engines.vllm.taps`, `hstrace.engines.vllm.audit`); the recorder,
status protocol and patching machinery are shared with SGLang (`hstrace.hooks.common`).
This module only wires. A tap that raises is disabled, recorded with `note_error`, and vLLM
returns its own result. All wrappers sit at Python function boundaries outside the compiled
region (the drafter's outer `Eagle3LlamaForCausalLM`, not its compiled `LlamaModel`).

One vLLM step = one `GPUModelRunner.propose_draft_token_ids` call: the wrapper opens a
`Step`, the proposer/drafter wrappers fill it while the original runs, and the rows are
written when it returns.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hstrace.hooks import control, load_weights
from hstrace.hooks.common import Recorder, bind_args, install_points

from hstrace.engines import load_audit, protocol, tapmath
from hstrace.engines.rows import TableWrite
from hstrace.engines.support import Version
from hstrace.engines.vllm import audit, taps, taps_v2
from hstrace.engines.vllm.versions import SUPPORT
from hstrace.findings import from_fact
from hstrace.trace.schema import NO_PENALTY


class VLLMRecorder(Recorder):
    # protocol.WORK_LEVELS, all of them, in V1's wrappers (a V2 runner's process: rows only)
    WORK_LEVELS: tuple[str, ...] = tuple(protocol.WORK_LEVELS)
    # V1's step wrapper hands a CPU step to the tap thread: it may be held (`hold_mb`); a
    # V2 runner's process and a CUDA step build their rows as they run (`wrap_v2_load_model`,
    # the wrapper's inline branch, which says so in the trace's errors, as `hold`)
    HOLDS = True

    def __init__(self, cfg: dict[str, Any], version: Version) -> None:
        super().__init__(cfg, version)
        self.seen_rids: set[str] = set()
        # vLLM's aux ids, sorted (= HF hidden_states indices): the `aux_hidden` layer_ids.
        self.capture_layers: list[int] | None = None
        self.capture_convention: str | None = None  # MTP: not an HF hidden_states index
        self.mtp_load: Any = None  # the MTP head's WeightsAudit (load_weights tap)
        self.current: taps.Step | None = None  # the step being collected
        self.collecting = False  # inside the proposer: drafter calls belong to the step
        # the rejection sampler's rule inputs of this step's verify (it runs before the
        # proposer; `_begin_step` takes them)
        # (metadata, the verify's rows, or the function that builds them on the tap thread)
        self.pending_verify: tuple[Any, Any] | None = None
        # `record --sample-every K`: one request in K is recorded (the K-th seen, counting
        # from the first); a step with none of them costs only this membership check
        self.sample_every = max(1, int(cfg.get("sample_every") or 1))
        self.admitted = 0
        self.kept: set[str] = set()
        self.keep_at: list[int] | None = None  # batch indices of kept requests in this step

    def admit(self, rid: str) -> bool:
        """Whether a request seen for the first time is recorded."""
        keep = self.admitted % self.sample_every == 0
        self.admitted += 1
        if keep:
            self.kept.add(rid)
        return keep

    def on_arm(self) -> None:
        self.seen_rids = set()  # a new session's trace gets its own requests table


REC: VLLMRecorder | None = None


def _tolist(x: Any) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)


# The serving thread's copies: each torch call there costs the step 0.3-2 us on this host warm
# and up to 10-30 us cold (a no-op `.detach()`, `.to()` or `.float()` included), so calls that
# change nothing are not made. A copy that replaces several torch calls is bytes in one native
# call (`tapmath.gather_rows`, `snapshot_head`), made a tensor on the tap thread; a plain clone
# stays a clone: made a tensor there instead, each cost the tap thread more than the serving
# thread saved (bench/README.md, nineteenth pass). tests/test_vllm_verify_snapshot.py holds the
# copies to the engine's values.
def _copy(t: Any) -> Any:
    """A copy of `t` that the engine's later writes cannot reach (vLLM runs in inference
    mode: nothing requires grad, so no `.detach()` first)."""
    return t.detach().clone() if t.requires_grad else t.clone()


def _stack_params(values: list[Any], n: int) -> Any:
    """The per-request sampling tensors (each [B] or longer, any dtype) as one float32 [P, n]
    copy on the CPU: vLLM updates its persistent batch in place. One `stack` (it promotes the
    dtypes) where every tensor is already 1-D of n rows."""
    import torch

    rows = [v if v.dim() == 1 and v.shape[0] == n else v.reshape(-1)[:n] for v in values]
    stacked = torch.stack(rows)
    if stacked.dtype is not torch.float32:
        stacked = stacked.float()
    return stacked if stacked.is_cpu else stacked.cpu()


def _param_copies(values: list[Any], n: int) -> Any:
    """The per-request sampling tensors' first n values, copied: one `tapmath.Snap` each
    where every one is a contiguous 1-D CPU tensor of n values or more (a native call each;
    float32 on the tap thread, `_param_columns`), else `_stack_params`' one stack."""
    snaps = []
    for v in values:
        snap = tapmath.snapshot_head(v, n)
        if snap is None:
            return _stack_params(values, n)
        snaps.append(snap)
    return snaps


def _param_columns(kept: Any) -> Any:
    """`_param_copies`' copies as float32 [n] columns, in order."""
    if type(kept) is list:
        return [_float(tapmath.tensor_of(s)) for s in kept]
    return kept.unbind(0)


# ---- per step -------------------------------------------------------------------------------


def _new_requests(rec: VLLMRecorder, scheduler_output: Any) -> list[taps.NewRequest]:
    """The requests scheduled for the first time that are recorded (all, unless
    --sample-every); finished ones leave the kept set."""
    new = []
    for nr in getattr(scheduler_output, "scheduled_new_reqs", None) or []:
        rid = str(nr.req_id)
        if rid in rec.seen_rids:
            continue
        rec.seen_rids.add(rid)
        if rec.admit(rid):
            new.append(taps.new_request(nr))
    if rec.sample_every > 1:
        for rid in getattr(scheduler_output, "finished_req_ids", None) or ():
            rec.kept.discard(str(rid))
    return new


def _on_host(t: Any) -> Any:
    """`t` on the CPU (itself when it is there: vLLM builds the step's drafts afresh)."""
    return t if t.is_cpu else t.detach().cpu()


def _begin_step(rec: VLLMRecorder, runner: Any, a: dict[str, Any]) -> taps.Step | None:
    batch = runner.input_batch
    req_ids = [str(r) for r in list(batch.req_ids)[: batch.num_reqs]]
    new = _new_requests(rec, a["scheduler_output"])
    rec.keep_at = None
    if rec.sample_every > 1:
        keep = [i for i, r in enumerate(req_ids) if r in rec.kept]
        if not keep:
            return None  # no recorded request in this step: nothing copied
        rec.keep_at = keep
    rec.step_requests((n.rid for n in new), req_ids)
    meta = a.get("spec_decode_metadata")
    ndraft = [int(n) for n in meta.num_draft_tokens] if meta is not None else [0] * len(req_ids)
    sampled = a.get("sampled_token_ids")
    pending, rec.pending_verify = rec.pending_verify, None
    # the sampler's rows are this step's only if it verified this step's drafts (the same
    # SpecDecodeMetadata object reaches both)
    probs = pending[1] if pending is not None and pending[0] is meta else None
    return taps.Step(
        req_ids=req_ids,
        num_draft_tokens=ndraft,
        new_requests=new or (),
        draft_token_ids=_on_host(meta.draft_token_ids) if meta is not None else None,
        sampled=_sampled_copy(sampled),
        verify_probs=probs,
    )


def _sampled_copy(sampled: Any) -> Any:
    """The runner's sampled rows, copied: a tensor as one clone (one object for a held step
    to keep; lists on the tap thread, `taps.sampled_rows`), lists as lists."""
    if sampled is None:
        return None
    if hasattr(sampled, "clone"):
        return _copy(sampled)
    return [list(r) for r in sampled]


_NOW: Any = object()


def _emit_step(rec: VLLMRecorder, step: taps.Step, keep_at: Any = _NOW) -> None:
    """Each table group is its own tap: one that fails is disabled, the others go on. Runs on
    the recorder's tap thread (`Recorder.defer`): the top-k, the rows and the staging copy,
    in stages, giving way to the engine's next step between them (`Recorder.make_way`).
    `keep_at`: the batch indices kept by --sample-every, as they were when the step began
    (the serving thread has moved on by now); default: the recorder's current ones."""
    if callable(step.verify_probs):  # the verify's rows, built here (the step carried them)
        # first a yield: woken at the step's end, this thread would otherwise start its first
        # stage while vLLM's worker still sends the step's output
        rec.make_way_within()
        step.verify_probs = step.verify_probs(rec.make_way_within)
        rec.make_way()
    keep = rec.keep_at if keep_at is _NOW else keep_at
    # with no --sample-every cut to follow, the first call's rows land in its extend's rows
    rec.run_tap(
        "draft", lambda: taps.finish_topk(step, expand=keep is None, between=rec.make_way_within)
    )
    if keep is not None:
        cut = rec.run_tap("step", lambda: taps.restrict(step, keep))
        if cut is None:
            return
        step = cut
    new = taps.requests_rows(step.new_requests)
    if new is not None:
        rec.run_tap("requests", lambda: rec.emit([new]))
    if step.target_ids is None or step.query_start is None:
        return  # the proposer did not run (e.g. inputs too long for the drafter)
    qs = step.query_start
    lens = [qs[i + 1] - qs[i] for i in range(len(qs) - 1)]
    rec.make_way()
    rec.run_tap(
        "target",
        lambda: _emit_built(
            rec, taps.target_rows(step, rec.capture_layers, rec.capture_convention)
        ),
    )
    verifying = [i for i, n in enumerate(step.num_draft_tokens) if n > 0]
    if verifying:
        rec.make_way()
        rec.run_tap("verify", lambda: _emit_built(rec, [taps.verify_rows(step, verifying)]))
    rec.make_way()
    rec.run_tap("draft", lambda: _emit_built(rec, taps.draft_rows(step, lens)))


def _emit_built(rec: VLLMRecorder, writes: list[TableWrite]) -> None:
    """A stage's rows, built, then staged table by table: the tap thread gives way before
    each table it records (`Recorder.make_way_within`), outside `Recorder.emit`'s lock."""
    for tw in writes:
        if tw.table in rec.streams:
            rec.make_way_within()
            rec.emit([tw])


def held_nbytes(step: taps.Step) -> int:
    """The bytes a step handed over holds until its rows are built (its tensors: the aux
    concat, the drafter calls' inputs and kept logits, the verify's snapshot: the target's
    rows at the drafted positions, raw and processed); what `hold_mb` counts."""
    n = 0
    for t in (
        step.target_ids,
        step.target_positions,
        step.target_aux,
        step.draft_token_ids,
        step.sampled if hasattr(step.sampled, "nbytes") else None,
    ):
        if t is not None:
            n += t.nbytes
    for c in step.calls:
        for t in (c.input_ids, c.positions, c.hidden_in, c.logits):
            if t is not None:
                n += t.nbytes
    for t in getattr(step.verify_probs, "holds", ()):  # the verify's snapshot (`_verify_tap`)
        if t is not None:
            n += len(t.buf) if type(t) is tapmath.Snap else t.nbytes
    return n


_NOT_HELD = (
    "hold_mb: steps not held, their rows built as they ran (CUDA tensors, or the bench's "
    "inline variant)"
)


def _on_cpu(step: taps.Step) -> bool:
    t = step.target_ids if step.target_ids is not None else step.draft_token_ids
    return t is None or not t.is_cuda


def wrap_propose_draft_token_ids(original: Callable) -> Callable:
    @functools.wraps(original)
    def propose_draft_token_ids(self, *args, **kwargs):
        rec = REC
        if rec is None or not rec.armed or "step" in rec.disabled:  # dormant: this check only
            return original(self, *args, **kwargs)
        if rec.work == "none":  # the bench's floor (protocol.WORK_LEVELS)
            return original(self, *args, **kwargs)
        rec.stepping = True  # a disarm waits for this step to be handed over
        try:
            rec.current = rec.run_tap(
                "step", lambda: _begin_step(rec, self, bind_args(original, (self, *args), kwargs))
            )
            try:
                result = original(self, *args, **kwargs)
            finally:
                step, rec.current, rec.collecting = rec.current, None, False
            if step is None or rec.work == "collect":  # the bench's: dropped here
                pass
            elif rec.work == "handover":  # the bench's: the tap thread wakes and drops it
                rec.defer(lambda: step)
            elif rec.tap_thread and _on_cpu(step):  # the rest off this thread
                keep = rec.keep_at
                held = held_nbytes(step) if rec.hold_bytes is not None else 0
                # a partial, not a closure: fewer objects for a held step to keep alive
                rec.defer(functools.partial(_emit_step, rec, step, keep), held)
            else:  # CUDA: another thread's stream would not wait for the
                if rec.hold_bytes is not None:  # copies queued on this one (unverified
                    rec.hold_bytes = rec._hold_limit = None  # without a GPU): nothing is held,
                    if not rec._hold_auto:  # and, where the hold was asked for, the
                        rec.note_error("hold", _NOT_HELD)  # session's trace says so, once
                _emit_step(rec, step)
        finally:
            rec.stepping = False
        return result

    return propose_draft_token_ids


def _step_ended() -> None:
    """The engine's step has ended: told to the recorder while its cues run (armed, or a held
    session's drain waits for a quiet server)."""
    rec = REC
    if rec is not None and rec.cued:
        rec.step_ended()


def wrap_sample_tokens(original: Callable) -> Callable:
    """V1 `GPUModelRunner.sample_tokens` (sampling, then the drafts, then bookkeeping): its
    return is the step's end: the step handed over mid-step, held until now, is queued to the
    tap thread (`Recorder.paced`), which wakes once a step. Started at the hand-over instead,
    the tap thread's Python took the GIL from the bookkeeping; woken there to wait, it cost the
    step 0.03-0.04 ms (bench/step_segments.py); started at the next forward, it took the GIL
    from the forward (bench/live_overhead.py, bench/README.md)."""
    rec = REC
    if rec is not None:
        rec.paced = True  # the cue will come

    @functools.wraps(original)
    def sample_tokens(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            _step_ended()

    return sample_tokens


def wrap_execute_model(original: Callable) -> Callable:
    """V1 `GPUModelRunner.execute_model` (the step's start: the target's forward, then the
    sampling and the drafts in `sample_tokens`): the writer process is told the step runs
    (`Recorder.step_started`) and keeps its work out of the gap that follows `sample_tokens`,
    where vLLM's engine core, on the writer's core, schedules the next step; the tap thread
    leaves the rest of a step's rows for the gap after it (`Recorder.make_way`). A call that
    returns its output itself ends the step there (None means `sample_tokens` follows; vLLM
    0.32.0 returns `EMPTY_MODEL_RUNNER_OUTPUT` for a step with no token scheduled, which its
    engine core sends after requests finish, to clear them: `Scheduler.has_requests`): its
    end is told, or the tap thread would wait out `GAP_WAIT_S` at each give-way for an end
    that never comes (seen live, bench/README.md, twenty-seventh pass). A call that raises
    ends the step too."""

    @functools.wraps(original)
    def execute_model(self, *args, **kwargs):
        rec = REC
        if rec is not None and rec.cued:  # armed, or a held session's drain waits
            rec.step_started()
        try:
            out = original(self, *args, **kwargs)
        except BaseException:  # the step ended there: told, or a held session would wait
            _step_ended()  # for a quiet server that never comes (`Recorder._quiet_for`)
            raise
        if out is not None:  # as `sample_tokens` (a disarm since opened the gap itself,
            _step_ended()  # and its drain is not this thread's)
        return out

    return execute_model


SPEC_METHODS = ("eagle3", "mtp")  # the proposer methods recorded (same machinery)


def _fill_from_proposer(step: taps.Step, a: dict[str, Any], method: str) -> None:
    n = int(a["target_token_ids"].shape[0])
    cad = a["common_attn_metadata"]
    qs = [int(x) for x in _tolist(cad.query_start_loc_cpu)]
    tis = a.get("token_indices_to_sample")
    step.target_ids = _copy(a["target_token_ids"])  # views of runner buffers ([n] rows)
    pos = a["target_positions"]
    step.target_positions = _copy(pos if pos.shape[-1] == n else pos[..., :n])
    hidden = a["target_hidden_states"]
    # EAGLE-3: a fresh torch.cat, not reused by vLLM; MTP: a view of the target's output
    step.target_aux = _copy(hidden) if method == "mtp" else hidden
    step.query_start = qs
    step.sample_rows = (
        [int(x) for x in _tolist(tis)] if tis is not None else [q - 1 for q in qs[1:]]
    )


def wrap_propose(original: Callable) -> Callable:
    @functools.wraps(original)
    def propose(self, *args, **kwargs):
        rec = REC
        step = rec.current if rec is not None else None
        method = getattr(self, "method", None)
        if step is None or method not in SPEC_METHODS:
            return original(self, *args, **kwargs)
        rec.run_tap(
            "step",
            lambda: _fill_from_proposer(step, bind_args(original, (self, *args), kwargs), method),
        )
        rec.collecting = "step" not in rec.disabled
        try:
            return original(self, *args, **kwargs)
        finally:
            rec.collecting = False

    return propose


def wrap_drafter_forward(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(self, input_ids, positions, hidden_states, *args, **kwargs):
        rec = REC
        if rec is not None and rec.collecting and rec.current is not None:
            step = rec.current

            def tap():
                first = not step.calls  # the first pass gets fc(aux): recorded from propose
                step.calls.append(
                    taps.DraftCall(
                        input_ids=_copy(input_ids),
                        positions=_copy(positions),
                        # later passes read the proposer's reused buffer: copy it now
                        hidden_in=None if first else _copy(hidden_states),
                    )
                )

            rec.run_tap("draft", tap)
        return original(self, input_ids, positions, hidden_states, *args, **kwargs)

    return forward


def wrap_compute_logits(original: Callable) -> Callable:
    @functools.wraps(original)
    def compute_logits(self, hidden_states, *args, **kwargs):
        logits = original(self, hidden_states, *args, **kwargs)
        rec = REC
        if rec is not None and rec.collecting and rec.current is not None:
            step = rec.current

            def tap():
                last = step.calls[-1] if step.calls else None
                if last is None or last.topk is not None or last.logits is not None:
                    return
                d2t = getattr(self, "draft_id_to_target_id", None)
                if logits.is_cuda:  # an async kernel here (see propose_draft_token_ids)
                    last.topk = taps.draft_topk(logits.detach(), d2t)
                else:  # top-k off the serving thread (inference mode: nothing to detach)
                    last.logits = logits.detach() if logits.requires_grad else logits
                    last.d2t = d2t

            rec.run_tap("draft", tap)
        return logits

    return compute_logits


def _rule(sampler: Any, draft_probs: Any, sm: Any) -> int:
    if getattr(sampler, "synthetic_mode", False):
        return taps.RULE_SYNTHETIC
    if sm.all_greedy:
        return taps.RULE_GREEDY
    return taps.RULE_ONE_HOT if draft_probs is None else taps.RULE_DRAFT_PROBS


@dataclass(slots=True)
class _VerifyRows:
    """A verify's snapshot (`_verify_tap`) and, called (on the tap thread: `between` is its
    give-way inside), its batch columns (`taps.verify_probs`). One object, where a closure
    kept a cell for each name it read: a held step keeps it alive until the server is quiet,
    and the cyclic collector walks every object a held step keeps (bench/README.md,
    thirty-first pass)."""

    draft_ids: Any  # [N] the drafted ids (vLLM's, never written again)
    num_draft: list[int]  # per request
    raw: Any  # the target's raw logit at each drafted token [N], or its rows whole [N, V] where
    # vLLM's processors are rerun on them (`_raw_snapshot`; a `tapmath.Snap` or tensor)
    pen_logit: Any  # [N] the drafted ids' logits after vLLM's processors; None: the identity
    proc: Any  # the processed rows vLLM handed `rejection_sample`
    draft_probs: Any  # copied, or None (a one-hot draft)
    rule: int
    greedy: bool
    defaults: Any  # NO_PENALTY (a batch without penalties: its columns' values), or ()
    present: tuple[str, ...]  # the parameters in force, copied in `kept`
    kept: Any
    prompt_ids: Any  # the histories the penalties count (None without penalties)
    output_ids: Any

    @property
    def holds(self) -> tuple[Any, ...]:
        """The tensors it keeps (what `held_nbytes` counts)."""
        return (self.raw, self.proc, self.pen_logit, self.draft_probs, self.prompt_ids)

    def __call__(self, between: Callable[[], None] | None = None) -> taps.VerifyProbs:
        import torch

        n_req = len(self.num_draft)
        resolved = dict.fromkeys(taps.SAMPLING_PARAMS)
        if self.greedy:  # a greedy batch's temperature (0), filled in here
            resolved["temperature"] = taps.filled(n_req, 0.0, torch.float32)
        for name in self.defaults:  # a batch without penalties: the defaults vLLM used
            resolved[name] = taps.filled(n_req, NO_PENALTY[name], torch.float32)
        if self.kept is not None:
            resolved.update(zip(self.present, _param_columns(self.kept), strict=True))
        if between is not None:  # the tap thread gives way here too (`_emit_step`)
            between()
        return taps.verify_probs(  # pen_logit None: the identity, the raw logit
            self.draft_ids, self.num_draft, _float(tapmath.tensor_of(self.raw)), self.pen_logit,
            self.proc, self.draft_probs, resolved, self.rule, prompt_ids=self.prompt_ids,
            output_ids=self.output_ids,
        )  # fmt: skip


def _clamped(draft_ids: Any, vocab: int, device: Any) -> Any:
    """The drafted ids as gather indices [N, 1] into rows of `vocab`."""
    import torch

    return draft_ids.to(device=device, dtype=torch.int64).clamp(0, vocab - 1).reshape(-1, 1)


def _verify_tap(sampler: Any, a: dict[str, Any], raw: Any, proc: Any) -> _VerifyRows:
    """What the rule compared, snapshotted on the serving thread; returns the work that turns
    it into batch columns (`taps.verify_probs`: log-sum-exp, gathers, history counts), which
    runs on the tap thread on CPU. Snapshotted here: the target's raw logits (`raw`, a copy
    read before vLLM ran, `_raw_snapshot`: at each drafted token, or the drafted rows whole
    where vLLM's processors are rerun on them); after its penalties (its own
    `apply_logits_processors`, rerun on a copy now because it reads the batch's history and
    stateful processors, and only when the batch has penalties, bad words or allowed-token
    masks: otherwise it returns its input); the processed rows vLLM itself handed
    `rejection_sample` (`proc`, a per-step tensor vLLM drops after `forward`; never
    recomputed: its temperature expansion reads fresh memory on CPU); the draft's
    probabilities; the sampling parameters in force and the histories the penalties count,
    copied (vLLM updates its persistent batch in place). A batch without penalties
    (`no_penalties`) copies none of them: its columns are the defaults (`NO_PENALTY`), what the
    rule used."""
    meta, sm, draft_probs = a["metadata"], a["sampling_metadata"], a["draft_probs"]
    # vLLM builds the step's drafted ids afresh (an index of its input ids, or
    # `SpecDecodeMetadata.make_dummy`'s tensor) and never writes them again: no copy
    draft_ids = meta.draft_token_ids
    budget = _thinking_budget(sm)
    if _transforms(sm):  # here, now: vLLM's processors read its batch as it is
        raw = _float(tapmath.tensor_of(raw))
        if raw.dim() != 2:  # `_raw_snapshot` keeps the rows whole for this batch
            raise ValueError("the verify's raw rows were not kept for vLLM's processors")
        # vLLM's thinking budget is not rerun: it rewrites its own state as it applies
        rerun = sm if budget is None else dataclasses.replace(sm, thinking_budget_state_holder=None)
        pen_logit = _at_tokens(sampler.apply_logits_processors(raw.clone(), rerun, meta), draft_ids)
    elif budget is not None:  # the raw logit, but for the budget's requests (below)
        pen_logit = _at_tokens(_float(tapmath.tensor_of(raw)), draft_ids)
    else:
        pen_logit = None  # the identity: `verify_probs` takes the raw logit
    if budget is not None:  # its requests' logits after the processors: not recorded (NaN)
        pen_logit[_rows_of(budget, meta.num_draft_tokens)] = float("nan")
    greedy = sm.all_greedy
    temperature = None if greedy or sm.temperature is None else sm.temperature
    params = {  # a greedy batch's temperature (0) is filled in off this thread
        "temperature": temperature,
        "top_p": sm.top_p,
        "top_k": sm.top_k,
        "repetition_penalty": sm.repetition_penalties,
        "frequency_penalty": sm.frequency_penalties,
        "presence_penalty": sm.presence_penalties,
    }
    # a batch without penalties (`no_penalties`: no request holds another value; vLLM's
    # `apply_penalties` returns its input): the defaults, written off this thread; no copy
    defaults = NO_PENALTY if sm.no_penalties else ()
    for name in defaults:
        params[name] = None
    # a copy of every parameter in force (float32 [B] each, off this thread): vLLM updates
    # its batch in place
    present = tuple(k for k, v in params.items() if v is not None)
    num_draft = list(meta.num_draft_tokens)
    kept = _param_copies([params[k] for k in present], len(num_draft)) if present else None
    penalties = not sm.no_penalties and sm.prompt_token_ids is not None
    draft_probs = _copy(draft_probs) if draft_probs is not None else None
    return _VerifyRows(
        draft_ids=draft_ids,
        num_draft=num_draft,
        raw=raw,
        pen_logit=pen_logit,
        proc=proc,
        draft_probs=draft_probs,
        rule=_rule(sampler, draft_probs, sm),
        greedy=greedy,
        defaults=defaults,
        present=present,
        kept=kept,
        prompt_ids=sm.prompt_token_ids.cpu().clone() if penalties else None,
        output_ids=[list(h) for h in sm.output_token_ids] if penalties else None,
    )


def _at_tokens(logits: Any, draft_ids: Any) -> Any:
    """A fresh [N] tensor of the logit at each drafted token: of rows [N, V] (gathered, the ids
    clamped), or of the values [N] already taken (copied)."""
    if logits.dim() == 1:
        return logits.clone()
    return logits.gather(1, _clamped(draft_ids, logits.shape[-1], logits.device)).reshape(-1)


def _transforms(sm: Any) -> bool:
    """vLLM's logits processors that hstrace reruns on a copy of the raw rows change the
    verify's rows this step: penalties, bad words, an allowed-token mask, or min_tokens (a
    request short of its `min_tokens`: its stop tokens masked). Otherwise vLLM's
    `apply_logits_processors` returns its input, but for a thinking budget (`_thinking_budget`,
    not rerun)."""
    return (
        not sm.no_penalties
        or bool(sm.bad_words_token_ids)
        or sm.allowed_token_ids_mask is not None
        or _min_tokens(sm)
    )


def _min_tokens(sm: Any) -> bool:
    """A request of the batch is short of its `min_tokens` and has stop tokens: vLLM 0.32's
    `MinTokensLogitsProcessor.apply_with_spec_decode` masks them in the verify's rows (it
    reads its own per-request state and writes only the rows it is given: rerun on a copy)."""
    procs = getattr(getattr(sm, "logitsprocs", None), "non_argmax_invariant", ())
    for p in procs:  # vLLM's own test: isinstance
        if isinstance(p, _min_tokens_class()) and any(e[2] for e in p.min_toks.values()):
            return True
    return False


@functools.cache
def _min_tokens_class() -> type:
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    return MinTokensLogitsProcessor


def _thinking_budget(sm: Any) -> Any:
    """The requests a thinking budget tracks this step (vLLM's
    `ThinkingBudgetStateHolder.apply_to_logits`, which forces the end-of-thinking token in
    their rows), or None. hstrace does not rerun it: it updates the holder's own state as it
    applies. Their rows' logits after the processors are recorded as not known (NaN), and the
    replay leaves them unjudged. Which requests: the holder's per-request state where it can
    be read (`_state`, keyed by the batch index), else every request (`_ALL`)."""
    holder = getattr(sm, "thinking_budget_state_holder", None)
    if holder is None or not holder.has_tracked_requests():
        return None
    state = getattr(holder, "_state", None)
    return tuple(state) if isinstance(state, dict) else _ALL


_ALL = "all"  # every request of the batch (`_thinking_budget`)


def _rows_of(requests: Any, num_draft: list[int]) -> Any:
    """The drafted tokens' rows of `requests` (batch indices, or `_ALL`), as a bool mask [N]."""
    import torch

    counts = torch.tensor(list(num_draft), dtype=torch.int64)
    owner = torch.arange(len(counts)).repeat_interleave(counts)
    if requests == _ALL:
        return torch.ones_like(owner, dtype=torch.bool)
    return torch.isin(owner, torch.tensor(list(requests), dtype=torch.int64))


def _raw_snapshot(logits: Any, meta: Any, sm: Any) -> Any:
    """What the verify's columns need of the target's raw rows, copied before vLLM runs (it may
    update `logits` in place): the raw logit at each drafted token, N values in one native call
    (`tapmath.gather_at`, the ids clamped as the columns' gathers clamp them), where the rows
    whole were N rows of the vocabulary; the drafted rows whole (`_raw_rows`) where vLLM's
    processors are rerun on them (`_transforms`) or the native call does not take the inputs
    (a device, HSTRACE_NATIVE=0): bench/README.md, thirty-second pass."""
    at = meta.target_logits_indices
    if not _transforms(sm):
        z = tapmath.gather_at(logits, at, meta.draft_token_ids)
        if z is not None:
            return z
    return _raw_rows(logits, at)


def _float(t: Any) -> Any:
    import torch

    return t if t.dtype is torch.float32 else t.float()


def _raw_rows(logits: Any, at: Any) -> Any:
    """The target's rows at the drafted positions (`at`), copied before vLLM runs: their bytes
    in one native call (`tapmath.gather_rows`; float32 on the tap thread), else index_select,
    not advanced indexing (a parallel kernel: slow on a busy CPU). Either is a fresh copy, so
    nothing vLLM does to `logits` reaches it."""
    import torch

    raw = tapmath.gather_rows(logits, at)
    if raw is not None:
        return raw
    if at.dtype is not torch.int64 or at.device != logits.device:
        at = at.to(device=logits.device, dtype=torch.int64)
    return _float(logits.index_select(0, at))


# `rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
# draft_probs, target_logits, ...)`: the processed target rows are its sixth argument.
_TARGET_LOGITS_ARG = 5


class _VerifyRowsLater:
    """The verify's rows, built when called (with `between`: the tap thread's give-way inside
    them), as the verify tap: a failure disables it and is recorded. One object a step keeps
    (`_VerifyRows`' note)."""

    __slots__ = ("rec", "rows")

    def __init__(self, rec: VLLMRecorder, rows: Callable[..., taps.VerifyProbs]) -> None:
        self.rec, self.rows = rec, rows

    @property
    def holds(self) -> tuple[Any, ...]:
        return getattr(self.rows, "holds", ())

    def __call__(self, between: Callable[[], None] | None = None) -> taps.VerifyProbs | None:
        return self.rec.run_tap("verify_probs", lambda: self.rows(between))


def wrap_rejection_forward(original: Callable) -> Callable:
    """V1 `RejectionSampler.forward`: what the verify rule compares, kept for the step's verify
    rows (`_begin_step`). The raw rows are read before vLLM runs (it may update `logits` in
    place); the processed rows are the very tensor `forward` hands the module's
    `rejection_sample`, seen through a pass-through that stands in for that module global
    during this call only (vLLM's worker runs one step at a time)."""
    import sys

    module = sys.modules[original.__module__]

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        rec = REC
        if rec is None or not rec.armed or "verify_probs" in rec.disabled or rec.work == "none":
            return original(self, *args, **kwargs)
        a = bind_args(original, (self, *args), kwargs)
        seen: dict[str, Any] = {}

        def begin():
            seen["raw"] = _raw_snapshot(a["logits"], a["metadata"], a["sampling_metadata"])
            inner = module.rejection_sample

            def rejection_sample(*r_args, **r_kwargs):
                if len(r_args) > _TARGET_LOGITS_ARG:
                    seen["proc"] = r_args[_TARGET_LOGITS_ARG]
                else:
                    seen["proc"] = r_kwargs.get("target_logits")
                return inner(*r_args, **r_kwargs)

            seen["inner"] = inner
            module.rejection_sample = rejection_sample

        rec.run_tap("verify_probs", begin)
        try:
            return original(self, *args, **kwargs)
        finally:
            if "inner" in seen:
                module.rejection_sample = seen["inner"]
            rec.pending_verify = None
            if seen.get("proc") is not None:
                rows = rec.run_tap(
                    "verify_probs", lambda: _verify_tap(self, a, seen["raw"], seen["proc"])
                )
                if rows is not None:
                    # emitted on this thread: built now; else the step's own hand-over carries
                    # the work to the tap thread (`_emit_step`, which gives way inside it)
                    inline = not rec.tap_thread or seen["proc"].is_cuda
                    later = _VerifyRowsLater(rec, rows)
                    rec.pending_verify = (a["metadata"], later() if inline else later)

    return forward


# ---- static audit ---------------------------------------------------------------------------


def wrap_load_weights(original: Callable) -> Callable:
    """The shared load_weights audit (hstrace.engines.load_audit) with vLLM's `LOAD` spec."""
    return load_weights.wrap_load_weights(original, lambda: REC, audit.LOAD)


def wrap_mtp_load_weights(original: Callable) -> Callable:
    """The MTP head's load: the whole target checkpoint goes in, the head keeps its keys. The
    audit is kept on the recorder: the proposer's static tap adds the files vLLM never read."""

    def keep(rec: Any, _model: Any, wa: Any, _facts: Any) -> None:
        rec.mtp_load = wa

    return load_weights.wrap_load_weights(original, lambda: REC, audit.MTP_LOAD, keep)


def _aux_layers_tap(rec: VLLMRecorder, runner: Any, model_runner: str) -> None:
    """The target's capture layers and the aux-id audit, once the runner set them up (V1:
    `_setup_eagle3_aux_hidden_state_outputs`; V2: `load_model`)."""
    hf = runner.speculative_config.draft_model_config.hf_config
    n_layers = int(runner.model_config.get_total_num_hidden_layers())
    source = audit.aux_layer_source(hf.to_dict(), n_layers)
    model = runner.get_model()
    holder = getattr(model, "model", model)
    live = getattr(holder, "aux_hidden_state_layers", None)
    layers = list(live) if live else list(source["sorted_ids"] or [])
    rec.capture_layers = sorted(set(layers))
    rec.static(
        {
            "capture": {
                **audit.capture_record(layers, source),
                "target_class": type(model).__name__,
            },
            "aux_layers": source,
            "aux_layer_ids": source["read_by_vllm"],
            "runner": {
                "class": type(runner).__name__,
                "model_runner": model_runner,
                "bases": [c.__name__ for c in type(runner).__mro__[1:3]],
            },
        }
    )


def wrap_setup_aux(original: Callable) -> Callable:
    @functools.wraps(original)
    def _setup_eagle3_aux_hidden_state_outputs(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        rec = REC
        if rec is not None and getattr(self, "use_aux_hidden_state_outputs", False):
            rec.run_tap("aux_layers", lambda: _aux_layers_tap(rec, self, "v1"))
        return result

    return _setup_eagle3_aux_hidden_state_outputs


def _serving_static(proposer: Any, configured_in_checkpoint: int | None) -> dict[str, Any]:
    """What an EAGLE-3 and an MTP deployment record alike: the target, this rank's place in the
    tensor-parallel group and its shards of the drafter (`tp`), the speculation settings, the
    acceptance rule, the serving settings and the versions."""
    import torch

    vc = proposer.vllm_config
    spec = vc.speculative_config
    mc = vc.model_config
    settings = audit.spec_settings(None, int(spec.num_speculative_tokens))
    settings["configured_in_checkpoint"] = configured_in_checkpoint
    settings["method"] = spec.method
    return {
        "target": {
            "path": str(mc.model),
            "num_layers": int(mc.get_total_num_hidden_layers()),
            "hidden_size": int(mc.get_hidden_size()),
            "vocab_size": int(mc.get_vocab_size()),
            "dtype": str(mc.dtype).removeprefix("torch."),
        },
        "tp": _tp_static(proposer.model, spec),
        "spec": settings,
        "acceptance": audit.acceptance_setting(
            getattr(spec, "rejection_sample_method", None),
            getattr(spec, "synthetic_acceptance_rates", None),
            getattr(spec, "synthetic_acceptance_length", None),
        ),
        "serving": {
            "prefix_caching": bool(vc.cache_config.enable_prefix_caching),
            "chunked_prefill": bool(vc.scheduler_config.enable_chunked_prefill),
            "max_num_batched_tokens": int(vc.scheduler_config.max_num_batched_tokens),
            "padded_drafter_batch": not bool(getattr(spec, "disable_padded_drafter_batch", False)),
            "enforce_eager": bool(mc.enforce_eager),
            "compilation_mode": str(vc.compilation_config.mode),
            "device": str(proposer.device),
            "torch": str(torch.__version__),
        },
        "engine_version": ".".join(map(str, REC.version)) if REC is not None else None,
    }


def _proposer_static(proposer: Any, target_model: Any) -> dict[str, Any]:
    vc = proposer.vllm_config
    spec = vc.speculative_config
    dmc = spec.draft_model_config
    drafter_path = Path(str(dmc.model))
    on_disk = load_audit.read_config_json(drafter_path) if drafter_path.is_dir() else {}
    hf = dmc.hf_config
    served = hf.to_dict()
    model = proposer.model
    fmt = audit.config_format(on_disk)
    d2t = getattr(model, "draft_id_to_target_id", None)
    draft_vocab = int(getattr(hf, "draft_vocab_size", None) or hf.vocab_size)
    target_vocab = int(vc.model_config.get_vocab_size())
    inner = getattr(target_model, "model", target_model)
    target_embed = getattr(inner, "embed_tokens", None)
    return {
        **_serving_static(proposer, audit.configured_speculative_tokens(on_disk)),
        "drafter": {
            "path": str(dmc.model),
            "dialect": "speculators" if fmt == "speculators" else "specforge",
            "config_format": fmt,
            "architecture": (served.get("architectures") or [None])[0],
        },
        "draft_config": on_disk or served,
        "draft_config_served": {
            k: served.get(k)
            for k in (
                "architectures",
                "draft_vocab_size",
                "target_hidden_size",
                "eagle_aux_hidden_state_layer_ids",
                "eagle_config",
                *audit.NORM_FLAGS,
            )
        },
        "draft_class": type(model).__name__,
        "norm_flags": audit.norm_flags(on_disk, served),
        "d2t": audit.d2t_summary(
            None if d2t is None else d2t.detach().cpu().tolist(), draft_vocab, target_vocab
        ),
        "embed_head": {
            "has_own_embed_tokens": bool(getattr(model, "has_own_embed_tokens", False)),
            "embed_shared_with_target": target_embed is not None
            and getattr(model.model, "embed_tokens", None) is target_embed,
            "has_own_lm_head": bool(getattr(model, "has_own_lm_head", False)),
            "lm_head_shared_with_target": getattr(model, "lm_head", None) is not None
            and getattr(model, "lm_head", None) is getattr(target_model, "lm_head", None),
        },
        "checkpoint_sha256": load_audit.hash_checkpoint_files(drafter_path)
        if drafter_path.is_dir()
        else {},
    }


def _tp_static(model: Any, spec: Any) -> dict[str, Any]:
    """This rank's place in the tensor-parallel group, its shards of the drafter's embedding
    and head (`audit.tp_record`), and the draft TP size the speculative config settled on (0.32
    accepts 1 or the target's; the EAGLE proposer builds the drafter under the target's
    parallel config whatever it says: the head's `tp_size` is what was served). The rank and
    group size are the head's own (vLLM's vocab-parallel layers keep them)."""
    inner = getattr(model, "model", model)
    embed, head = getattr(inner, "embed_tokens", None), getattr(model, "lm_head", None)
    layer = head if getattr(head, "tp_size", None) is not None else embed
    rank = int(getattr(layer, "tp_rank", REC.rank() if REC is not None else 0))
    record = audit.tp_record(rank, int(getattr(layer, "tp_size", 1)), embed, head)
    record["draft_tensor_parallel_size_configured"] = getattr(
        spec, "draft_tensor_parallel_size", None
    )
    return record


def _mtp_static(rec: VLLMRecorder, proposer: Any, target_model: Any) -> dict[str, Any]:
    """The MTP deployment: method and resolved model type, heads vs drafts, scales, shared
    embedding/head, the capture (the target's output, one slot of width H)."""
    vc = proposer.vllm_config
    spec = vc.speculative_config
    dmc = spec.draft_model_config
    hf = dmc.hf_config
    mc = vc.model_config
    model = proposer.model
    inner = getattr(target_model, "model", target_model)
    n_layers = int(mc.get_total_num_hidden_layers())
    eff = int(spec.num_speculative_tokens)
    rec.capture_layers = [n_layers]
    rec.capture_convention = "mtp_target_output"
    path = Path(str(mc.model))
    mtp = audit.mtp_record(
        method=str(spec.method),
        model_type=getattr(hf, "model_type", None),
        architectures=list(getattr(hf, "architectures", None) or []),
        n_predict=getattr(hf, "num_nextn_predict_layers", None),
        num_speculative_tokens=eff,
        draft_class=type(model).__name__,
        target_class=type(target_model).__name__,
        target_layers=n_layers,
        parameters=[n for n, _ in model.named_parameters()],
        embed_shared=getattr(getattr(model, "model", None), "embed_tokens", None)
        is getattr(inner, "embed_tokens", object()),
        head_shared=getattr(model, "lm_head", None) is getattr(target_model, "lm_head", object()),
    )
    # weight files vLLM never opened: their keys are dropped MTP weights too
    loads: dict[str, Any] = {}
    unread = audit.unread_weight_files(path) if path.is_dir() else {}
    mtp["unread_files"] = {name: len(keys) for name, keys in unread.items()}
    if unread and rec.mtp_load is not None:
        wa = rec.mtp_load
        for name, keys in unread.items():
            for key in keys:
                wa.checkpoint_keys.setdefault(key, {"file": name, "read": False})
        facts = load_audit.weights_facts(wa, audit.MTP_LOAD)
        loads = {
            "weights": wa.to_static(),
            "findings_load": [from_fact(f).to_json() for f in facts],
        }
    return {
        **_serving_static(proposer, None),
        **loads,
        "mtp": mtp,
        "drafter": {
            "path": str(dmc.model),
            "dialect": "mtp",
            "config_format": "target",
            "architecture": (mtp["architectures"] or [None])[0],
        },
        "draft_class": mtp["draft_class"],
        "capture": {
            "layers_to_capture": [n_layers],
            "capture_order": [n_layers],
            "num_captures": 1,
            "layer_ids_source": "mtp: the target's forward output",
            "capture_convention": audit.MTP_CAPTURE_CONVENTION,
            "target_class": mtp["target_class"],
        },
        "embed_head": {
            "has_own_embed_tokens": not mtp["embed_shared_with_target"],
            "embed_shared_with_target": mtp["embed_shared_with_target"],
            "has_own_lm_head": not mtp["lm_head_shared_with_target"],
            "lm_head_shared_with_target": mtp["lm_head_shared_with_target"],
        },
        "checkpoint_sha256": load_audit.hash_checkpoint_files(path) if path.is_dir() else {},
    }


def wrap_proposer_load_model(original: Callable) -> Callable:
    @functools.wraps(original)
    def load_model(self, target_model, *args, **kwargs):
        result = original(self, target_model, *args, **kwargs)
        rec = REC
        method = getattr(self, "method", None)
        if rec is not None and method == "eagle3":
            rec.run_tap("proposer", lambda: rec.static(_proposer_static(self, target_model)))
        elif rec is not None and method == "mtp":
            rec.run_tap("proposer", lambda: rec.static(_mtp_static(rec, self, target_model)))
        return result

    return load_model


# ---- Model Runner V2 (0.33+; GPU only: row building tested on stand-ins, never run here) -----


def wrap_v2_propose(original: Callable) -> Callable:
    """`TargetDependentARSpeculator.propose`: the target rows of the step, then the drafter
    calls made inside it (eager mode only: a captured CUDA graph replays without Python)."""

    @functools.wraps(original)
    def propose(self, *args, **kwargs):
        rec = REC
        method = getattr(self, "method", None)
        if rec is None or not rec.armed or "step" in rec.disabled or method not in SPEC_METHODS:
            return original(self, *args, **kwargs)
        a = bind_args(original, (self, *args), kwargs)
        if a.get("dummy_run") or a.get("is_profile"):
            return original(self, *args, **kwargs)
        last = a.get("last_hidden_states") if method == "mtp" else None
        step = rec.run_tap(
            "step",
            lambda: taps_v2.target_step(a["input_batch"], a["aux_hidden_states"] or [], last),
        )
        rec.current, rec.collecting = step, step is not None
        try:
            return original(self, *args, **kwargs)
        finally:
            rec.current, rec.collecting = None, False
            if step is not None:
                taps.finish_topk(step)
                qs = step.query_start or [0]
                lens = [qs[i + 1] - qs[i] for i in range(len(qs) - 1)]
                rec.run_tap(
                    "target",
                    lambda: rec.emit(
                        taps.target_rows(step, rec.capture_layers, rec.capture_convention)
                    ),
                )
                rec.run_tap("draft", lambda: rec.emit(taps.draft_rows(step, lens)))

    return propose


def wrap_v2_load_model(original: Callable) -> Callable:
    """V2 `GPUModelRunner.load_model` sets the EAGLE-3 aux layers (and loads the speculator)."""

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        rec = REC
        if rec is not None:  # the V2 wrappers take no `work` level but a recording's
            rec.WORK_LEVELS = ("rows",)
            rec.HOLDS = False  # nor a hold: their rows are built as the step runs
        if rec is not None and getattr(self, "use_aux_hidden_state_outputs", False):
            rec.run_tap("aux_layers", lambda: _aux_layers_tap(rec, self, "v2"))
        return result

    return load_model


def wrap_v2_add_requests(original: Callable) -> Callable:
    """V2 `GPUModelRunner.add_requests`: the requests table (V1 reads it in the step wrapper)."""

    @functools.wraps(original)
    def add_requests(self, scheduler_output, *args, **kwargs):
        rec = REC
        if rec is not None and rec.armed:

            def tap():
                w = taps.requests_rows(_new_requests(rec, scheduler_output))
                if w is not None:
                    rec.emit([w])

            rec.run_tap("requests", tap)
        return original(self, scheduler_output, *args, **kwargs)

    return add_requests


def wrap_v2_rejection_sampler(original: Callable) -> Callable:
    """`RejectionSampler.__call__`: the verify outcome, from the sampler's own output."""

    @functools.wraps(original)
    def __call__(self, logits, input_batch, *args, **kwargs):
        out = original(self, logits, input_batch, *args, **kwargs)
        rec = REC
        if rec is not None and rec.armed:

            def tap():
                w = taps_v2.verify_rows(input_batch, out.sampled_token_ids, out.num_sampled)
                if w is not None:
                    rec.emit([w])

            rec.run_tap("verify", tap)
        return out

    return __call__


WRAPPERS: dict[str, Callable[[Callable], Callable]] = {
    # V2's runner is also called GPUModelRunner (vllm.v1.worker.gpu.model_runner); the V1
    # table patches neither of these two methods
    "GPUModelRunner.load_model": wrap_v2_load_model,
    "GPUModelRunner.add_requests": wrap_v2_add_requests,
    "TargetDependentARSpeculator.load_model": wrap_proposer_load_model,  # same attributes
    "TargetDependentARSpeculator.propose": wrap_v2_propose,
    "RejectionSampler.__call__": wrap_v2_rejection_sampler,
    "RejectionSampler.forward": wrap_rejection_forward,
    "Eagle3LlamaForCausalLM.load_weights": wrap_load_weights,
    "GPUModelRunner._setup_eagle3_aux_hidden_state_outputs": wrap_setup_aux,
    "SpecDecodeBaseProposer.load_model": wrap_proposer_load_model,
    "GPUModelRunner.propose_draft_token_ids": wrap_propose_draft_token_ids,
    "GPUModelRunner.sample_tokens": wrap_sample_tokens,
    "GPUModelRunner.execute_model": wrap_execute_model,
    "SpecDecodeBaseProposer.propose": wrap_propose,
    "Eagle3LlamaForCausalLM.forward": wrap_drafter_forward,
    "Eagle3LlamaForCausalLM.compute_logits": wrap_compute_logits,
    # the MTP head (same proposer, same step): its load, its forward per depth, its logits
    "MiMoMTP.load_weights": wrap_mtp_load_weights,
    "MiMoMTP.forward": wrap_drafter_forward,
    "MiMoMTP.compute_logits": wrap_compute_logits,
}


def install(version: Version, cfg: dict[str, Any]) -> VLLMRecorder:
    global REC
    REC = VLLMRecorder(cfg, version)
    install_points(SUPPORT.patch_points_for(version), WRAPPERS, REC)
    control.serve(REC, "vllm")  # a dormant server's control channel (none otherwise)
    return REC
