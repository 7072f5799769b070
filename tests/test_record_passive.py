"""`hstrace record --serve / --sample-every / --parity` and `--prompts FILE.jsonl` as logic (no
engine runs here): the JSONL schema and its errors, when passive recording stops, how the
engine's finished-request counter is read, the command without speculation, and the parity
comparison with the finding it names. The live counterpart: tests/test_vllm_serve_live.py.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from hstrace.diagnose.parity import parity_findings
from hstrace.engines.base import Prompt, RecordResult
from hstrace.engines.parity import compare_outputs
from hstrace.engines.registry import engine_spec
from hstrace.engines.server import ServerEngine, ServeUntil, count_metric
from hstrace.engines.vllm.versions import SUPPORT as VLLM_SUPPORT
from hstrace.errors import HstraceError
from hstrace.prompts import load_prompts_jsonl
from tests.helpers.cli import TINY_WORLD, assert_one_line_error, run_main

# ---- --prompts FILE.jsonl ---------------------------------------------------------------------


def _jsonl(tmp_path: Path, *lines: object) -> Path:
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


def test_jsonl_carries_text_ids_chat_messages_and_sampling(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path,
        {"prompt": "hello", "sampling": {"temperature": 0.8, "top_p": 0.9, "seed": 7}},
        {"prompt_token_ids": [5, 6, 7], "id": "ids"},
        "",
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
            ],
            "sampling": {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "max_tokens": 9},
        },
        {"input_ids": [1]},  # the old key
    )
    a, b, c, d = load_prompts_jsonl(path)
    assert a.text == "hello" and a.sampling_for(32) == {
        "temperature": 0.8,
        "max_tokens": 32,
        "top_p": 0.9,
        "seed": 7,
    }
    assert b.input_ids == (5, 6, 7) and b.source_id == "ids"
    assert b.sampling_for(32) == {"temperature": 0.0, "max_tokens": 32}  # greedy by default
    assert c.messages == (("system", "be brief"), ("user", "hi"))
    assert c.sampling_for(32)["max_tokens"] == 9 and c.source_id == "prompts.jsonl:4"
    assert d.input_ids == (1,)


def test_min_tokens_and_stop_token_ids_reach_each_engines_api_under_its_names(
    tmp_path: Path, monkeypatch
) -> None:
    """A JSONL line's `min_tokens` and `stop_token_ids` (a list, kept as a tuple by the frozen
    `Prompt`) are sent as each server's API names them: vLLM's OpenAI completions API takes
    both as they are; SGLang's native `/generate` takes `min_new_tokens`."""
    from hstrace.engines.base import RecordOptions
    from hstrace.engines.sglang import engine as sg
    from hstrace.engines.vllm import engine as vl

    path = _jsonl(
        tmp_path,
        {"prompt_token_ids": [5, 6], "sampling": {"min_tokens": 4, "stop_token_ids": [2, 8]}},
    )
    (p,) = load_prompts_jsonl(path)
    assert dict(p.sampling) == {"min_tokens": 4, "stop_token_ids": (2, 8)}
    sent: list[tuple[str, dict]] = []

    def post(proc, url, body, i, headers):
        sent.append((url, json.loads(json.dumps(body))))  # as it goes on the wire
        return {}

    for module in (sg, vl):
        monkeypatch.setattr(module, "post_json", post)
    vllm_engine = object.__new__(vl.VLLMEngine)
    vllm_engine._model = "m"
    vllm_engine._send_one(None, "http://x", 0, p, RecordOptions(max_new_tokens=9))
    object.__new__(sg.SGLangEngine)._send_one(
        None, "http://x", 1, p, RecordOptions(max_new_tokens=9)
    )
    (v_url, v_body), (s_url, s_body) = sent
    assert v_url.endswith("/v1/completions") and v_body["prompt"] == [5, 6]
    assert (v_body["min_tokens"], v_body["stop_token_ids"], v_body["max_tokens"]) == (4, [2, 8], 9)
    assert s_url.endswith("/generate") and s_body["input_ids"] == [5, 6]
    native = s_body["sampling_params"]
    assert (native["min_new_tokens"], native["stop_token_ids"], native["max_new_tokens"]) == (
        4,
        [2, 8],
        9,
    )
    assert "min_tokens" not in native and "max_tokens" not in native


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("{not json", "prompts.jsonl:2: not valid JSON"),
        ("[1, 2]", "prompts.jsonl:2: expected a JSON object, got list"),
        ({"prompt": "a", "messages": []}, "exactly one of prompt, prompt_token_ids or messages"),
        ({"sampling": {}}, "prompts.jsonl:2: expected exactly one of"),
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids must be a non-empty list"),
        ({"prompt_token_ids": [True]}, "prompt_token_ids must be a non-empty list"),
        ({"messages": [{"role": "user"}]}, "messages[0] must be an object with string role"),
        ({"prompt": "a", "sampling": {"temprature": 1}}, "unknown sampling parameter 'temprature'"),
        ({"prompt": "a", "sampling": {"top_k": 1.5}}, "sampling.top_k must be an integer"),
        ({"prompt": "a", "sampling": {"temperature": "hot"}}, "sampling.temperature must be a num"),
        ({"prompt": "a", "sampling": {"stop_token_ids": 2}}, "sampling.stop_token_ids must be a l"),
        ({"prompt": "a", "sampling": {"stop_token_ids": [True]}}, "stop_token_ids must be a list"),
        ({"prompt": "a", "sampling": [1]}, "prompts.jsonl:2: sampling must be an object"),
    ],
)
def test_a_bad_jsonl_line_is_named(tmp_path: Path, line: object, needle: str) -> None:
    path = _jsonl(tmp_path, {"prompt": "fine"}, line)
    with pytest.raises(HstraceError) as exc:
        load_prompts_jsonl(path)
    assert needle in str(exc.value)


