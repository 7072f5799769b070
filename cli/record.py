"""`hstrace record`: run an engine with hstrace's hooks and record a trace."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hstrace.engines.base import (
    DEFAULT_STREAMS,
    SAMPLING_KEYS,
    STREAMS,
    EngineConfig,
    RecordOptions,
)
from hstrace.engines.registry import ENGINES, engine_for_command, engine_spec, get_engine
from hstrace.errors import HstraceError
from hstrace.prompts import load_prompts_from_training, load_prompts_jsonl


def parse_streams(value: str | None) -> frozenset[str]:
    if value is None:
        return DEFAULT_STREAMS
    chosen = frozenset(s.strip() for s in value.split(",") if s.strip())
    if "all" in chosen:
        return frozenset(STREAMS)
    unknown = chosen - set(STREAMS)
    if unknown:
        raise click.BadParameter(
            f"unknown stream(s) {', '.join(sorted(unknown))}; known: {', '.join(STREAMS)}, all"
        )
    return chosen


def parse_sampling(value: str | None) -> dict[str, float | int]:
    """`--sampling JSON`: an object of known sampling parameters with numeric values."""
    if value is None:
        return {}
    import json

    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise HstraceError(f"--sampling: not JSON ({exc.msg})") from None
    if not isinstance(parsed, dict):
        raise HstraceError("--sampling: give a JSON object, e.g. '{\"temperature\": 0.8}'")
    unknown = sorted(set(parsed) - set(SAMPLING_KEYS))
    if unknown:
        raise HstraceError(
            f"--sampling: unknown parameter(s) {', '.join(unknown)}; known: "
            + ", ".join(SAMPLING_KEYS)
        )
    bad = [k for k, v in parsed.items() if isinstance(v, bool) or not isinstance(v, int | float)]
    if bad:
        raise HstraceError(f"--sampling: {', '.join(sorted(bad))} must be a number")
    return parsed


@click.command(name="record")
@click.option(
    "--engine",
    "engine_name",
    type=click.Choice(list(ENGINES)),
    default=None,
    help="Backend. Default: read from --server-cmd (vllm for a vllm command, else sglang), "
    "else reference.",
)
@click.option(
    "--server-cmd",
    help='The server launch command, e.g. "python -m sglang.launch_server ..." or '
    '"python -m vllm.entrypoints.openai.api_server ...".',
)
@click.option(
    "--runner",
    type=click.Choice(["v1", "v2"]),
    default=None,
    help="vllm 0.33+: the model runner. Default v1 (hstrace sets VLLM_USE_V2_MODEL_RUNNER=0 and "
    "says so); v2 records Model Runner V2, whose taps are not live-tested.",
)
@click.option(
    "--target", type=click.Path(path_type=Path), help="reference engine: HF target model dir."
)
@click.option(
    "--drafter", type=click.Path(path_type=Path), help="reference engine: EAGLE-3 drafter dir."
)
@click.option("--device", default="cpu", show_default=True, help="reference engine: torch device.")
@click.option(
    "--out", required=True, type=click.Path(path_type=Path), help="Trace to create (Zarr v3 dir)."
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(path_type=Path),
    help="JSONL: input_ids or text per line.",
)
@click.option(
    "--prompts-from",
    "training_dir",
    type=click.Path(path_type=Path),
    help="Training dump dir; its samples' token ids are sent as-is.",
)
@click.option(
    "--samples",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="How many training samples --prompts-from sends.",
)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option(
    "--record",
    "streams",
    default=None,
    help=f"Comma-separated streams ({', '.join(STREAMS)}, all). Default: all but logits.",
)
@click.option(
    "--on-full",
    type=click.Choice(["block", "drop"]),
    default="block",
    show_default=True,
    help="When the writer falls behind: stall serving, or drop steps (counted).",
)
@click.option(
    "--knob",
    "knobs",
    multiple=True,
    metavar="KEY=VALUE",
    help="reference engine: reproduce an engine behaviour (repeatable; VALUE is JSON, e.g. "
    "--knob capture_convention=before_layer --knob 'norm_flags={\"feed_normed\": true}'). "
    "Knobs: hstrace.engines.reference.ReferenceKnobs.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Prompts in flight at once (sglang, vllm: the scheduler batches them); 1 = one after "
    "another.",
)
@click.option(
    "--sampling",
    "sampling_json",
    default=None,
    metavar="JSON",
    help="Sampling parameters of every driven request (sglang, vllm), e.g. "
    '\'{"temperature": 0.8, "top_p": 0.9}\'; keys: temperature, top_p, top_k, min_p, '
    "repetition_penalty, frequency_penalty, presence_penalty, seed. Default: temperature 0.",
)
@click.option(
    "--startup-timeout",
    type=float,
    default=900.0,
    show_default=True,
    help="Seconds to wait for the server to become healthy.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print what was recorded as JSON: out, engine, engine_version, prompts_sent, "
    "prompts_completed, ok, error, exit_code.",
)
def record(
    engine_name: str | None,
    server_cmd: str | None,
    runner: str | None,
    target: Path | None,
    drafter: Path | None,
    device: str,
    out: Path,
    prompts_file: Path | None,
    training_dir: Path | None,
    samples: int,
    max_new_tokens: int,
    streams: str | None,
    on_full: str,
    knobs: tuple[str, ...],
    startup_timeout: float,
    concurrency: int,
    sampling_json: str | None,
    as_json: bool,
) -> None:
    """Run an engine with hstrace's hooks and record a trace.

    Exit 0 = recorded and closed cleanly, 1 = the recording failed (the trace keeps what was
    committed and says so), 2 = bad input or usage."""
    if engine_name is None:
        engine_name = engine_for_command(server_cmd) if server_cmd else "reference"
    if engine_spec(engine_name).support is not None and not server_cmd:
        raise click.UsageError(f"--engine {engine_name} needs --server-cmd")
    if (prompts_file is None) == (training_dir is None):
        raise click.UsageError(
            "give exactly one of --prompts FILE.jsonl or --prompts-from TRAINING_DIR"
        )
    if out.exists():
        raise HstraceError(f"{out} already exists; hstrace record never overwrites a trace")
    if knobs and engine_name != "reference":
        raise HstraceError("--knob applies only to --engine reference")
    extra: dict = {}
    if knobs:
        from hstrace.engines.reference.engine import parse_knob

        extra = dict(parse_knob(k) for k in knobs)
    if runner is not None:
        if engine_name != "vllm":
            raise HstraceError("--runner applies only to --engine vllm")
        extra["runner"] = runner
    sampling = parse_sampling(sampling_json)
    if sampling and engine_spec(engine_name).support is None:
        raise HstraceError(f"--sampling applies to a served engine, not --engine {engine_name}")
    options = RecordOptions(
        max_new_tokens=max_new_tokens,
        streams=parse_streams(streams),
        on_full=on_full,
        startup_timeout_s=startup_timeout,
        concurrency=concurrency,
        sampling=sampling,
        show_progress=sys.stderr.isatty(),
    )
    engine = get_engine(
        engine_name,
        EngineConfig(
            server_cmd=server_cmd, target=target, drafter=drafter, device=device, extra=extra
        ),
    )
    engine.check_supported()  # refuse before anything starts or any prompt is read twice
    prompts = (
        load_prompts_jsonl(prompts_file)
        if prompts_file is not None
        else load_prompts_from_training(training_dir, samples)
    )  # type: ignore[arg-type]
    result = engine.record(prompts, out, options)
    if as_json:
        import json

        click.echo(
            json.dumps(
                {
                    "out": str(result.out),
                    "engine": result.engine,
                    "engine_version": result.engine_version,
                    "prompts_sent": result.prompts_sent,
                    "prompts_completed": result.prompts_completed,
                    "ok": result.ok,
                    "error": result.error,
                    "send_wall_s": result.send_wall_s,
                    "exit_code": 0 if result.ok else 1,
                },
                indent=2,
            )
        )
    summary = (
        f"recorded {result.prompts_completed}/{result.prompts_sent} prompts with "
        f"{result.engine} {result.engine_version} into {result.out}"
    )
    if not result.ok:
        click.echo(f"hstrace: {summary}; the trace keeps what was recorded and says so", err=True)
        click.echo(f"hstrace: error: {result.error}", err=True)
        sys.exit(1)
    if not as_json:
        click.echo(summary)
