"""Stage judge (entry `replay_with`; halves `open_evidence` and `judge`).

`replay_with(checks, ...)`: open everything, align, build the evidence
(`replay.evidence.build_evidence`), judge it with the given checks, assemble the result.
`open_evidence` and `judge` are the two halves (a test judges one evidence several times).

This is the only module of the replay that touches files (trace, training dir, checkpoints,
target); everything it calls is pure and testable on tensors. The checks come from above
(`hstrace.pipelines.replay` passes `hstrace.diagnose.diagnose`): replay builds the evidence the
checks read and never imports them, so dependencies point down.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hstrace.errors import CheckpointError, HstraceError, TrainingDataError
from hstrace.redaction import (
    RedactedIdsError,
    find_salt,
    redaction_modes,
    redaction_of,
    salt_digest,
)
from hstrace.reference.step0 import threads_for
from hstrace.reference.target import ReferenceTarget
from hstrace.replay.align import (
    TWIN_FORMAT,
    IdRecovery,
    align,
    drafter_aux_layers,
    recover_serving_ids,
    reference_twins,
    twin_gap,
    with_twins,
)
from hstrace.replay.evidence import Evidence, build_evidence
from hstrace.replay.impact import impacts
from hstrace.replay.read import ServingData, accept_len_by_rank, read_serving
from hstrace.replay.result import Judgement, ReplayResult
from hstrace.replay.unavailable import merged, split_failures

Progress = Callable[[str, int], None]


def _is_trace(path: Path) -> bool:
    return (path / "zarr.json").is_file() or path.suffix == ".zip"


def _flag_value(command: list[str] | str | None, flag: str) -> str | None:
    if not command:
        return None
    words = shlex.split(command) if isinstance(command, str) else list(command)
    for i, w in enumerate(words):
        if w == flag and i + 1 < len(words):
            return words[i + 1]
        if w.startswith(flag + "="):
            return w.split("=", 1)[1]
    return None


def engine_runner(static: dict[str, Any]) -> str | None:
    """The model runner a vLLM trace records (`static.vllm_runner`, written by `hstrace record`
    on vLLM 0.33+), as a line for the evidence; None when the trace records none."""
    rec = static.get("vllm_runner")
    if not isinstance(rec, dict) or rec.get("runner") not in ("v1", "v2"):
        return None
    name = "Model Runner V2" if rec["runner"] == "v2" else "the V1 model runner"
    return f"vLLM ran {name} (set by {rec.get('set_by', 'unknown')})"


def drafter_path_from_trace(meta: dict[str, Any]) -> Path | None:
    """The drafter the trace says it served: the static audit, else the server command line."""
    static = meta.get("static") or {}
    path = (static.get("drafter") or {}).get("path") or (static.get("draft_config") or {}).get(
        "_name_or_path"
    )
    if not path:
        for cmd in (static.get("server_cmd"), meta.get("command_line")):
            path = path or _flag_value(cmd, "--speculative-draft-model-path")
    return Path(path) if path else None


def target_path_from_trace(meta: dict[str, Any]) -> Path | None:
    static = meta.get("static") or {}
    path = (static.get("target") or {}).get("path")
    if not path:
        for cmd in (static.get("server_cmd"), meta.get("command_line")):
            path = path or _flag_value(cmd, "--model-path") or _flag_value(cmd, "--model")
    return Path(path) if path else None


def locate(path: Path | None, trace_path: Path) -> Path | None:
    """A path recorded in a trace: as is, else relative to one of the trace's parent dirs (a
    committed example records paths relative to the repository root)."""
    if path is None or path.exists() or path.is_absolute():
        return path
    for parent in Path(trace_path).resolve().parents:
        if (parent / path).exists():
            return parent / path
    return path


def _training_side(
    against: Path,
    slot_width: int,
    recovery: IdRecovery | None = None,
    vocab_size: int | None = None,
) -> tuple[list[Any], str, dict[str, Any]]:
    """Training samples, or the requests of a second trace presented as samples."""
    from hstrace.training import TrainingSample, open_training

    if _is_trace(against):
        from hstrace.trace import open_trace

        with open_trace(against) as other:
            data = read_serving(other)
        if "ids" in redaction_modes(data.meta):
            digest = redaction_of(data.meta).get("salt_sha256")
            if recovery is None or digest != _digest(recovery.salt):
                raise RedactedIdsError(
                    f"--against {against}: its token ids are redacted with another salt "
                    "(or none was given); replay against the training data or the unredacted trace"
                )
            recover_serving_ids(data, recovery)
        samples = []
        for i, r in enumerate(data.requests):
            # A cache hit has no capture of its cached span: it cannot stand in for a sample
            # (the request that filled the cache usually does).
            if r.aux is None or r.aux_start:
                continue
            aux = r.aux
            ht = int((data.aux_attrs or {}).get("slot_width") or slot_width)
            ht = ht if aux.shape[-1] % ht == 0 else aux.shape[-1]
            samples.append(
                TrainingSample(
                    index=i,
                    input_ids=torch.as_tensor(r.tokens[: len(aux)]).long(),
                    loss_mask=torch.ones(len(aux), dtype=torch.bool),
                    aux=aux.reshape(len(aux), -1, ht),
                    last=None,
                    last_norm=None,
                    slot_layer_ids=None,
                    provenance={"format": "trace", "path": str(against)},
                )
            )
        return samples, "trace", {"format": "trace"}
    td = open_training(against, vocab_size=vocab_size)  # ids past it: TrainingDataError
    return list(td.samples()), "training", {"format": td.format, "samples": len(td)}


def _resolve_norm_output(
    drafter: torch.nn.Module,
    report: Any,
    samples: list[Any],
    target_path: Path | None,
    target: ReferenceTarget | None,
) -> dict[str, Any] | None:
    """SpecForge PR #879 changed what `norm_output` means and `load_drafter` reads it as before
    the PR. With training tensors at hand, the reading the weights were trained with is the one
    they score better under (`hstrace.evaluation.resolve_norm_output`, as `hstrace check` does): the
    reference drafter runs under it, and replay's `inputs` says which and why."""
    if getattr(report, "dialect", None) != "specforge" or "norm_output" not in report.config:
        return None
    from hstrace.drafter.norm_output import PRE_879, norm_output_flags
    from hstrace.evaluation import resolve_norm_output
    from hstrace.metrics import TargetHead

    value = bool(report.config["norm_output"])
    head = TargetHead.from_pretrained(target_path) if target is not None else None
    with torch.inference_mode():
        res = resolve_norm_output(drafter, samples, value, head)
    reading = res.get("reading")
    used = reading or PRE_879
    for name, v in norm_output_flags(value, used).items():
        setattr(drafter.cfg, name, v)
    return {
        "norm_output": value,
        "reading": used,
        "from": (
            "the training tensors (resolve_norm_output)"
            if reading
            else f"default, as load_drafter reads it (the training tensors cannot tell: "
            f"{res.get('why')})"
        ),
        "resolution": res,
    }


