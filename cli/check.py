"""`hstrace check DRAFTER [--against TRAINING_DIR [--target TARGET_DIR]] [--json]`: load report,
static findings, and the drafter's accuracy on the training tensors."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from hstrace.engines.registry import engine_spec, judged
from hstrace.errors import EXIT_CLEAN, EXIT_COULD_NOT_JUDGE, EXIT_FAULT
from hstrace.findings import Finding, in_dataflow_order

T = TypeVar("T")


def _engine_options(f: Any) -> Any:
    """`--engine NAME` (repeatable) and one `--NAME-version` per engine the registry judges."""
    for spec in reversed(judged()):
        f = click.option(
            f"--{spec.name}-version",
            f"{spec.name}_version",
            default=None,
            help=f"Judge for this {spec.label} version (default: the installed one, else "
            f"{spec.default_version}, the newest hstrace supports); implies --engine {spec.name}.",
        )(f)
    return click.option(
        "--engine",
        "engine_names",
        multiple=True,
        type=click.Choice([s.name for s in judged()]),
        help="Judge for this engine (repeatable). Default: every engine that can load the "
        "checkpoint as it is; each finding names the engines it concerns.",
    )(f)


def _target_layers(target: str) -> int:
    """The target's decoder layer count, from its config.json (SGLang's default capture)."""
    from hstrace.drafter.checkpoint import read_config
    from hstrace.errors import CheckpointError

    cfg = read_config(Path(target))
    n = cfg.get("num_hidden_layers") or (cfg.get("text_config") or {}).get("num_hidden_layers")
    if not isinstance(n, int) or n < 1:
        raise CheckpointError(f"{target}/config.json: no num_hidden_layers")
    return n


def _embedding(model: Any, report: Any, target: str | None) -> tuple[Any, str | None, bool]:
    """(embedding to compare stored slots with, its source, whether the drafter has a real one).
    A drafter saved without an embedding gets the target's; without a target it has none, and
    nothing computed with its random init is reported."""
    from hstrace.errors import CheckpointError
    from hstrace.target_io import load_target_embedding

    missing = "embed_tokens.weight" in report.missing
    if target is None:
        if missing:
            return None, None, False
        return model.embed_tokens.weight.detach(), "the drafter checkpoint's embed_tokens", True
    try:
        emb = load_target_embedding(target)  # CheckpointError (one line) for a bad dir
    except CheckpointError:
        if missing:
            raise
        # the target keeps its embedding under another name; the drafter's copy still serves
        return model.embed_tokens.weight.detach(), "the drafter checkpoint's embed_tokens", True
    if missing:
        if tuple(emb.shape) != tuple(model.embed_tokens.weight.shape):
            raise CheckpointError(
                f"{target}: target embedding {list(emb.shape)} does not fit the drafter's "
                f"{list(model.embed_tokens.weight.shape)}"
            )
        model.embed_tokens.weight.data.copy_(emb)
    return emb, "the target's model.embed_tokens", True


@click.command(name="check")
@click.argument("drafter", type=click.Path())
@click.option(
    "--against",
    "against",
    type=click.Path(),
    default=None,
    help="Training data dir: compare the stored slots and report the drafter's accuracy on it.",
)
@click.option(
    "--target",
    type=click.Path(),
    default=None,
    help="The target's HF checkpoint dir: its lm_head/norm rebuild the teacher, its embedding "
    "feeds drafters saved without one (SpecForge, EAGLE).",
)
@click.option(
    "--samples",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Training samples to evaluate (the first N).",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1, max=16),
    default=3,
    show_default=True,
    help="Draft steps K for per-position accuracy and acceptance length.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--dialect",
    type=click.Choice(["speculators", "specforge", "eagle"]),
    default=None,
    help="Override the detected checkpoint dialect.",
)
@_engine_options
@click.option(
    "--all-versions",
    is_flag=True,
    help="Report findings for every engine version, not just the one judged for.",
)
def check(
    drafter: str,
    against: str | None,
    target: str | None,
    samples: int,
    steps: int,
    as_json: bool,
    dialect: str | None,
    engine_names: tuple[str, ...],
    all_versions: bool,
    **engine_versions: str | None,
) -> int:
    """Load a drafter checkpoint and report static wiring problems.

    Exit 0 = no fault, 1 = fault, 2 = bad input, 3 = could not judge (a rule or the training
    evaluation failed internally: a bug in hstrace, named in one line)."""
    from hstrace.drafter import load_drafter
    from hstrace.drafter.norm_output import norm_output_flags
    from hstrace.evaluation import resolve_norm_output, training_findings
    from hstrace.evaluation.accuracy import flag_fix_on_training
    from hstrace.metrics import TargetHead
    from hstrace.rules import run_static
    from hstrace.training import open_training

    if dialect is None and _holds_mtp_head(drafter):
        return _check_mtp(drafter, as_json)
    model, report = load_drafter(drafter, dialect=dialect)
    n_layers = _target_layers(target) if target else None
    td = head = None
    embedding, emb_source, emb_ok = None, None, False
    if against:
        # TrainingDataError (one line) for a bad dir, or ids past the drafter's vocabulary
        td = open_training(against, vocab_size=model.cfg.vocab_size)
        if target is not None:
            head = TargetHead.from_pretrained(target)  # CheckpointError for a bad dir
        embedding, emb_source, emb_ok = _embedding(model, report, target)
    resolution = None
    # What failed internally (name -> `Type: message`): the result is then incomplete (exit 3
    # unless a fault was found), never clean.
    failed: dict[str, str] = {}
    if report.dialect == "specforge" and "norm_output" in report.config and td and emb_ok:
        # SpecForge PR #879 changed what norm_output means; the training tensors tell which.
        value = bool(report.config["norm_output"])
        resolution = _internal(
            failed,
            "norm_output resolution",
            lambda: resolve_norm_output(model, td, value, head),
        )
        if resolution is not None and resolution["reading"] is not None:
            for name, v in norm_output_flags(value, resolution["reading"]).items():
                setattr(model.cfg, name, v)
    # Judged per engine: a rule for another engine or version (e.g. "sglang<0.5.12") is not a
    # fault of this deployment; its findings are counted and named, not reported, unless
    # --all-versions.
    targets, not_loadable = _engines_to_judge(report, engine_names, engine_versions)
    findings: list[Finding] = []
    concerns: dict[int, list[str]] = {}
    metrics: dict[str, Any] = {}
    hidden = 0
    if all_versions:
        static = _internal(
            failed,
            "static rules",
            lambda: run_static(report, model, n_layers, resolution, advisory=True),
        )
        if static is not None:
            run, metrics = static
            findings = list(run.findings)
            failed.update(run.failed)  # `rule NAME`: the other rules still ran
        # every version of every engine: a finding concerns the engines its scope names
        concerns = {
            id(f): [s.name for s in judged() if not f.applies_to or s.name in f.applies_to]
            for f in findings
        }
    else:
        judged_static = _internal(
            failed,
            "static rules",
            lambda: _judge(report, model, n_layers, resolution, targets, failed),
        )
        if judged_static is not None:
            findings, concerns, hidden, metrics = judged_static
    if resolution is not None:
        metrics["norm_output_resolution"] = resolution
    if td is not None:
        evaluated = _internal(
            failed,
            "training evaluation",
            lambda: training_findings(
                model,
                td,
                report.dialect,
                head=head,
                max_samples=samples,
                steps=steps,
                embedding=embedding,
                embedding_source=emb_source,
                embedding_loaded=emb_ok,
            ),
        )
        if evaluated is not None:
            more, metrics["training"] = evaluated
            findings += more
        if emb_ok:  # each norm flag's fix, tried on the training tensors (issue 28 item 5)
            _internal(
                failed,
                "norm flags on the training tensors",
                lambda: flag_fix_on_training(model, td, findings, samples),
            )
    findings = in_dataflow_order(findings)
    faults = sum(f.severity == "fault" for f in findings)
    code = EXIT_FAULT if faults else (EXIT_COULD_NOT_JUDGE if failed else EXIT_CLEAN)
    judged_for = None if all_versions else ", ".join(f"{n}=={v}" for n, v in targets)
    if as_json:
        doc = {
            "dialect": report.dialect,
            "judged_for": judged_for,
            "findings_for_other_versions": hidden,
            # engines that cannot load this checkpoint as it is, and why (said once)
            "not_loadable": not_loadable,
            "findings": [
                {**f.to_json(), "engines": concerns.get(id(f), [n for n, _ in targets])}
                for f in findings
            ],
            "metrics": metrics,
            "load_report": report.to_json(),
            "complete": not failed,
            "failed": failed,
            "exit_code": code,
        }
        click.echo(json.dumps(doc, indent=2, default=str))
    else:
        _print_rich(report, findings, metrics, failed, concerns)
        for name, why in not_loadable.items():
            click.echo(f"not loadable by {name} as it is: {why}")
        if not all_versions:
            more = f"; {hidden} more for other engine versions (--all-versions)" if hidden else ""
            click.echo(f"judged for {', '.join(f'{n} {v}' for n, v in targets)}{more}")
        for name, why in failed.items():  # last, one line each: what failed, and how
            click.echo(f"judgement incomplete: {name} failed internally: {why} (exit {code})")
    return code


def _holds_mtp_head(path: str) -> bool:
    """A target checkpoint with an MTP / NextN head (MiMo, DeepSeek-V3-style), not a drafter."""
    from hstrace.drafter.checkpoint import read_config
    from hstrace.errors import CheckpointError

    p = Path(path)
    ckpt = p.parent if p.is_file() else p
    if not (ckpt / "config.json").is_file():
        return False
    try:
        raw = read_config(ckpt)
    except CheckpointError:
        return False  # the drafter loader says what is wrong with it
    arch = str((raw.get("architectures") or [""])[0])
    if "eagle" in arch.lower() or "speculators_model_type" in raw or "draft_vocab_size" in raw:
        return False  # a drafter whose config copied the target's fields
    mtp_type = str(raw.get("model_type", "")).startswith("qwen3_next")
    return bool(raw.get("num_nextn_predict_layers")) or arch == "MiMoForCausalLM" or mtp_type


def _check_mtp(path: str, as_json: bool) -> int:
    """`hstrace check TARGET_DIR` on a target with an MTP head: which key fills which MTP
    parameter, which keys vLLM's loader would skip, scales, embedding / head sources, n_predict,
    and the MTP rules' findings (`hstrace.rules.mtp`)."""
    from hstrace.drafter.mtp_checkpoint import read_mtp_checkpoint, weight_index
    from hstrace.errors import error_line, unless_internal_failure
    from hstrace.rules.mtp import MTP_RULES, MTPFacts
    from hstrace.rules.table import run_rules

    _, report = read_mtp_checkpoint(path)  # CheckpointError (one line): a bad checkpoint
    keys = sorted(weight_index(Path(report.path)))
    failed: dict[str, str] = {}
    facts = unless_internal_failure(
        lambda: MTPFacts(report, keys), lambda e: failed.__setitem__("MTP facts", error_line(e))
    )
    findings: list[Finding] = []
    if facts is not None:
        run = run_rules(MTP_RULES, facts)
        failed.update(run.failed)
        findings = in_dataflow_order(run.findings)
    faults = sum(f.severity == "fault" for f in findings)
    code = EXIT_FAULT if faults else (EXIT_COULD_NOT_JUDGE if failed else EXIT_CLEAN)
    vllm = {k: v.fate for k, v in facts.vllm.items()} if facts is not None else {}
    if as_json:
        doc = {
            "kind": "mtp-head",
            "load_report": report.to_json(),
            "vllm_model_type": facts.model_type if facts is not None else None,
            "vllm_key_fates": vllm,
            "vllm_parameters_not_filled": facts.vllm_unfilled if facts is not None else None,
            "findings": [f.to_json() for f in findings],
            "complete": not failed,
            "failed": failed,
            "exit_code": code,
        }
        click.echo(json.dumps(doc, indent=2, default=str))
        return code
    r = report
    click.echo(
        f"MTP head ({r.layout} layout) in {r.path}: n_predict {r.n_predict}, layers at "
        f"{', '.join(p + '*' for p in r.layer_prefixes)}"
    )
    click.echo(f"embedding from {r.embed_source}, output head from {r.head_source}")
    served_as = facts.model_type if facts is not None else None
    click.echo(f"vLLM serves it as: {served_as or '(no MTP loader hstrace models)'}")
    for note in r.notes:
        click.echo(f"note: {note}")
    for key, name in r.key_map.items():
        fate = f"  [vLLM: {vllm[key]}]" if key in vllm and vllm[key] != "loaded" else ""
        click.echo(f"  {key} -> {name or '(nothing)'}{fate}")
    for key, fate in vllm.items():
        if key not in r.key_map and fate != "loaded":
            click.echo(f"  {key} (outside the MTP prefix)  [vLLM: {fate}]")
    click.echo(f"quantization scales: {', '.join(r.scales) or 'none'}")
    if not findings:
        click.echo("no findings (MTP weights, vLLM's loader, scales, embedding / head)")
    for f in findings:
        click.echo(f"{f.severity} {f.code} [{f.stage}] {f.summary}")
        click.echo(f"    evidence: {json.dumps(f.evidence, default=str)}")
        click.echo(f"    fix: {f.fix}")
    for name, why in failed.items():
        click.echo(f"judgement incomplete: {name} failed internally: {why} (exit {code})")
    return code


