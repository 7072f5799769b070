"""`hstrace record`: run an engine with hstrace's hooks and record a trace."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from hstrace.cli.options import out_option, parse_streams, stop_options, stream_options

from hstrace.engines.base import (
    SAMPLING_PARAMS,
    STREAMS,
    EngineConfig,
    RecordOptions,
    SamplingValue,
    sampling_value,
)
from hstrace.engines.registry import ENGINES, engine_for_command, engine_spec, get_engine
from hstrace.errors import HstraceError
from hstrace.prompts import load_prompts_from_training, load_prompts_jsonl


def parse_sampling(value: str | None) -> dict[str, SamplingValue]:
    """`--sampling JSON`: an object of known sampling parameters, each of its type
    (`SAMPLING_PARAMS`: numbers; `stop_token_ids` a list of token ids)."""
    if value is None:
        return {}
    import json

    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise HstraceError(f"--sampling: not JSON ({exc.msg})") from None
    if not isinstance(parsed, dict):
        raise HstraceError("--sampling: give a JSON object, e.g. '{\"temperature\": 0.8}'")
    unknown = sorted(set(parsed) - set(SAMPLING_PARAMS))
    if unknown:
        raise HstraceError(
            f"--sampling: unknown parameter(s) {', '.join(unknown)}; known: "
            + ", ".join(SAMPLING_PARAMS)
        )
    out: dict[str, SamplingValue] = {}
    for k, v in parsed.items():
        try:
            out[k] = sampling_value(k, v)
        except ValueError as exc:
            raise HstraceError(f"--sampling: {k} {exc}") from None
    return out


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
@out_option
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(path_type=Path),
    help="JSONL, one object a line: prompt | prompt_token_ids | messages [{role, content}], "
    "optional sampling {temperature, top_p, top_k, min_p, repetition_penalty, "
    "frequency_penalty, presence_penalty, seed, max_tokens, min_tokens, stop_token_ids}.",
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
@stream_options(f"Comma-separated streams ({', '.join(STREAMS)}, all). Default: all but logits.")
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
    "repetition_penalty, frequency_penalty, presence_penalty, seed, min_tokens, "
    "stop_token_ids (a list of token ids). Default: temperature 0.",
)
@click.option(
    "--startup-timeout",
    type=float,
    default=900.0,
    show_default=True,
    help="Seconds to wait for the server to become healthy.",
)
@click.option(
    "--serve",
    is_flag=True,
    help="Passive recording: start the server with the hooks, print its address, and record "
    "what your own clients send (OpenAI or native API, any sampling) until --requests N "
    "finished, --duration S passed, or Ctrl-C / SIGTERM; then close the trace.",
)
@stop_options(
    requests_help="--serve: stop after N requests finished (the engine's own counter).",
    duration_help="--serve: stop after S seconds of serving.",
)
@click.option(
    "--sample-every",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="vLLM: record one request in K (the 1st, K+1-th, ...); the others pay only a check.",
)
@click.option(
    "--parity",
    is_flag=True,
    help="After recording, run the same greedy prompts on the same server command with "
    "speculative decoding off and compare outputs token by token (spec-changes-output).",
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
    serve: bool,
    requests: int | None,
    duration: float | None,
    sample_every: int,
    parity: bool,
    as_json: bool,
) -> None:
    """Run an engine with hstrace's hooks and record a trace.

    Exit 0 = recorded and closed cleanly, 1 = the recording failed (the trace keeps what was
    committed and says so), 2 = bad input or usage."""
    if engine_name is None:
        engine_name = engine_for_command(server_cmd) if server_cmd else "reference"
    if engine_spec(engine_name).support is not None and not server_cmd:
        raise click.UsageError(f"--engine {engine_name} needs --server-cmd")
    check_mode(serve, prompts_file, training_dir, requests, duration, parity)
    if (serve or sample_every > 1) and engine_spec(engine_name).support is None:
        raise click.UsageError(f"--serve / --sample-every need a server engine, not {engine_name}")
    if sample_every > 1 and (engine_name != "vllm" or runner == "v2"):
        raise click.UsageError("--sample-every is supported on vLLM's V1 model runner only")
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
        show_progress=sys.stderr.isatty(),
        sample_every=sample_every,
    )
    engine = get_engine(
        engine_name,
        EngineConfig(
            server_cmd=server_cmd, target=target, drafter=drafter, device=device, extra=extra
        ),
    )
    engine.check_supported()  # refuse before anything starts or any prompt is read twice
    parity_report: dict | None = None
    if serve:
        from hstrace.engines.server import ServeUntil

        result = engine.serve(out, options, ServeUntil(requests, duration))  # type: ignore[attr-defined]
    else:
        prompts = (
            load_prompts_jsonl(prompts_file)
            if prompts_file is not None
            else load_prompts_from_training(training_dir, samples)
        )  # type: ignore[arg-type]
        if sampling:  # --sampling: every prompt's defaults, a JSONL line's own keys win
            import dataclasses

            prompts = [
                dataclasses.replace(p, sampling=tuple({**sampling, **dict(p.sampling)}.items()))
                for p in prompts
            ]
        plain_cmd = None
        if parity:  # refuse before the first server starts
            plain_cmd = command_without_speculation(engine_name, server_cmd)
        result = engine.record(prompts, out, options)
        if parity and result.ok:
            parity_report = run_parity(
                engine_name, plain_cmd, extra, prompts, result, options, startup_timeout
            )
            keep_parity(out, parity_report)
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
                    "stopped_by": result.stopped_by,
                    "parity": parity_report,
                    "exit_code": 0 if result.ok and not parity_failed(parity_report) else 1,
                },
                indent=2,
            )
        )
    summary = (
        f"recorded {result.prompts_completed}/{result.prompts_sent} prompts with "
        f"{result.engine} {result.engine_version} into {result.out}"
    )
    if result.stopped_by is not None:
        summary = (
            f"recorded {result.prompts_completed} requests of your clients with {result.engine} "
            f"{result.engine_version} into {result.out} (stopped: {result.stopped_by})"
        )
    if not result.ok:
        click.echo(f"hstrace: {summary}; the trace keeps what was recorded and says so", err=True)
        click.echo(f"hstrace: error: {result.error}", err=True)
        sys.exit(1)
    if not as_json:
        click.echo(summary)
        if parity_report is not None:
            click.echo(parity_line(parity_report))
    if parity_failed(parity_report):
        sys.exit(1)


def check_mode(
    serve: bool,
    prompts_file: Path | None,
    training_dir: Path | None,
    stop_requests: int | None,
    duration: float | None,
    parity: bool,
) -> None:
    """Driven (prompts given) or passive (--serve) recording, with each one's options only."""
    if serve:
        if prompts_file is not None or training_dir is not None:
            raise click.UsageError("--serve records your own clients: no --prompts/--prompts-from")
        if parity:
            raise click.UsageError("--parity replays the prompts hstrace sends: not with --serve")
        return
    if stop_requests is not None or duration is not None:
        raise click.UsageError("--requests / --duration apply only to --serve")
    if (prompts_file is None) == (training_dir is None):
        raise click.UsageError(
            "give exactly one of --prompts FILE.jsonl or --prompts-from TRAINING_DIR (or --serve)"
        )


