"""The terminal view of a trace summary (`hstrace show`; `--json` prints the dict itself)."""

from __future__ import annotations

from typing import Any

from hstrace.report.acceptance import terminal_table


def render_summary_terminal(s: dict[str, Any], console: Any = None) -> None:
    """`hstrace show`'s view of `hstrace.trace.summarize(trace)` (the same dict as --json)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    engine = s["engine"]
    head = Table(title=f"hstrace trace {s['path']}", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    head.add_row("engine", f"{engine.get('name', '?')} {engine.get('version', '?')}")
    head.add_row("hstrace / schema", f"{s['hstrace_version']} / v{s['schema_version']}")
    head.add_row("created", f"{s['created']} on {s['host']}")
    head.add_row("command", " ".join(map(str, s["command_line"]))[:200] or "-")
    head.add_row("ranks", ", ".join(map(str, s["ranks"])) or "none")
    head.add_row(
        "closed cleanly", "yes" if s["clean_close"] else "[red]no[/red] (committed prefix only)"
    )
    head.add_row("requests", str(s["requests"]))
    tok = s["tokens"]
    head.add_row(
        "target tokens", f"{tok['total']} ({tok['prefill']} prefill, {tok['verify']} verify)"
    )
    dr = s["draft_rows"]
    head.add_row(
        "draft rows", f"{dr['total']} ({dr['draft_extend']} extend, {dr['draft_step']} step)"
    )
    dropped = s["dropped_steps"]
    detail = ", ".join(f"{k}: {v}" for k, v in dropped.items() if k != "total")
    head.add_row("dropped steps", f"{dropped['total']}" + (f" ({detail})" if detail else ""))
    head.add_row("tap errors", str(len(s["tap_errors"])))
    console.print(head)

    ranks = Table(title="per rank", title_justify="left")
    for col in ("rank", "clean", "steps", "tokens", "draft rows", "dropped", "errors"):
        ranks.add_column(col, justify="right" if col != "steps" else "left")
    for p in s["per_rank"]:
        steps = ", ".join(f"{k} {v}" for k, v in sorted(p["steps"].items())) or "-"
        ranks.add_row(
            str(p["rank"]),
            "yes" if p["clean_close"] else "no",
            steps,
            str(p["tokens"]["total"]),
            str(p["draft_rows"]["total"]),
            str(p["dropped_steps"]),
            str(p["tap_errors"]),
        )
    console.print(ranks)

    acc = s["acceptance"]
    if acc["verify_rows"]:
        t = Table(
            title=f"accept_len over {acc['verify_rows']} verify rows (bonus excluded)",
            title_justify="left",
        )
        t.add_column("accept_len", justify="right")
        t.add_column("count", justify="right")
        t.add_column("share", justify="right")
        for k, c in acc["histogram"].items():
            t.add_row(k, str(c), f"{c / acc['verify_rows']:.1%}")
        console.print(t)
        console.print(
            f"mean accept length {acc['mean_accept_len']:.3f} excluding the bonus token, "
            f"{acc['mean_accept_len_incl_bonus']:.3f} including it"
        )
        console.print(terminal_table(acc["by_position"]))
    else:
        console.print("acceptance: no verify rows recorded")
    _requests_table(s.get("request_list") or [], console)
    for e in s["tap_errors"]:
        console.print(f"[yellow]tap error[/yellow] rank {e['rank']} {e['tap']}: {e['message']}")


# The columns `hstrace show` prints per request (all are in --json's `request_list`).
_SHOWN = (
    ("temperature", "temp"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("repetition_penalty", "rep"),
    ("frequency_penalty", "freq"),
    ("presence_penalty", "pres"),
    ("seed", "seed"),
    ("max_tokens", "max"),
)


def _requests_table(requests: list[dict[str, Any]], console: Any) -> None:
    """The recorded requests: engine request id, prompt length, cache hit, sampling."""
    from rich.table import Table

    if not requests:
        return
    t = Table(title=f"requests ({len(requests)}, sampling as the engine resolved it)")
    for col in ("rid", "prompt", "cached", *(short for _, short in _SHOWN)):
        t.add_column(col, justify="left" if col == "rid" else "right")
    for r in requests:
        sp = r.get("sampling") or {}
        t.add_row(
            r["rid"],
            str(r["n_prompt"]),
            "-" if r["n_cached"] is None else str(r["n_cached"]),
            *("-" if sp.get(name) is None else f"{sp[name]:g}" for name, _ in _SHOWN),
        )
    console.print(t)
