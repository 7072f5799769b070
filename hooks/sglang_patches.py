"""The wrappers hstrace puts around SGLang functions inside a serving process.

Patch points come from `hstrace.engines.sglang.versions` (chosen by the installed version); the
row building is pure (`hstrace.engines.sglang.taps`, `hstrace.engines.sglang.audit`). This
module only wires: intercept, hand the objects to the pure code, pass the rows to the rank's
`TraceWriter`. A tap that raises is disabled, recorded with `note_error`, and serving goes on.
All wrappers sit at Python function boundaries of workers (not nn.Module hooks), so they also
fire when the model runs inside CUDA graphs.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hstrace.hooks import common as hooks_common
from hstrace.hooks import control, load_weights

from hstrace.engines import load_audit, rows
from hstrace.engines.sglang import audit, taps
from hstrace.engines.sglang.versions import CAPTURE_TARGETS, SUPPORT
from hstrace.engines.support import PatchPoint, Version
from hstrace.findings import from_fact


class Recorder(hooks_common.Recorder):
    """SGLang's per-process state on top of the shared recorder (writer, static audit, status
    line, disabled taps: hstrace.hooks.common)."""

    def __init__(self, cfg: dict[str, Any], version: Version) -> None:
        super().__init__(cfg, version)
        self.skipped_internal = 0
        self.seen_rids: set[str] = set()
        self.hot_token_id: Any = None
        self.draft_step_index = 0
        self.spec_topk = 1
        # SGLang's `layers_to_capture` (= HF hidden_states indices), from the target's
        # `set_eagle3_layers_to_capture`: written as the `aux_hidden` column's `layer_ids`.
        self.capture_layers: list[int] | None = None
        self.capture_convention: str | None = None  # MTP: the target's output, not an HF index

    def on_arm(self) -> None:
        self.seen_rids = set()  # a new session's trace gets its own requests table
        self.skipped_internal = 0

    def close(self) -> None:
        if self._writer is not None and self.skipped_internal and not self.closed:
            self._writer.update_static({"skipped_health_check_steps": self.skipped_internal})
        super().close()

    def internal(self, rids: Any) -> bool:
        """A step that serves only SGLang's own health checks (`/health` generates one token
        from input_ids [0], rid `HEALTH_CHECK_...`, and only when the scheduler is idle, so it
        never shares a batch with traffic): not recorded, counted in static."""
        if not taps.all_health_checks(rids):
            return False
        self.skipped_internal += 1
        return True

    def emit(self, writes: list[taps.TableWrite]) -> None:
        for tw in writes:
            if tw.table == "target" and self.capture_layers and tw.column_attrs is None:
                width = int(tw.tok["aux_hidden"].shape[-1])
                col = rows.aux_hidden_attrs(self.capture_layers, width, self.capture_convention)
                tw.column_attrs = {"tok/aux_hidden": col}
        super().emit(writes)


REC: Recorder | None = None


# ---- the wrappers, one per patch point ------------------------------------------------------


def wrap_load_weights(original: Callable) -> Callable:
    """The shared load_weights audit (hstrace.engines.load_audit) with SGLang's `LOAD` spec;
    after the load, the draft's static record (`_audit_draft`)."""
    return load_weights.wrap_load_weights(original, lambda: REC, audit.LOAD, _audit_draft)


def wrap_mtp_load_weights(original: Callable) -> Callable:
    """The shared load_weights audit with SGLang's MTP spec (`MiMoMTP.load_weights` reads the
    whole target checkpoint); the MTP record itself is taken once the worker has both models
    (`_mtp_static`)."""
    return load_weights.wrap_load_weights(original, lambda: REC, audit.MTP_LOAD)


