"""Terminal, Markdown and JSON renderings of a `ReplayResult`.

The terminal lists findings one under the other, each with its evidence beneath it as
`key: value` lines shortened to the console's width, so an 80-column terminal reads it (a
table column of raw arrays wrapped one token per line).
"""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from hstrace.findings import STAGES
from hstrace.replay.impact import impact_lines, verdict_phrase
from hstrace.replay.result import ReplayResult
from hstrace.report.markdown import cell, row

# Metrics shown in the summary table, in dataflow order, with the convention they follow.
METRIC_LABELS: dict[str, str] = {
    "acc0_training": "step-0 acc, training tensors (argmax == next token in data)",
    "acc0_training_teacher": "step-0 acc, training tensors (library teacher, draft vocab)",
    "acc0_serving": "step-0 acc, serving tensors (argmax == next committed token)",
    "engine_vs_reference_top1": "engine vs reference, draft-space top-1 agreement",
    "engine_vs_reference_topk": "engine vs reference, top-k overlap",
    "engine_vs_reference_max_logprob_diff": "engine vs reference, max |logprob diff| (fp32 judge)",
    "target_space_top1": "engine target ids vs reference d2t mapping, top-1 agreement",
    "acc0_mtp_training": "MTP step-0 acc, training inputs (argmax == target's greedy token)",
    "acc0_mtp_serving": "MTP step-0 acc, serving inputs (argmax == target's greedy token)",
    "mean_accept_len": "serving mean accept length (excl. bonus)",
    "verify_rule_predicted_accepted": "accepted drafts the engine's verify rule predicts (Σ a)",
    "verify_rule_realized_accepted": "accepted drafts, as the engine accepted them",
    "verify_rule_sigma": "binomial spread of the prediction (σ)",
}


# The same metrics when no training data was given and every request was judged against its
# reference twin (`inputs.against_kind == "target"`): the "training" side is the target's
# forward on the served tokens, not training tensors.
TWIN_METRIC_LABELS: dict[str, str] = {
    "acc0_training": "step-0 acc, target's forward on served tokens (argmax == next token)",
    "acc0_training_teacher": "step-0 acc, target's forward on served tokens (library teacher, draft vocab)",
}


def metric_labels(result: ReplayResult) -> dict[str, str]:
    """`METRIC_LABELS`, each saying what its metric was computed on for this result."""
    if result.inputs.get("against_kind") == "target":
        return {**METRIC_LABELS, **TWIN_METRIC_LABELS}
    return METRIC_LABELS


RANK_COLUMNS = (
    "rank",
    "steps (target / draft_extend / verify)",
    "requests",
    "aux rows",
    "draft rows",
    "aux vs rank 0",
    "draft vs rank 0",
    "acceptance vs rank 0",
    "load audit vs rank 0",
)


def rank_rows(result: ReplayResult) -> list[tuple[str, ...]]:
    """One row per rank of a multi-rank trace (`metrics.ranks`): what it covered and what was
    compared with rank 0. Empty for a one-rank trace."""
    ranks = result.metrics.get("ranks") or {}
    cov, cmp = ranks.get("coverage") or {}, ranks.get("compared") or {}
    differ: dict[str, list[str]] = {}
    for d in ranks.get("divergences") or []:
        differ.setdefault(str(d.get("rank")), []).append(d.get("what", ""))
    out = []
    for r in ranks.get("ranks") or []:
        c, m = cov.get(str(r), {}), cmp.get(str(r))
        steps = c.get("steps", {})
        head = (
            f"rank {r}",
            " / ".join(str(steps.get(t, 0)) for t in ("target", "draft_extend", "verify")),
            str(c.get("requests", 0)),
            str(c.get("aux_rows", 0)),
            f"{c.get('draft_rows', 0)} (+{c.get('chain_rows', 0)} chain)",
        )
        if m is None:
            out.append((*head, "reference", "reference", "reference", "reference"))
            continue
        aux, dr, acc = m.get("aux", {}), m.get("draft", {}), m.get("acceptance", {})
        items = (m.get("load_audit") or {}).get("load_audit_items") or []
        bad = differ.get(str(r), [])
        out.append(
            (
                *head,
                f"{aux.get('rows', 0)} rows, "
                + ("within bf16" if aux.get("within_bf16") else "DIFFER")
                + f" (max |diff| {aux.get('max_abs_diff', 0)})",
                f"top-1 equal {dr.get('top1_equal', 0)}/{dr.get('rows', 0)}, chain "
                f"{dr.get('chain_top1_equal', 0)}/{dr.get('chain_rows', 0)}",
                f"{acc.get('verify_rounds', 0)} rounds, {acc.get('committed_tokens', 0)} tokens"
                + (", DIFFER" if {"accepted tokens", "committed tokens"} & set(bad) else ", equal"),
                f"{len(items)} items, " + ("DIFFER" if "load audit" in bad else "equal"),
            )
        )
    return out


def _evidence_line(evidence: dict[str, Any], limit: int = 6) -> str:
    parts = []
    for k, v in list(evidence.items())[:limit]:
        if isinstance(v, float):
            v = f"{v:.4g}"
        elif isinstance(v, list | dict) and len(str(v)) > 60:
            v = str(v)[:57] + "..."
        parts.append(f"{k}={v}")
    return ", ".join(parts)