def command_without_speculation(engine_name: str, server_cmd: str | None) -> str:
    import shlex

    try:
        return shlex.join(
            engine_spec(engine_name).without_speculation(shlex.split(server_cmd or ""))
        )
    except ValueError as exc:
        raise click.UsageError(f"--parity: {exc}") from exc


def run_parity(
    engine_name: str,
    plain_cmd: str | None,
    extra: dict,
    prompts: list,
    result,
    options: RecordOptions,
    startup_timeout: float,
) -> dict:
    """The same prompts on the same server command with speculation off (no hooks), compared
    with the recorded run token by token (`hstrace.engines.parity`)."""
    import dataclasses
    import shlex
    import shutil
    import tempfile

    from hstrace.engines.parity import compare_outputs

    click.echo(f"hstrace: parity: the same prompts without speculation: {plain_cmd}", err=True)
    plain = get_engine(
        engine_name, EngineConfig(server_cmd=plain_cmd, extra={**extra, "baseline": True})
    )
    scratch = Path(tempfile.mkdtemp(prefix="hstrace-parity-")) / "plain.zarr"
    plain_result = plain.record(prompts, scratch, dataclasses.replace(options))
    if not plain_result.ok:
        raise HstraceError(f"--parity: the run without speculation failed: {plain_result.error}")
    shutil.rmtree(scratch.parent, ignore_errors=True)  # only its outputs were needed
    report = compare_outputs(prompts, result.request_metrics, plain_result.request_metrics)
    report["command_without_speculation"] = shlex.split(plain_cmd or "")
    return report


def keep_parity(out: Path, report: dict) -> None:
    """The comparison goes in the trace (`static.parity`): replay reports it too."""
    import zarr

    root = zarr.open_group(str(out), mode="r+")
    meta = dict(root.attrs.get("hstrace", {}))
    meta["static"] = {**(meta.get("static") or {}), "parity": report}
    root.attrs["hstrace"] = meta


def parity_failed(report: dict | None) -> bool:
    return bool(report and report.get("first_difference"))


def parity_line(report: dict) -> str:
    from hstrace.diagnose.parity import parity_findings

    skipped = f", {len(report['skipped'])} not compared" if report["skipped"] else ""
    found = parity_findings(report)
    if not found:
        return (
            f"parity held ({report['requests']} requests, {report['tokens']} tokens"
            f"{skipped}): speculation does not change the greedy output"
        )
    f = found[0]
    return f"{f.code}: {f.summary}\n  fix: {f.fix}"
