"""A dormant vLLM server driven the way the live arm tests drive it (tests/test_vllm_arm_live.py,
tests/test_vllm_tp2_live.py): completions sent two at a time, the `hstrace` CLI as a
subprocess, and every process's control-channel `hello` polled until all agree."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hstrace.engines import control
from hstrace.engines.control import Connection, wait_sockets


def complete(
    port: int, model: str, ids: list[int], new_tokens: int, ignore_eos: bool = False
) -> list[int]:
    """One greedy completion of the token ids `ids`: the token ids the server answered
    (`ignore_eos`: all `new_tokens` of them)."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": new_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
        **({"ignore_eos": True} if ignore_eos else {}),
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return list(json.loads(r.read())["choices"][0]["token_ids"])


def send(
    port: int, model: str, prompts: list[list[int]], new_tokens: int, ignore_eos: bool = False
) -> list[list[int]]:
    """The prompts, two in flight (the scheduler batches them); answers in prompt order."""
    with ThreadPoolExecutor(2) as pool:
        return list(
            pool.map(lambda ids: complete(port, model, ids, new_tokens, ignore_eos), prompts)
        )


def hstrace_cli(*args: str) -> subprocess.Popen:
    """`python -m hstrace ARGS...` in the background, its stdout and stderr kept."""
    return subprocess.Popen(
        [sys.executable, "-m", "hstrace", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_armed(run: Path, want: bool, timeout_s: float = 60) -> list[dict]:
    """Every process's `hello` once all say `armed == want` (or the last answers at timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        hellos = []
        for path in wait_sockets(run, 1, 5):
            conn = Connection(path)
            try:
                hellos.append(conn.ask({"cmd": "hello"}))
            finally:
                conn.close()
        if hellos and all(h["armed"] is want for h in hellos):
            return hellos
        if time.monotonic() > deadline:
            return hellos
        time.sleep(0.2)


def arm_in_thread(
    run: Path, out: Path, streams: list[str] | None = None, timeout_s: float = 30, **kw
) -> tuple[threading.Thread, dict]:
    """`control.arm` from a thread (it holds the lease until the session ends), returned once
    every process is armed or the arm failed: the thread, and a box with its `session` or its
    `error`. `streams` default: ["requests"]; `kw`: `control.arm`'s options."""
    box: dict = {}
    ready = threading.Event()

    def go() -> None:
        try:
            box["session"] = control.arm(
                str(run), out, streams or ["requests"], armed=lambda s: ready.set(), **kw
            )
        except BaseException as exc:  # the test reads it
            box["error"] = exc
        ready.set()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    assert ready.wait(timeout_s), "arm did not return"
    return t, box