def _internal(failed: dict[str, str], name: str, compute: Callable[[], T]) -> T | None:
    """`compute()`, or None with `failed[name]` = `Type: message` when it raises internally.
    Bad input (`HstraceError`) still ends the command with its one line (exit 2)."""
    from hstrace.errors import error_line, unless_internal_failure

    return unless_internal_failure(compute, lambda e: failed.__setitem__(name, error_line(e)))


def _engines_to_judge(
    report: Any, names: tuple[str, ...], versions: dict[str, str | None]
) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """[(engine, version)] to judge for, and {engine: why it cannot load this checkpoint as it
    is}. Named engines (`--engine`, `--NAME-version`) are judged even when they cannot load it
    as it is (the rules still hold for the converted checkpoint, and the reason is said once);
    by default, every judged engine that can."""
    asked = list(dict.fromkeys([*names, *(n for n in versions_named(versions))]))
    candidates = asked or [s.name for s in judged()]
    targets: list[tuple[str, str]] = []
    not_loadable: dict[str, str] = {}
    for name in candidates:
        spec = engine_spec(name)
        why = spec.cannot_load(report.dialect, report.config)
        if why is not None:
            not_loadable[name] = why
            if not asked:
                continue
        version = versions.get(f"{name}_version") or spec.judged_version()
        targets.append((name, str(version)))
    if not targets:  # no engine loads it as it is: judge for all of them, having said why
        targets = [(s.name, str(s.judged_version())) for s in judged()]
    return targets, not_loadable