def _embed_from_target(
    drafter: torch.nn.Module,
    report: Any,
    target: ReferenceTarget | None,
    target_path: Path | None,
    explicit_target: bool,
) -> tuple[str | None, str | None]:
    """The checkpoint carries no embedding (SpecForge, EAGLE save none): give the drafter the
    target's, as the serving engines do (SGLang's `set_embed`, vLLM's shared embedding). Returns (where the embedding came from, why the
    drafter cannot run); a drafter is never run with its random initial embedding."""
    from hstrace.target_io import load_target_embedding

    dialect = getattr(report, "dialect", "this")
    emb, why = None, None
    if target is not None:
        emb = target.embed.detach().float()
    elif target_path is not None and Path(target_path).is_dir():
        try:
            emb = load_target_embedding(target_path)
        except CheckpointError as exc:
            if explicit_target:
                raise
            why = str(exc)
    else:
        why = "no target model (give --target DIR)"
    own = drafter.embed_tokens.weight
    if emb is not None and tuple(emb.shape) != tuple(own.shape):
        msg = (
            f"target {target_path}: embedding {list(emb.shape)} does not fit the drafter's "
            f"{list(own.shape)}"
        )
        if explicit_target:
            raise CheckpointError(msg)
        emb, why = None, msg
    if emb is None:
        return None, (
            f"the drafter checkpoint ({dialect}) carries no embedding and the target's could not "
            f"be loaded ({why}); engines serve it with the target's embedding, so the drafter-output "
            "checks (engine vs reference, what-ifs, step-0 accuracy) did not run"
        )
    with torch.no_grad():
        own.copy_(emb.to(own.dtype))
    return f"target ({target_path}): the checkpoint carries none, as engines serve it", None


