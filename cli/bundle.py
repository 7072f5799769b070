"""`hstrace bundle TRACE -o FILE.zip`: one zip for a bug report (hstrace.bundle)."""

from __future__ import annotations

import json

import click

from hstrace.errors import HstraceError


@click.command(
    name="bundle",
    help="Pack a trace (or part of it) into one zip for a bug report. With --against, REPORT.md "
    "is the replay verdict on the bundled subset, printed too, and the exit code is the "
    "verdict's: 0 = no fault, 1 = fault, 3 = could not judge; 2 = bad input.",
)
@click.argument("trace", type=click.Path())
@click.option(
    "-o",
    "--output",
    "out",
    required=True,
    type=click.Path(),
    help="The bundle to write (FILE.zip).",
)
@click.option(
    "--requests",
    default=None,
    help="Keep only these requests: engine request ids or request keys, comma-separated.",
)
@click.option(
    "--steps", default=None, help="Keep these engine steps: N, A:B (half-open), comma-separated."
)
@click.option(
    "--max-size",
    default=None,
    help="Keep the zip under this size (e.g. 50MB) by keeping fewer steps.",
)
@click.option(
    "--redact",
    type=click.Choice(["ids", "hidden"]),
    multiple=True,
    help="ids: salted token-id hashes; hidden: drop hidden states, keep per-slot stats and fingerprints. Repeatable.",
)
@click.option(
    "--salt-file",
    type=click.Path(),
    default=None,
    help="Salt for --redact ids (reuse it to redact the training side); a new one is written next to the zip otherwise.",
)
@click.option(
    "--drafter",
    type=click.Path(),
    default=None,
    help="The drafter checkpoint (dir or file): config and hashes go in the manifest.",
)
@click.option(
    "--with-drafter", is_flag=True, help="Also put the drafter checkpoint files into the zip."
)
@click.option(
    "--against",
    type=click.Path(),
    default=None,
    help="Training dir: REPORT.md is the replay verdict on the bundled subset; the command "
    "prints it and exits with its code.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print what was written as JSON: path, bytes, engine steps kept, verdict, exit_code.",
)
def bundle(
    trace,
    out,
    requests,
    steps,
    max_size,
    redact,
    salt_file,
    drafter,
    with_drafter,
    against,
    as_json,
) -> int:
    from hstrace.bundle import BundleOptions, parse_size, read_salt
    from hstrace.pipelines import bundle as make_bundle

    if salt_file and "ids" not in redact:
        raise HstraceError("--salt-file only applies with --redact ids")
    opts = BundleOptions(
        steps=steps,
        requests=requests,
        max_size=parse_size(max_size) if max_size else None,
        redact=tuple(redact),
        salt=read_salt(salt_file) if salt_file else None,
        drafter=drafter,
        with_drafter=with_drafter,
        against=against,
    )
    res = make_bundle(trace, out, opts)
    if as_json:
        click.echo(json.dumps(res.to_json(), indent=2))
        return res.exit_code
    kept = ", ".join(
        f"rank{r}: {len(s)}/{res.total_engine_steps[r]}" for r, s in res.engine_steps.items()
    )
    click.echo(
        f"wrote {res.path} ({res.size} bytes): engine steps {kept}; REPORT.md = {res.report_kind}"
    )
    click.echo(f"reproduce: {res.reproduce}")
    if res.salt_written:
        click.echo(
            f"salt written to {res.salt_written} (keep it private; it is not in the zip). Redact the "
            "training side with the same salt: hstrace.redaction.hash_token_ids(ids, salt) "
            "with salt = hstrace.redaction.read_salt(SALT), or pass --salt-file to the next bundle."
        )
    if res.replay:  # the verdict REPORT.md holds, and the exit code that goes with it
        v = res.replay.get("verdict") or {}
        stage = f" ({v.get('stage')})" if v.get("stage") else ""
        click.echo(f"verdict: {v.get('code')}{stage}: {v.get('summary')}")
        for name, why in (res.replay.get("failed") or {}).items():
            click.echo(f"judgement incomplete: {name} failed internally: {why}")
    return res.exit_code