def _short(v: Any, width: int) -> str:
    """One line, at most `width` characters: floats to 4 significant digits, long arrays cut."""
    if isinstance(v, float):
        text = f"{v:.4g}"
    elif isinstance(v, list | tuple):
        text = "[" + ", ".join(f"{x:.4g}" if isinstance(x, float) else str(x) for x in v) + "]"
    else:
        text = str(v)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: max(1, width - 3)] + "..."


def evidence_lines(evidence: dict[str, Any], width: int, limit: int = 12) -> list[str]:
    """`key: value` lines of a finding's evidence, each at most `width` characters."""
    out = []
    for k, v in list(evidence.items())[:limit]:
        head = f"{k}: "
        out.append(head + _short(v, max(8, width - len(head))))
    if len(evidence) > limit:
        out.append(f"... {len(evidence) - limit} more (--json has all of it)")
    return out


def _print_finding(console: Console, n: int, f: Any) -> None:
    from rich.markup import escape
    from rich.padding import Padding

    style = {"fault": "red", "warning": "yellow"}.get(f.severity, "")
    head = f"{n}. [bold]{escape(f.code)}[/] ({escape(f.stage)}, "
    head += f"[{style}]{f.severity}[/])" if style else f"{f.severity})"
    console.print(head)
    console.print(Padding(escape(f.summary), (0, 0, 0, 3)))
    if f.evidence:
        width = max(20, console.width - 5)
        for line in evidence_lines(f.evidence, width):
            console.print(Padding(escape(line), (0, 0, 0, 5)), overflow="ellipsis", no_wrap=True)


def _print_impact(console: Console, result: ReplayResult, f: Any) -> None:
    from rich.markup import escape
    from rich.padding import Padding

    got, why = result.impact_of(f)
    if got is not None:
        console.print(
            Padding(f"[bold]impact:[/] {escape(verdict_phrase(got) or '')}", (0, 0, 0, 3))
        )
        for line in impact_lines(got):
            console.print(Padding(escape(line), (0, 0, 0, 5)))
    elif why:
        console.print(Padding(f"impact: not computed ({escape(why)})", (0, 0, 0, 3)))