def _digest(salt: bytes) -> str:
    return salt_digest(salt)


# The judge handed in from above (`hstrace.pipelines.replay` passes `hstrace.diagnose.diagnose`):
# it reads the evidence and returns its findings and the checks that failed internally.
Checks = Callable[[Evidence], Judgement]


def replay_with(
    checks: Checks,
    trace_path: Path,
    against: Path | None,
    drafter_path: Path | None = None,
    target_path: Path | None = None,
    progress: Progress | None = None,
    salt_file: Path | None = None,
) -> ReplayResult:
    """Open everything, build the evidence, judge it with `checks`. `against` None: no
    training side; requests are judged against the target's forward (`target_path`, else the
    trace's) where it is at hand, and the result says what could not be judged."""
    ev, inputs = open_evidence(trace_path, against, drafter_path, target_path, progress, salt_file)
    return judge(ev, inputs, checks)


def open_evidence(
    trace_path: Path,
    against: Path | None,
    drafter_path: Path | None = None,
    target_path: Path | None = None,
    progress: Progress | None = None,
    salt_file: Path | None = None,
) -> tuple[Evidence, dict[str, Any]]:
    """The evidence of one replay and what it was built from (the result's `inputs`)."""
    from hstrace.trace import open_trace

    trace_path = Path(trace_path)
    against = Path(against) if against is not None else None
    if against is not None and not against.exists():
        raise TrainingDataError(f"--against {against}: no such training dir or trace")
    # Open until the evidence is built: the wide tensors are read request by request while
    # it is (`read_serving(lazy=True)`), never all at once.
    with open_trace(trace_path) as trace:
        return _evidence_of(
            trace, trace_path, against, drafter_path, target_path, progress, salt_file
        )


def _training_vocab_map(drafter: Any, report: Any, against: Path | None) -> str | None:
    """A checkpoint saved without `d2t` (a parameters-only export drops the buffer) leaves the
    reference drafter's map all zeros: draft id i read as target id i. The drafter as trained
    used the map its training data was built with; take it from there (`training_d2t`), so the
    replay compares serving with training's map and not with the missing one."""
    from hstrace.training import training_d2t

    cfg = drafter.cfg
    if "d2t" not in report.missing or cfg.draft_vocab_size >= cfg.vocab_size:
        return None
    d2t = training_d2t(against) if against is not None and Path(against).is_dir() else None
    if d2t is None or len(d2t) != len(drafter.d2t):
        return None
    with torch.no_grad():
        drafter.d2t.copy_(d2t)
    return (
        f"the checkpoint has no d2t; the reference drafter uses the training data's "
        f"({against}, {len(d2t)} offsets)"
    )