def test_record_exits_2_naming_the_bad_line(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, {"prompt_token_ids": [1, 2]}, {"prompt": "a", "sampling": {"x": 1}})
    run = run_main(
        "record",
        "--engine",
        "reference",
        "--target",
        str(TINY_WORLD / "target"),
        "--drafter",
        str(TINY_WORLD / "drafter-speculators"),
        "--prompts",
        str(path),
        "--out",
        str(tmp_path / "t.zarr"),
    )
    assert_one_line_error(run, f"{path}:2: unknown sampling parameter 'x'")
    assert not (tmp_path / "t.zarr").exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--serve", "--prompts", "p.jsonl"], "--serve records your own clients"),
        (["--requests", "3", "--prompts", "p.jsonl"], "--requests / --duration apply only"),
        (["--serve", "--parity"], "--parity replays the prompts hstrace sends"),
        (["--serve", "--engine", "reference"], "need a server engine, not reference"),
        (
            ["--serve", "--sample-every", "4", "--server-cmd", "python -m sglang.launch_server"],
            "--sample-every is supported on vLLM's V1 model runner only",
        ),
    ],
)
def test_record_mode_usage_errors(tmp_path: Path, args: list[str], needle: str) -> None:
    run = run_main("record", *args, "--out", str(tmp_path / "t.zarr"))
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert needle in run.stderr


def test_parity_needs_a_speculating_command() -> None:
    from cli.record import command_without_speculation

    with pytest.raises(Exception, match="no speculative-decoding flag"):
        command_without_speculation("vllm", "vllm serve m --port 8001")


# ---- when --serve stops -----------------------------------------------------------------------


def test_serve_until_stops_on_the_first_condition_met() -> None:
    until = ServeUntil(requests=5, duration_s=60.0)
    assert until.reason(4, 59.9, []) is None
    assert until.reason(5, 1.0, []) == "5 requests finished (--requests 5)"
    assert until.reason(None, 60.0, []) == "60 s passed (--duration)"  # counter unreadable
    assert until.reason(0, 0.0, ["SIGTERM"]) == "SIGTERM received"  # a signal wins
    assert ServeUntil().reason(10**6, 10**6, []) is None  # only a signal stops it