def _fmt(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def render_terminal(result: ReplayResult, console: Console | None = None) -> None:
    console = console or Console()
    from rich.markup import escape
    from rich.padding import Padding

    v = result.verdict
    flow = " → ".join(f"[bold red]{s}[/]" if s == v.stage else s for s in STAGES)
    style = "red" if result.faults else ("yellow" if result.failed else "green")
    stage = f" ({v.stage})" if v.stage else ""
    body = f"[bold]{escape(v.code)}[/]{escape(stage)}\n{escape(v.summary)}"
    if v.fix:
        body += f"\n\n[bold]fix:[/] {escape(v.fix)}"
    if result.impact_line(v):
        body += f"\n[bold]impact:[/] {escape(result.impact_line(v))}"
    title = "verdict: first divergence" + (" (judgement incomplete)" if result.failed else "")
    console.print(Panel(body, title=title, border_style=style))
    for line in result.incomplete_lines:  # one line each: what failed, and how
        console.print(f"[bold red]{escape(line)}[/] (exit {result.exit_code})", soft_wrap=True)
    console.print(flow)
    if result.findings:
        console.print("[bold]findings (dataflow order)[/]")
        for n, f in enumerate(result.findings, 1):
            _print_finding(console, n, f)
            _print_impact(console, result, f)
        if result.impact is not None and result.impact.all is not None:
            console.print("[bold]fixing every fault[/]")
            for line in impact_lines(result.impact.all):
                console.print(Padding(escape(line), (0, 0, 0, 3)))
    metrics = Table(title="metrics")
    metrics.add_column("metric")
    metrics.add_column("value", justify="right")
    for key, label in metric_labels(result).items():
        if key in result.metrics and result.metrics[key] is not None:
            metrics.add_row(label, _fmt(result.metrics[key]))
    console.print(metrics)
    ranks = rank_rows(result)
    if ranks:  # one line per rank (a nine-column table does not fit 80 columns)
        console.print("[bold]ranks[/] (each compared with rank 0 on the requests both served)")
        for r in ranks:
            line = "; ".join(
                f"{name}: {value}" for name, value in zip(RANK_COLUMNS[1:], r[1:], strict=True)
            )
            console.print(f"  {r[0]}: {line}", markup=False, soft_wrap=True)
    cov = result.coverage
    if cov:
        line = (
            f"coverage: {cov.get('aligned_requests', 0)}/{cov.get('serving_requests', 0)} requests "
            f"aligned ({cov.get('exact', 0)} exact, {cov.get('prefix', 0)} prefix), "
            f"{cov.get('aligned_tokens', 0)}/{cov.get('serving_tokens', 0)} tokens"
        )
        if cov.get("target_twins"):
            line += f"; {twins_line(result)}"
        console.print(line, markup=False, soft_wrap=True)
    if result.inputs.get("engine_runner"):
        console.print(f"engine: {result.inputs['engine_runner']}", markup=False)
    for line in not_judged_lines(result):
        console.print(f"[yellow]not judged[/]: {escape(line)}", soft_wrap=True)
    for name, why in result.skipped.items():
        console.print(f"[yellow]not checked[/]: {name}: {why}")


def twins_line(result: ReplayResult) -> str:
    """The requests judged against the target's forward instead of a training sample."""
    cov, info = result.coverage, result.inputs.get("reference_twins") or {}
    layers = f" at HF layers {info['layers']}" if info.get("layers") is not None else ""
    return (
        f"{cov.get('target_twins', 0)} request(s) with no training twin judged against the "
        f"target's forward on their served tokens{layers} "
        f"({cov.get('target_twin_tokens', 0)} tokens)"
    )


def not_judged_lines(result: ReplayResult) -> list[str]:
    """One line per stage of the traffic that was not judged (on some or all requests)."""
    out = []
    for n in result.not_judged:
        on = ""
        if n.get("n_requests"):
            names = ", ".join(str(x) for x in n.get("requests", [])[:4])
            more = n["n_requests"] - min(4, len(n.get("requests", [])))
            on = f" on {n['n_requests']} request(s) ({names}{f', +{more}' if more > 0 else ''})"
        out.append(f"{n['what']} [{n['stage']}]{on}: {n['why']}")
    return out


def render_markdown(result: ReplayResult) -> str:
    v = result.verdict
    stage = f"stage `{v.stage}`, " if v.stage else ""
    lines = [
        "# hstrace replay",
        "",
        f"**Verdict: `{v.code}`** ({stage}{v.severity}): {_md(v.summary)}",
        "",
    ]
    if result.failed:
        lines += [
            f"**Judgement incomplete** (exit {result.exit_code}: "
            + ("a fault was found, but not every check ran" if result.faults else "could not judge")
            + "):",
            "",
            *[f"- {_md(line)}" for line in result.incomplete_lines],
            "",
        ]
    if v.fix:
        lines += [f"**Fix:** {_md(v.fix)}", ""]
    if result.impact_line(v):
        lines += [f"**Impact:** {_md(result.impact_line(v))}", ""]
    lines += ["Dataflow: " + " → ".join(f"**{s}**" if s == v.stage else s for s in STAGES), ""]
    if result.findings:
        lines += [
            "## Findings (dataflow order)",
            "",
            "| stage | code | severity | summary | fix |",
            "| --- | --- | --- | --- | --- |",
        ]
        for f in result.findings:
            lines.append(row(f.stage, f"`{f.code}`", f.severity, f.summary, f.fix))
        lines.append("")
        for f in result.findings:
            if f.evidence:
                lines.append(f"- `{f.code}` evidence: {_md(_evidence_line(f.evidence, 20))}")
        lines.append("")
        lines += _impact_markdown(result)
    lines += ["## Metrics", "", "| metric | value |", "| --- | --- |"]
    for key, label in metric_labels(result).items():
        if key in result.metrics and result.metrics[key] is not None:
            lines.append(row(label, _fmt(result.metrics[key])))
    lines.append("")
    ranks = rank_rows(result)
    if ranks:
        lines += [
            "## Ranks",
            "",
            "Each rank compared with rank 0 on the requests both served.",
            "",
            row(*RANK_COLUMNS),
            "| " + " | ".join("---" for _ in RANK_COLUMNS) + " |",
        ]
        lines += [row(*r) for r in ranks]
        lines.append("")
    if result.coverage:
        lines += ["## Coverage", ""]
        lines += [f"- {_md(k)}: {_md(v)}" for k, v in result.coverage.items()]
        if result.coverage.get("target_twins"):
            lines.append(f"- {_md(twins_line(result))}")
        lines.append("")
    if result.not_judged:
        lines += ["## Not judged", ""]
        lines += [f"- {_md(line)}" for line in not_judged_lines(result)]
        lines.append("")
    if result.skipped:
        lines += ["## Not checked", ""]
        lines += [f"- {_md(k)}: {_md(why)}" for k, why in result.skipped.items()]
        lines.append("")
    return "\n".join(lines)


def _impact_markdown(result: ReplayResult) -> list[str]:
    """What each fault costs: served vs fixed, and fixing every fault."""
    rows = []
    for f in result.faults:
        got, why = result.impact_of(f)
        if got is not None:
            rows += [f"- `{f.code}`: {_md(verdict_phrase(got))}"]
            rows += [f"  - {_md(line)}" for line in impact_lines(got)]
        elif why:
            rows.append(f"- `{f.code}`: not computed ({_md(why)})")
    if result.impact is not None and result.impact.all is not None:
        rows.append("- fixing every fault:")
        rows += [f"  - {_md(line)}" for line in impact_lines(result.impact.all)]
    return ["## Impact (expected accept length, as served vs fixed)", "", *rows, ""] if rows else []


def _md(text: Any) -> str:
    return cell(text)


def render_json(result: ReplayResult) -> str:
    return json.dumps(result.to_json(), indent=2, sort_keys=False)