def _audit_draft(
    rec: Recorder, model: Any, wa: load_audit.WeightsAudit, weights_facts: list[Any]
) -> None:
    """The draft's static record once SGLang loaded it (the weights are recorded already)."""
    cfg = model.config
    raw = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    path = Path(str(getattr(cfg, "_name_or_path", "") or ""))
    on_disk = load_audit.read_config_json(path) if path.is_dir() else {}
    source = audit.aux_layer_source(on_disk or raw)
    fc = getattr(model.model, "fc", None)
    target_hidden = getattr(cfg, "target_hidden_size", None) or cfg.hidden_size
    num_aux = getattr(cfg, "num_aux_hidden_states", None) or len(
        source["read_by_sglang"] or [0, 0, 0]
    )
    hot = getattr(model, "hot_token_id", None)
    rec.hot_token_id = hot
    findings = [from_fact(f) for f in weights_facts + audit.aux_layer_facts(source, None)]
    rec.static(
        {
            "draft_config": on_disk or raw,
            "draft_class": type(model).__name__,
            "aux_layers": source,
            "aux_layer_ids": source["read_by_sglang"],
            "fc_width": audit.fc_width(fc.in_features, target_hidden, num_aux)
            if fc is not None
            else None,
            "hot_token_id": None
            if hot is None
            else {
                "size": int(hot.numel()),
                "head": hot[:16].tolist(),
                "is_identity": bool((hot == hot.new_tensor(range(hot.numel()))).all()),
            },
            "checkpoint_sha256": load_audit.hash_checkpoint_files(path) if path.is_dir() else {},
            "findings_load": [f.to_json() for f in findings],
        }
    )


def wrap_set_layers(original: Callable) -> Callable:
    @functools.wraps(original)
    def set_eagle3_layers_to_capture(self, layer_ids=None):
        result = original(self, layer_ids)
        rec = REC
        if rec is not None:

            def tap():
                resolved = audit.captured_layers(self)
                if not resolved and rec.capture_layers:
                    return  # a forwarding class whose inner target was recorded already
                rec.capture_layers = resolved
                rec.static(
                    {
                        "capture": {
                            "target_class": type(self).__name__,
                            "layer_ids_passed": layer_ids,
                            "layers_to_capture": resolved,
                            "capture_order": audit.capture_order(resolved),
                            "num_captures": len(set(resolved)),
                        }
                    }
                )

            rec.run_tap("set_eagle3_layers_to_capture", tap)
        return result

    return set_eagle3_layers_to_capture


def wrap_worker_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        rec = REC
        if rec is not None:

            def tap():
                sa = self.server_args
                raw = {
                    "num_steps": sa.speculative_num_steps,
                    "topk": sa.speculative_eagle_topk,
                    "num_draft_tokens": sa.speculative_num_draft_tokens,
                }
                eff = {
                    "num_steps": self.speculative_num_steps,
                    "topk": self.topk,
                    "num_draft_tokens": self.speculative_num_draft_tokens,
                }
                settings = audit.spec_settings(raw, eff)
                rec.spec_topk = int(self.topk)
                rec.static(
                    {
                        "spec": {**settings["effective"], **settings},
                        "findings_spec": [
                            from_fact(f).to_json() for f in audit.spec_facts(settings)
                        ],
                        "cuda_graphs": not getattr(sa, "disable_cuda_graph", True),
                    }
                )
                draft = getattr(getattr(self, "_draft_worker", None), "draft_runner", None)
                model = getattr(draft, "model", None)
                if type(model).__name__ in audit.MTP_CLASSES:  # its own tap: a failure names it
                    rec.run_tap("mtp", lambda: rec.static(_mtp_static(rec, self, model)))

            rec.run_tap("spec_settings", tap)
        return result

    return __init__


def _mtp_static(rec: Recorder, worker: Any, model: Any) -> dict[str, Any]:
    """An MTP head served by SGLang's EAGLE worker: what SGLang resolved (the draft class, the
    heads the checkpoint declares vs the steps chained), the capture (the target's output, one
    slot of width H), and where the target lives (the head is in its checkpoint)."""
    sa = worker.server_args
    cfg = model.config
    n_layers = int(cfg.num_hidden_layers)
    rec.capture_layers = [n_layers]
    rec.capture_convention = audit.MTP_CAPTURE_CONVENTION
    target = worker._target_worker.model_runner.model
    mtp = audit.mtp_record(
        algorithm=str(sa.speculative_algorithm),
        model_type=getattr(cfg, "model_type", None),
        architectures=list(getattr(cfg, "architectures", None) or []),
        n_predict=getattr(cfg, "num_nextn_predict_layers", None),
        num_steps=int(worker.speculative_num_steps),
        draft_class=type(model).__name__,
        target_layers=n_layers,
        parameters=[n for n, _ in model.named_parameters()],
    )
    path = Path(str(sa.model_path))
    return {
        "mtp": mtp,
        "drafter": {
            "path": str(sa.speculative_draft_model_path),
            "dialect": "mtp",
            "config_format": "target",
            "architecture": type(model).__name__,
        },
        "target": {
            "path": str(path),
            "num_layers": n_layers,
            "hidden_size": int(cfg.hidden_size),
            "vocab_size": int(cfg.vocab_size),
        },
        "draft_class": type(model).__name__,
        "capture": {
            "layers_to_capture": [n_layers],
            "capture_order": [n_layers],
            "num_captures": 1,
            "layer_ids_source": "mtp: the target's forward output",
            "capture_convention": audit.MTP_CAPTURE_CONVENTION,
            "target_class": type(target).__name__,
        },
        "embed_head": {
            "has_own_embed_tokens": False,
            "embed_shared_with_target": True,
            "has_own_lm_head": False,
            "lm_head_shared_with_target": True,
        },
        "checkpoint_sha256": load_audit.hash_checkpoint_files(path) if path.is_dir() else {},
    }


