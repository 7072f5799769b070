"""REPORT.md for a bundle (ready to paste into an issue) and the one-line reproduce command.

With a training dir (`--against`) the report is the replay's Markdown verdict, computed on the
bundled subset itself by the verdict function the pipeline above hands in (`opts.verdict`), so the reproduce command gives the same answer. Without one it is a
summary of the subset (engine, steps, acceptance) that says replay was not run and how to.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from hstrace.errors import HstraceError


def reproduce_line(out: Path, opts: Any) -> str:
    cmd = ["hstrace", "replay", out.name]
    if opts.against:
        cmd += ["--against", str(opts.against)]
    if opts.drafter:
        cmd += ["--drafter", str(opts.drafter)]
    return shlex.join(cmd)


def write_report(
    store: Path, opts: Any, how: Any, reproduce: str
) -> tuple[str, str, dict[str, Any] | None]:
    """(markdown, "replay" | "summary", replay JSON or None)."""
    from hstrace.html.verify_stats import acceptance_of
    from hstrace.report.acceptance import markdown_table
    from hstrace.report.markdown import cell, row
    from hstrace.trace import open_trace

    redaction_note = ""
    if how.modes:
        redaction_note = f"\n> Redacted: {', '.join(how.modes)}."
        if how.ids:
            redaction_note += (
                " Token ids are salted hashes: they align with training data hashed with the same"
                " salt (hstrace.redaction.hash_token_ids); the drafter cannot run on them."
            )
        if how.hidden:
            redaction_note += (
                " Hidden states were replaced by per-slot statistics and 32-d sketches; checks that"
                " need the states cannot run on this zip."
            )
            if opts.against:
                redaction_note += (
                    " The verdict above was computed on the same steps before redaction, so"
                    " replaying this zip reproduces only the checks that do not need hidden states."
                )
        redaction_note += "\n"
    if opts.against:
        if opts.verdict is None:
            raise HstraceError(
                "--against: the verdict comes from the replay pipeline; call "
                "hstrace.pipelines.bundle (or pass BundleOptions.verdict)"
            )
        md, replay_json = opts.verdict(store)  # run on the bundled subset itself
        return (md + redaction_note + f"\n\nReproduce: `{reproduce}`\n", "replay", replay_json)
    with open_trace(store) as tr:
        meta = tr.meta
        eng = meta.get("engine") or {}
        acc = acceptance_of(tr)
        lines = [
            "# hstrace bundle",
            "",
            cell(
                f"Engine: `{eng.get('name')}` {eng.get('version')}; ranks {tr.ranks}; "
                f"schema v{meta.get('schema_version')}."
            ),
            "",
            "**Replay was not run** (no training dir given). To get the verdict, run:",
            "",
            f"    {reproduce} --against TRAINING_DIR",
            "",
            "| table | events (rank 0) |",
            "| --- | --- |",
        ]
        r0 = tr.rank(tr.ranks[0]) if tr.ranks else None
        for name in r0.tables if r0 else []:
            lines.append(row(name, r0.table(name).num_steps))
        lines.append("")
        if acc is not None:
            lines += [
                f"Mean accept length: {acc.mean_accept_len:.3f} draft tokens per verify "
                f"(excluding the bonus token), over {acc.rows} verify rows.",
                "",
                *markdown_table(acc.by_position),
                "",
            ]
    return "\n".join(lines) + redaction_note, "summary", None