def _evidence_of(
    trace: Any,
    trace_path: Path,
    against: Path | None,
    drafter_path: Path | None,
    target_path: Path | None,
    progress: Progress | None,
    salt_file: Path | None,
) -> tuple[Evidence, dict[str, Any]]:
    from hstrace.drafter import load_drafter
    from hstrace.trace.validate import check_serving_ids

    serving: ServingData = read_serving(trace, lazy=True)
    by_rank = accept_len_by_rank(trace) if len(trace.ranks) > 1 else {}
    views = {r: trace.rank(r) for r in trace.ranks}
    others = _other_ranks(trace) if len(trace.ranks) > 1 else {}
    modes = redaction_modes(serving.meta)
    redaction: dict[str, Any] = {"modes": list(modes)} if modes else {}
    salt = None
    if "ids" in modes:  # before anything slow: without the salt nothing can be replayed
        salt, salt_path = find_salt(
            trace_path, salt_file, redaction_of(serving.meta).get("salt_sha256")
        )
        redaction["ids"] = f"recovered from the salted hashes with the salt in {salt_path}"

    drafter_path = drafter_path or locate(drafter_path_from_trace(serving.meta), trace_path)
    if drafter_path is None:
        raise CheckpointError("the trace does not name its drafter; give --drafter CKPT")
    if not Path(drafter_path).is_dir():
        raise CheckpointError(f"drafter {drafter_path}: not a checkpoint directory")
    drafter, report = load_drafter(Path(drafter_path))
    recovery = None
    if salt is not None:
        recovery = IdRecovery.build(salt, drafter.cfg.vocab_size, drafter.cfg.draft_vocab_size)
        recover_serving_ids(serving, recovery)
    for r in serving.requests:  # before any id indexes an embedding (issues 12, 24)
        check_serving_ids(f"{trace_path}: request {r.name}", r, drafter.cfg)
    if against is not None:
        samples, kind, training_info = _training_side(
            against, drafter.cfg.aux_width, recovery, drafter.cfg.vocab_size
        )
        if not samples:
            raise TrainingDataError(f"--against {against}: holds no samples with aux hidden states")
    else:  # no training side: reference twins only (below), where the target is at hand
        samples, kind, training_info = [], "target", {"format": TWIN_FORMAT}
    d2t_note = _training_vocab_map(drafter, report, against)

    explicit_target = target_path is not None
    if explicit_target and not Path(target_path).is_dir():
        raise HstraceError(f"--target {target_path}: not a model directory")
    target_path = target_path or locate(target_path_from_trace(serving.meta), trace_path)
    target, target_note = None, None
    if target_path is not None and Path(target_path).is_dir():
        try:
            target = ReferenceTarget(Path(target_path))
        except HstraceError as exc:
            if explicit_target:
                raise
            target_note = str(exc)  # the trace's target is optional evidence: go on without
    embed_source, no_forward = "checkpoint", None
    if "embed_tokens.weight" in report.missing:
        embed_source, no_forward = _embed_from_target(
            drafter, report, target, target_path, explicit_target
        )

    norm_output = None
    if kind == "training" and no_forward is None:
        norm_output = _resolve_norm_output(drafter, report, samples, target_path, target)

    matches, coverage = align(
        [r.tokens for r in serving.requests], [s.input_ids.numpy() for s in samples]
    )
    twins, twins_info, untwinned = _twins(
        serving, matches, len(samples), drafter.cfg, report, target, target_note, progress
    )
    samples = samples + [t for _, t, _ in twins]
    matches = sorted(matches + [m for _, _, m in twins], key=lambda m: m.serving)
    coverage = with_twins(coverage, twins)
    notes = dict(serving.missing)
    if d2t_note:
        notes.setdefault("vocab map", d2t_note)
    elif against is None and "d2t" in report.missing:
        notes.setdefault(
            "vocab map",
            "the checkpoint has no d2t and there is no training data to take it from "
            "(give --against TRAINING_DIR): the reference drafter reads the missing map as "
            "zeros, like an engine that dropped it",
        )
    if target_note:
        notes.setdefault("target model", target_note)
    if against is None and "norm_output" in getattr(report, "config", {}):
        if getattr(report, "dialect", None) == "specforge":
            notes.setdefault(
                "SpecForge norm_output reading",
                "no training tensors to tell which reading the weights were trained with "
                "(give --against TRAINING_DIR); the reference drafter reads it as load_drafter "
                "does",
            )
    if against is not None and not matches:
        notes.setdefault(
            "alignment", "no serving request shares its leading tokens with a training sample"
        )
    with torch.inference_mode(), threads_for(drafter.cfg.hidden_size):
        ev = build_evidence(
            serving,
            samples,
            matches,
            coverage,
            drafter,
            load_report=report,
            target=target,
            training_kind=kind,
            progress=progress,
            no_forward=no_forward,
            notes=notes,
            # the reference replays rank 0's rows; every other rank is compared with rank 0
            accept_len_by_rank=by_rank if len(by_rank) > 1 else None,
            other_ranks=others,
            views=views,
            untwinned=untwinned,
        )
    if "hidden" in modes:
        redaction["hidden"] = (
            "slot and layer fingerprints from the kept per-slot sketches"
            if ev.sketched
            else "no hidden states and no sketches: no slot checks"
        )
    runner = engine_runner(serving.meta.get("static") or {})  # vLLM 0.33+: V1 or V2
    inputs = {
        "trace": str(trace_path),
        "engine": serving.meta.get("engine"),
        **({"engine_runner": runner} if runner else {}),
        "against": str(against) if against is not None else None,
        "against_kind": kind,
        **({"reference_twins": twins_info} if twins_info else {}),
        "training": training_info,
        "drafter": str(drafter_path),
        "drafter_dialect": getattr(report, "dialect", None),
        "drafter_embedding": embed_source,
        "target": str(target_path) if target is not None else None,
        **({"specforge_norm_output": norm_output} if norm_output else {}),
        **({"redaction": redaction} if redaction else {}),
    }
    return ev, inputs