def test_finished_requests_are_read_off_the_prometheus_counter() -> None:
    text = "\n".join(
        [
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3.0',
            'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 4.0',
            'vllm:request_success_created{engine="0",finished_reason="stop"} 1.7e9',
            'vllm:request_success_total_other{engine="0"} 99.0',
        ]
    )
    assert count_metric(text, "vllm:request_success_total") == 7
    assert count_metric("", "vllm:request_success_total") is None


class _Running:
    """A stand-in for the server process: alive until told otherwise (the loop only polls)."""

    returncode = None

    def poll(self) -> None:
        return None


class _Counting(ServerEngine):
    """A stand-in engine whose finished-request counter rises by one per read, from 10 (the
    requests finished before recording began are not counted)."""

    name = "counting"
    support = VLLM_SUPPORT  # only its label is read
    finished_counter = "x"

    def __init__(self) -> None:
        self.reads = 9

    def finished_requests(self, base: str) -> int | None:
        self.reads += 1
        return self.reads


def _result() -> RecordResult:
    return RecordResult(Path("t"), "counting", "0", 0, 0, ok=False)


def test_the_serve_loop_stops_after_n_finished_requests() -> None:
    eng, result = _Counting(), _result()
    error = eng._serve_until(
        _Running(), "http://h:1", ServeUntil(requests=3, poll_s=0, grace_s=0), None, result
    )  # type: ignore[arg-type]
    assert error is None
    assert result.stopped_by == "3 requests finished (--requests 3)"
    assert result.prompts_completed == 3 and eng.reads == 13  # start 10, then 11, 12, 13


def test_the_serve_loop_stops_on_sigterm_and_restores_the_handlers() -> None:
    eng, result = _Counting(), _result()
    before = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        error = eng._serve_until(_Running(), "http://h:1", ServeUntil(poll_s=0.05), None, result)  # type: ignore[arg-type]
    finally:
        timer.cancel()
    assert error is None and result.stopped_by == "SIGTERM received"
    assert signal.getsignal(signal.SIGTERM) is before
    # without --requests the counter is read once at the start and once at the end
    assert eng.reads == 11 and result.prompts_completed == 1


def test_the_serve_loop_reports_a_server_that_died() -> None:
    class Dead(_Running):
        returncode = -9

        def poll(self) -> int:
            return -9

    error = _Counting()._serve_until(
        Dead(), "http://h:1", ServeUntil(duration_s=5), None, _result()
    )  # type: ignore[arg-type]
    assert error == "the server exited (code -9) while recording"


# ---- --parity ---------------------------------------------------------------------------------


def test_the_command_without_speculation_drops_every_speculative_flag() -> None:
    vllm = engine_spec("vllm").without_speculation(
        ["vllm", "serve", "m", "--speculative-config", '{"method": "eagle3"}', "--port", "8001"]
    )
    assert vllm == ["vllm", "serve", "m", "--port", "8001"]
    assert engine_spec("vllm").without_speculation(
        [
            "python",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--speculative_config={}",
            "-tp",
            "1",
        ]
    ) == ["python", "-m", "vllm.entrypoints.openai.api_server", "-tp", "1"]
    sglang = engine_spec("sglang").without_speculation(
        [
            "python",
            "-m",
            "sglang.launch_server",
            "--model-path",
            "t",
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            "d",
            "--speculative-num-steps=3",
            "--speculative-eagle-topk",
            "1",
            "--port",
            "30001",
        ]
    )
    assert sglang == [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "t",
        "--port",
        "30001",
    ]


def _p(i: int, temperature: float | None = None) -> Prompt:
    sampling = () if temperature is None else (("temperature", temperature),)
    return Prompt(input_ids=(i,), source_id=f"p{i}", sampling=sampling)