def versions_named(versions: dict[str, str | None]) -> list[str]:
    """The engines whose `--NAME-version` was given."""
    return [k.removesuffix("_version") for k, v in versions.items() if v]


def _judge(
    report: Any,
    model: Any,
    n_layers: int | None,
    resolution: dict[str, Any] | None,
    targets: list[tuple[str, str]],
    failed: dict[str, str],
) -> tuple[list[Finding], dict[int, list[str]], int, dict[str, Any]]:
    """The rule table for each (engine, version): each rule's findings once, with the engines
    they concern; and the number of findings only other engines or versions get."""
    from hstrace.rules import RULES, run_static

    order = {r.name: i for i, r in enumerate(RULES)}
    found: dict[tuple[str, int], tuple[Finding, list[str]]] = {}
    other: set[tuple[str, int]] = set()
    metrics: dict[str, Any] = {}
    for name, version in targets:
        run, metrics = run_static(
            report, model, n_layers, resolution, advisory=True, engine=name, version=version
        )
        failed.update(run.failed)  # `rule NAME`: the other rules still ran
        for pairs, into_found in ((run.found, True), (run.other_versions, False)):
            seen: dict[str, int] = {}
            for rule, finding in pairs:
                key = (rule.name, seen.get(rule.name, 0))
                seen[rule.name] = key[1] + 1
                if into_found:
                    found.setdefault(key, (finding, []))[1].append(name)
                else:
                    other.add(key)
    keys = sorted(found, key=lambda k: (order[k[0]], k[1]))
    findings = [found[k][0] for k in keys]
    concerns = {id(found[k][0]): found[k][1] for k in keys}
    return findings, concerns, len(other - set(found)), metrics