def _twins(
    serving: ServingData,
    matches: list[Any],
    first_index: int,
    cfg: Any,
    report: Any,
    target: ReferenceTarget | None,
    target_note: str | None,
    progress: Progress | None,
) -> tuple[list[Any], dict[str, Any] | None, dict[str, str]]:
    """Reference twins for the requests no training sample matches (`align.reference_twins`):
    (twins, what they were built from for `inputs`, request name -> why it has no twin)."""
    twinned = {m.serving for m in matches}
    lacking = [(i, r) for i, r in enumerate(serving.requests) if i not in twinned]
    untwinned: dict[str, str] = {}
    can = []
    for i, r in lacking:
        if not r.aux_rows:  # a request with no capture has no slots to judge anyway
            continue
        gap = twin_gap(r)
        if gap is not None:
            untwinned[r.name] = f"no training twin; {gap}"
            continue
        can.append((i, r))
    if not can:
        return [], None, untwinned
    if target is None:
        why = target_note or "no target model to run on the served tokens (give --target DIR)"
        for _, r in can:
            untwinned[r.name] = f"no training twin and {why}"
        return [], None, untwinned
    layers, source = drafter_aux_layers(cfg, getattr(report, "dialect", None), target.num_layers)
    with torch.inference_mode():
        twins = reference_twins(can, target, layers, first_index, progress)
    info = {
        "requests": len(twins),
        "target": str(target.path),
        "layers": layers,
        "layers_from": source,
        "dtype": "bfloat16",
    }
    return twins, info, untwinned


def _other_ranks(trace: Any) -> dict[int, ServingData]:
    """Every rank but 0, read like rank 0 (lazily: wide tensors stay on disk). A rank with no
    target steps (a rank that never served) is left out: its coverage still says so."""
    out: dict[int, ServingData] = {}
    for r in trace.ranks:
        if r == 0:
            continue
        view = trace.rank(r)
        target = view.table("target")
        if target is None or target.num_steps == 0:
            out[r] = ServingData(requests=[], meta=dict(trace.meta))
            continue
        out[r] = read_serving(trace, r, lazy=True)
    return out


def judge(ev: Evidence, inputs: dict[str, Any], checks: Checks) -> ReplayResult:
    """The result of `checks` on built evidence. The evidence is read-only: judging the same
    evidence twice, or with the checks in another order, gives the same result."""
    with torch.inference_mode(), threads_for(ev.drafter.cfg.hidden_size):
        judged: Judgement = checks(ev)
    # Missing evidence is "not checked, and why"; a check or evidence that raised is a failure.
    skipped, failed = split_failures(merged(ev.unavailable, judged.failed))
    result = ReplayResult(
        findings=list(judged.findings),
        metrics=ev.metrics_json(),
        coverage=ev.alignment.coverage.to_json(),
        fingerprints=ev.fingerprints_json(),
        inputs=dict(inputs),
        skipped=skipped,
        failed=failed,
        judged=ev.judged(),
        not_judged=list(ev.not_judged),
    )
    # what each fault costs: on the chains the evidence ran, by the part its fix puts back
    result.impact = impacts(result.faults, ev.chains)
    return result