def test_parity_held_counts_requests_and_tokens() -> None:
    prompts = [_p(0), _p(1), _p(2, temperature=0.7)]
    spec = [{"output_ids": [1, 2, 3]}, {"output_ids": [4, 5]}, {"output_ids": [9]}]
    plain = [{"output_ids": [1, 2, 3]}, {"output_ids": [4, 5]}, {"output_ids": [8]}]
    report = compare_outputs(prompts, spec, plain)
    assert report["requests"] == 2 and report["tokens"] == 5
    assert report["first_difference"] is None
    assert report["skipped"] == [
        {"request": 2, "why": "sampled (temperature > 0): not deterministic"}
    ]
    assert parity_findings(report) == []


def test_the_first_differing_request_and_position_are_named() -> None:
    prompts = [_p(0), _p(1), _p(2)]
    spec = [
        {"output_ids": [1, 2, 3], "rid": "a"},
        {"output_ids": [4, 5, 6, 7], "rid": "b"},
        {"output_ids": [1], "rid": "c"},
    ]
    plain = [{"output_ids": [1, 2, 3]}, {"output_ids": [4, 5, 0, 7]}, {"output_ids": [2]}]
    report = compare_outputs(prompts, spec, plain)
    d = report["first_difference"]
    assert (d["request"], d["source_id"], d["rid"], d["position"]) == (1, "p1", "b", 2)
    assert (d["with_spec"], d["without_spec"]) == (6, 0)
    [f] = parity_findings({**report, "command_without_speculation": ["vllm", "serve", "m"]})
    assert f.code == "spec-changes-output" and f.severity == "fault" and f.stage == "acceptance"
    assert "request 1 (p1), position 2: token 6 with speculation, 0 without" in f.summary
    assert f.evidence["first_difference"]["position"] == 2
    assert "request 1 position 2" in f.fix


def test_a_shorter_output_differs_where_it_ends() -> None:
    report = compare_outputs([_p(0)], [{"output_ids": [1, 2]}], [{"output_ids": [1, 2, 3]}])
    d = report["first_difference"]
    assert d["position"] == 2 and d["with_spec"] is None and d["without_spec"] == 3
    assert "outputs of 2 vs 3 tokens" in parity_findings(report)[0].summary


def test_replay_reports_a_parity_difference_kept_in_the_trace(tmp_path: Path) -> None:
    """`record --parity` keeps its comparison in the trace (`static.parity`, written as
    cli/record.keep_parity writes it); replaying that trace names `spec-changes-output` with
    the request and position, next to the clean capture's other evidence (exit 1)."""
    import shutil

    import zarr

    from cli.record import keep_parity
    from tests.helpers.cli import EXAMPLES, TRAINING

    trace = tmp_path / "clean.zarr"
    shutil.copytree(EXAMPLES / "clean.zarr", trace)
    report = compare_outputs(
        [_p(0), _p(1)],
        [{"output_ids": [4, 5, 6], "rid": "r0"}, {"output_ids": [7, 8, 9], "rid": "r1"}],
        [{"output_ids": [4, 5, 6]}, {"output_ids": [7, 1, 9]}],
    )
    keep_parity(trace, {**report, "command_without_speculation": ["vllm", "serve", "m"]})
    assert zarr.open_group(str(trace), mode="r").attrs["hstrace"]["static"]["parity"] == {
        **report,
        "command_without_speculation": ["vllm", "serve", "m"],
    }
    run = run_main("replay", str(trace), "--against", str(TRAINING), "--json")
    assert run.returncode == 1, run.stderr
    found = {f["code"]: f for f in json.loads(run.stdout)["findings"]}
    f = found["spec-changes-output"]
    assert f["evidence"]["first_difference"]["request"] == 1
    assert f["evidence"]["first_difference"]["position"] == 1
    assert "no-wiring-fault" not in found