def _print_rich(
    report: Any,
    findings: list[Finding],
    metrics: dict[str, Any],
    failed: dict[str, str],
    concerns: dict[int, list[str]] | None = None,
) -> None:
    from rich.console import Console

    con = Console(file=sys.stdout, highlight=False)
    _print_header(con, report, metrics)
    if failed and not findings:
        con.print("[red]no findings, but not every check ran[/] (see below)")
    elif not findings:
        con.print("[green]no findings[/] (static checks: weights, flags, vocab map, aux slots)")
    for f in findings:
        color = {"fault": "red", "warning": "yellow", "info": "blue"}[f.severity]
        scope = f"  [dim](applies to {f.applies_to})[/]" if f.applies_to else ""
        engines = (concerns or {}).get(id(f))
        if engines:
            scope += f"  [dim](for {', '.join(engines)})[/]"
        con.print(f"[{color}]{f.severity}[/] [bold]{f.code}[/] [{f.stage}] ", end="")
        con.print(f.summary, markup=False, end="")
        con.print(scope)
        con.print(f"    evidence: {json.dumps(f.evidence, default=str)}", markup=False)
        con.print(f"    fix: {f.fix}", markup=False)
    res = metrics.get("norm_output_resolution")
    if res and "accuracy" not in res:
        con.print(f"SpecForge norm_output: reading not tested ({res['why']})", markup=False)
    elif res:
        read_as = res["reading"] or "undecided"
        acc = ", ".join(f"{k} {v:.3f}" for k, v in res["accuracy"].items() if v is not None)
        con.print(
            f"SpecForge norm_output read as: {read_as} ({res['compared']}: {acc}; rows only "
            f"right before/after PR #879: {res['only_right_before_pr_879']}/"
            f"{res['only_right_after_pr_879']} of {res['rows']}; {res['test']})",
            markup=False,
        )
    train = metrics.get("training")
    if train:
        _print_training(con, train)
    else:
        con.print("[dim]accuracy on training data: --against TRAINING_DIR --target TARGET_DIR[/]")