def wrap_resolve_once(original: Callable) -> Callable:
    @functools.wraps(original)
    def resolve_once(self):
        # Resolution runs once, in the main process; spawned schedulers get it pickled.
        already = getattr(self, "_resolution_finished", False)
        result = original(self)
        rec = REC
        if rec is None or already or not getattr(self, "speculative_algorithm", None):
            return result
        try:
            from sglang.srt.arg_groups.model_override_base import resolving_view

            view = resolving_view(self)
            names = {
                "num_steps": "speculative_num_steps",
                "topk": "speculative_eagle_topk",
                "num_draft_tokens": "speculative_num_draft_tokens",
            }
            raw = {k: getattr(self, f) for k, f in names.items()}
            eff = {k: getattr(view, f) for k, f in names.items()}
            settings = audit.spec_settings(raw, eff)
            rec.main_process_static(
                {
                    # the contract's `spec` (effective values at the top) until the worker's own
                    # record, taken later in the scheduler, supersedes it
                    "spec": {**settings["effective"], **settings},
                    "spec_resolution": settings,
                    "findings_spec_resolution": [
                        from_fact(f).to_json() for f in audit.spec_facts(settings)
                    ],
                }
            )
        except Exception as exc:  # never stop the server over an audit
            message = f"{type(exc).__name__}: {exc}"
            try:
                rec.main_process_static({"tap_errors": {"spec_resolution": message}})
            except Exception:
                print(f"hstrace: tap spec_resolution disabled: {message}", file=sys.stderr)
        return result

    return resolve_once


def wrap_prefill(original: Callable) -> Callable:
    @functools.wraps(original)
    def _draft_extend_for_prefill(self, *args, **kwargs):
        rec = REC
        batch = args[0] if args else kwargs.get("batch")
        # Read before the call: the original replaces `batch.input_ids` with the draft's
        # shifted ids (a new tensor, so this reference keeps the target's ids).
        target_ids = getattr(batch, "input_ids", None)
        result = original(self, *args, **kwargs)
        if rec is not None and rec.armed:

            def tap():
                a = hooks_common.bind_args(original, (self, *args), kwargs)
                if batch.forward_mode.is_idle() or rec.internal(r.rid for r in batch.reqs):
                    return
                writes: list[taps.TableWrite] = []
                rids = [str(r.rid) for r in batch.reqs]
                rec.step_requests((r for r in rids if r not in rec.seen_rids), rids)
                req = taps.requests_rows(batch, rec.seen_rids)
                if req is not None:
                    writes.append(req)
                target, draft = taps.prefill_rows(
                    batch, target_ids, batch.input_ids, a["target_hidden_states"]
                )
                lens = [int(n) for n in batch.extend_lens]
                draft.tok.update(
                    taps.draft_extend_topk_rows(
                        result, self.hot_token_id, sum(lens), taps.last_rows(lens)
                    )
                )
                rec.emit([*writes, target, draft])

            rec.run_tap("prefill", tap)
        return result

    return _draft_extend_for_prefill


