"""`hstrace check DRAFTER [--against TRAINING_DIR] [--json]`: load report + static findings."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from hstrace.findings import Finding, in_dataflow_order


def _metrics_from_training(
    model: Any, report: Any, path: str
) -> tuple[list[Finding], dict[str, Any]]:
    from hstrace.check import training_findings

    try:
        from hstrace.training import open_training
    except ImportError:
        return [], {"skipped": "training readers (hstrace.training) not available in this build"}
    td = open_training(path)  # TrainingDataError (one line) for a bad dir
    if "embed_tokens.weight" in report.missing:
        found, metrics = training_findings(model, td, max_samples=1, steps=0)
        metrics["skipped"] = (
            "the checkpoint carries no embedding (SpecForge/EAGLE save none); accuracy needs the target's"
        )
        return found, metrics
    return training_findings(model, td)


@click.command(name="check")
@click.argument("drafter", type=click.Path())
@click.option(
    "--against",
    "against",
    type=click.Path(),
    default=None,
    help="Training data dir to compare the stored slots and compute metrics.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--dialect",
    type=click.Choice(["speculators", "specforge", "eagle"]),
    default=None,
    help="Override the detected checkpoint dialect.",
)
@click.option(
    "--sglang-version",
    default=None,
    help="Keep only findings that apply to this SGLang version (e.g. 0.5.23).",
)
def check(
    drafter: str,
    against: str | None,
    as_json: bool,
    dialect: str | None,
    sglang_version: str | None,
) -> int:
    """Load a drafter checkpoint and report static wiring problems (exit 0 clean, 1 faults, 2 bad input)."""
    from hstrace.check import applies, static_findings
    from hstrace.drafter import load_drafter

    model, report = load_drafter(drafter, dialect=dialect)
    findings, metrics = static_findings(report, model)
    if against:
        more, metrics["training"] = _metrics_from_training(model, report, against)
        findings += more
    if sglang_version:
        findings = [f for f in findings if applies(f, "sglang", sglang_version)]
    findings = in_dataflow_order(findings)
    faults = sum(f.severity == "fault" for f in findings)
    if as_json:
        doc = {
            "dialect": report.dialect,
            "findings": [f.to_json() for f in findings],
            "metrics": metrics,
            "load_report": report.to_json(),
        }
        click.echo(json.dumps(doc, indent=2, default=str))
    else:
        _print_rich(report, findings, metrics)
    return 1 if faults else 0


def _print_rich(report: Any, findings: list[Finding], metrics: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(file=sys.stdout)
    con.print(
        f"[bold]{report.path}[/]  dialect [cyan]{report.dialect}[/] ({report.dialect_source}), weights {report.weight_file}"
    )
    con.print(
        f"tensors: {len(report.key_map)} in checkpoint, {len(report.unmapped)} unmapped; parameters: {len(report.loaded)} loaded, {len(report.missing)} not loaded {report.missing or ''}"
    )
    flags = Table("flag", "value", "source", title="flags")
    for name, (value, source) in report.flags.items():
        flags.add_row(name, str(value), source)
    con.print(flags)
    if not findings:
        con.print("[green]no findings[/]")
    for f in findings:
        color = {"fault": "red", "warning": "yellow", "info": "blue"}[f.severity]
        scope = f"  [dim](applies to {f.applies_to})[/]" if f.applies_to else ""
        con.print(f"[{color}]{f.severity}[/] [bold]{f.code}[/] [{f.stage}] {f.summary}{scope}")
        con.print(
            f"    evidence: {json.dumps(f.evidence, default=str)}", markup=False, highlight=False
        )
        con.print(f"    fix: {f.fix}", markup=False, highlight=False)
    train = metrics.get("training")
    if train:
        con.print(f"training: {json.dumps(train, default=str)}", markup=False, highlight=False)