def _print_header(con: Any, report: Any, metrics: dict[str, Any]) -> None:
    from rich.table import Table

    con.print(
        f"[bold]{report.path}[/]  dialect [cyan]{report.dialect}[/] ({report.dialect_source}), "
        f"weights {report.weight_file}"
    )
    not_loaded = ", ".join(report.missing) if report.missing else "none"
    con.print(
        f"tensors: {len(report.key_map)} in checkpoint, {len(report.unmapped)} unmapped; "
        f"parameters: {len(report.loaded)} loaded, not loaded: {not_loaded}",
        markup=False,
    )
    if "embed_tokens.weight" in report.missing:
        con.print(
            "  [dim](no embedding in the checkpoint, as SpecForge/EAGLE save it: engines use the "
            "target's)[/]"
        )
    vocab = metrics.get("vocab", {})
    if vocab:
        mapped = "d2t present" if vocab.get("d2t_present") else "no d2t"
        con.print(
            f"vocab: draft {vocab.get('draft_vocab_size')} of target {vocab.get('vocab_size')}, {mapped}"
        )
    ids = report.flags.get("aux_layer_ids", (None, ""))[0]
    if ids:
        from hstrace.drafter.dialects import DIALECT_CONVENTION
        from hstrace.training.conventions import hf_index

        conv = DIALECT_CONVENTION[report.dialect]
        con.print(
            f"aux layers: ids {ids} ({conv.replace('_', ' ')} k, the {report.dialect} convention) "
            f"= HF hidden_states {[hf_index(int(i), conv) for i in ids]}",
            markup=False,
        )
    flags = Table("flag", "value", "source", "meaning", title="flags", title_justify="left")
    for name, (value, source) in report.flags.items():
        flags.add_row(name, str(value), source, _FLAG_MEANING.get(name, ""))
    con.print(flags)


# What the flags hstrace names for their effect mean in the libraries' own words.
_FLAG_MEANING = {
    "logits_use_norm": "norm before lm_head (SpecForge norm_output)",
    "feed_normed": "next step gets norm(h) (speculators/vLLM norm_output)",
    "norm_before_residual": "residual = hidden_norm(h) (speculators)",
    "norm_before_fc": "one norm over the aux concat (input_norm)",
    "fc_norm": "one norm per aux slot before fc",
    "qk_norm": "per-head q/k norm (qwen3 draft)",
}


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}"


def _print_training(con: Any, train: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    from hstrace.evaluation import SHORT_CONVENTIONS

    con.print(
        f"[bold]training data[/] ({train.get('format')}): first {train.get('samples')} samples, "
        f"{train.get('rows', 0)} loss-masked rows, K = {train.get('steps')} draft steps"
    )
    if "skipped" in train:
        con.print(f"  metrics skipped: {escape(train['skipped'])}")
        return
    if "per_position" not in train:
        return
    con.print(f"  teacher: {escape(train['teacher'])}")
    con.print(
        "  rows: drafter row t sees aux[t] and token t+1, predicts token t+2; counted where "
        "loss_mask[t+1]",
        markup=False,
    )
    t = Table("metric", "value", "convention", title_justify="left", box=None, padding=(0, 2, 0, 0))
    for name in ("acc0_teacher", "acc0_target", "acc0_data", "teacher_agrees_with_data"):
        m = train.get(name)
        if m:
            value = f"{_fmt(m['value'])} ({m['correct']}/{m['total']})"
            t.add_row(name, value, escape(SHORT_CONVENTIONS[name]))
    pp = train["per_position"]
    for kind in ("uncond", "full", "cond"):
        t.add_row(
            f"per-position {kind}",
            " ".join(_fmt(v) for v in pp[kind]),
            escape(SHORT_CONVENTIONS[kind]),
        )
    al = train["accept_len"]
    t.add_row(
        "accept_len (sim.)",
        f"{al['value']:.3f}",
        escape(SHORT_CONVENTIONS["accept_len"]),
    )
    con.print(t)
    con.print(
        f"  per-position reference: {escape(pp['reference'])}; without the bonus "
        f"{al['value_without_bonus']:.3f}, SpecForge simulated_acc_len (no +1) "
        f"{al['specforge_simulated_acc_len']:.3f}; full wording: --json"
    )