def wrap_verify(original: Callable) -> Callable:
    @functools.wraps(original)
    def verify(self, batch, *args, **kwargs):
        rec = REC
        verify_input = batch.spec_info  # read before the call: verify replaces it
        result = original(self, batch, *args, **kwargs)
        if rec is not None and rec.armed:

            def tap():
                if not batch.forward_mode.is_idle() and not rec.internal(r.rid for r in batch.reqs):
                    rec.step_requests((), [r.rid for r in batch.reqs])
                    rec.emit(taps.verify_rows(batch, verify_input, result))

            rec.run_tap("verify", tap)
            rec.draft_step_index = 0
        return result

    return verify


def wrap_decode_extend(original: Callable) -> Callable:
    @functools.wraps(original)
    def _draft_extend_for_decode(self, batch, batch_result, *args, **kwargs):
        rec = REC
        seq_lens = getattr(batch, "seq_lens", None)  # before the call: the extend's prefix lengths
        result = original(self, batch, batch_result, *args, **kwargs)
        if rec is not None and rec.armed:
            # The original returns None: it fills `batch_result.next_draft_input` in place, and
            # leaves its exact inputs on the batch (`input_ids`, `spec_info.hidden_states`).
            def tap():
                if batch.forward_mode.is_idle() or rec.internal(r.rid for r in batch.reqs):
                    return
                row = taps.decode_extend_rows(
                    batch,
                    batch_result,
                    batch_result.next_draft_input,
                    self.hot_token_id,
                    int(self.speculative_num_draft_tokens),
                    batch.input_ids,
                    batch.spec_info.hidden_states,
                    seq_lens,
                    logprobs_known=int(self.topk) != 1,
                )
                rec.emit([row])

            rec.run_tap("decode_extend", tap)
        return result

    return _draft_extend_for_decode


def wrap_runner_forward(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(self, forward_batch, *args, **kwargs):
        result = original(self, forward_batch, *args, **kwargs)
        rec = REC
        if (
            rec is not None
            and rec.armed
            and getattr(self, "is_draft_worker", False)
            and forward_batch.forward_mode.is_decode()
        ):

            def tap():
                logits = result.logits_output.next_token_logits
                rids = [str(r) for r in (forward_batch.rids or [])]
                if rec.internal(rids):
                    rec.draft_step_index += 1
                    return
                topk = rec.spec_topk
                rec.emit(
                    [
                        taps.draft_forward_rows(
                            "draft_step",
                            forward_batch,
                            logits,
                            rec.hot_token_id,
                            min(topk, logits.shape[-1]),
                            rids,
                            "logits" in rec.streams,
                            # k of the chain: step 0 is the draft extend, so the first
                            # forward of `draft_forward` is k = 1 (as the reference engine)
                            step_index=rec.draft_step_index + 1,
                        )
                    ]
                )
                rec.draft_step_index += 1

            rec.run_tap("draft_step", tap)
        return result

    return forward


WRAPPERS: dict[str, Callable[[Callable], Callable]] = {
    "LlamaForCausalLMEagle3.load_weights": wrap_load_weights,
    "MiMoMTP.load_weights": wrap_mtp_load_weights,
    # every target class of the patch table (`versions.CAPTURE_TARGETS`), one wrapper
    **{
        f"{target.split(':')[1]}.set_eagle3_layers_to_capture": wrap_set_layers
        for target, _ in CAPTURE_TARGETS
    },
    "EAGLEWorkerV2.__init__": wrap_worker_init,
    "ServerArgs.resolve_once": wrap_resolve_once,
    "EagleDraftWorker._draft_extend_for_prefill": wrap_prefill,
    "EAGLEWorkerV2.verify": wrap_verify,
    "EagleDraftWorker._draft_extend_for_decode": wrap_decode_extend,
    "ModelRunner.forward": wrap_runner_forward,
}


# ---- installation: patch now, or right after the module is imported ------------------------


def apply(point: PatchPoint, module: Any) -> None:
    """Patch one point; a failure to patch is recorded and never reaches SGLang's import."""
    hooks_common.apply_point(point, module, WRAPPERS, REC)


def install(version: Version, cfg: dict[str, Any]) -> Recorder:
    global REC
    REC = Recorder(cfg, version)
    hooks_common.install_points(SUPPORT.patch_points_for(version), WRAPPERS, REC)
    control.serve(REC, "sglang")  # a dormant server's control channel (none otherwise)
    return REC
