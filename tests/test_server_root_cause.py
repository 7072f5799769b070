"""Issue 24, item 3: a server that dies before it is healthy is reported by its root cause, not
by the wrapper vLLM raises last ("Engine core initialization failed. See root cause above"),
and the message names the server's log.

The fake server prints what vLLM 0.32.0 prints when its CPU worker refuses to start: the texts
are vLLM 0.32.0's (`v1/worker/cpu_worker.py`'s ValueError, `v1/executor/multiproc_executor.py`'s
"WorkerProc failed to start." and its wrapper Exception, `v1/engine/core.py`'s "EngineCore
failed to start.", `v1/engine/utils.py`'s RuntimeError), with vLLM's per-process prefix and log
record head on every line, tracebacks' frames included."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.cli import TRAINING, run_main
from helpers.engines import fake_release_on_path

from hstrace.engines.server import root_cause

CAUSE = (
    "ValueError: Available memory on node 0 (4.85/18.0 GiB) on startup is less than desired "
    "CPU memory utilization (0.92, 16.56 GiB). On the CPU backend, the `--gpu-memory-utilization` "
    "flag controls the fraction of CPU memory reserved (despite its name). To resolve: decrease "
    "`--gpu-memory-utilization` (e.g. `--gpu-memory-utilization 0.5`) or reduce CPU memory used "
    "by other processes."
)

W = "(Worker pid=18026) ERROR 12-02 17:37:32 [multiproc_executor.py:953] "
E = "(EngineCore pid=12534) ERROR 12-02 17:37:33 [core.py:1510] "
VLLM_LOG = f"""\
(APIServer pid=12290) INFO 12-02 17:37:20 [api_utils.py:339] non-default args: {{'model_tag': 'target'}}
(EngineCore pid=12534) INFO 12-02 17:37:29 [core.py:114] Initializing a V1 LLM engine (v0.32.0) with config: model='target'
{W}WorkerProc failed to start.
{W}Traceback (most recent call last):
{W}  File "/venv/lib/python3.11/site-packages/vllm/v1/executor/multiproc_executor.py", line 912, in worker_main
{W}    worker = WorkerProc(*args, **kwargs)
{W}             ^^^^^^^^^^^^^^^^^^^^^^^^^^^
{W}  File "/venv/lib/python3.11/site-packages/vllm/v1/worker/cpu_worker.py", line 83, in __init__
{W}    raise ValueError(
{W}{CAUSE}
(EngineCore pid=12534) INFO 12-02 17:37:32 [multiproc_executor.py:428] [shutdown] Executor: waiting for worker exit count=1
{E}EngineCore failed to start.
{E}Traceback (most recent call last):
{E}  File "/venv/lib/python3.11/site-packages/vllm/v1/executor/multiproc_executor.py", line 815, in wait_for_ready
{E}    raise e from None
{E}Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace for root cause.
(EngineCore pid=12534) Process EngineCore:
(EngineCore pid=12534) Traceback (most recent call last):
(EngineCore pid=12534)   File "/usr/lib/python3.11/multiprocessing/process.py", line 314, in _bootstrap
(EngineCore pid=12534)     self.run()
(EngineCore pid=12534) Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace for root cause.
(APIServer pid=12290) Traceback (most recent call last):
(APIServer pid=12290)   File "/venv/lib/python3.11/site-packages/vllm/v1/engine/utils.py", line 1431, in wait_for_engine_startup
(APIServer pid=12290)     raise RuntimeError(
(APIServer pid=12290) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {{'EngineCore': 1}}
"""


def test_root_cause_skips_frames_and_wrappers():
    assert root_cause(VLLM_LOG) == CAUSE
    # only wrappers: no root cause claimed
    wrappers = "\n".join(ln for ln in VLLM_LOG.splitlines() if CAUSE not in ln)
    assert root_cause(wrappers) is None
    assert root_cause("INFO starting\nINFO loading\n") is None


@pytest.mark.parametrize(
    "log, cause",
    [
        # SGLang's record head, a dotted exception type
        (
            "[2026-12-02 17:00:00 TP0] Scheduler hit an exception: Traceback (most recent call "
            'last):\n  File "x.py", line 1, in run\n    f()\n'
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
            "[2026-12-02 17:00:01] Received sigquit from a child process. It usually means the "
            "child failed.\n",
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        ),
        # the hooks refusing inside the server come first
        (
            "hstrace: error: vllm 0.33.0 is not supported (supported: 0.32.0)\n"
            "RuntimeError: Engine core initialization failed. See root cause above.\n",
            "hstrace: error: vllm 0.33.0 is not supported (supported: 0.32.0)",
        ),
    ],
    ids=["sglang oom", "hstrace refusal"],
)
def test_root_cause_other_shapes(log, cause):
    assert root_cause(log) == cause


def test_record_names_the_root_cause_and_the_log(tmp_path, monkeypatch):
    (tmp_path / "site").mkdir()
    fake_release_on_path(tmp_path / "site", monkeypatch, "vllm", "0.32.0")
    log = tmp_path / "printed.txt"
    log.write_text(VLLM_LOG)
    server = tmp_path / "fake_vllm_server.py"
    server.write_text(
        textwrap.dedent(f"""\
            import sys
            text = open({str(log)!r}).read().splitlines()
            for line in text[:-1]:
                print(line, flush=True)
            print(text[-1], file=sys.stderr, flush=True)
            sys.exit(1)
        """)
    )
    out = tmp_path / "t.zarr"
    run = run_main(
        "record", "--engine", "vllm", "--server-cmd", f"{sys.executable} {server} --port 18977",
        "--prompts-from", str(TRAINING), "--samples", "1", "--out", str(out),
        "--startup-timeout", "60",
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("hstrace: error:")]
    assert len(errors) == 1, run.stderr
    line = errors[0]
    assert line.startswith(
        "hstrace: error: the server exited (code 1) before it became healthy: root cause: " + CAUSE
    ), line
    assert "Engine core initialization failed" not in line
    m = re.search(r"\(the server's whole log: (\S+)\)$", line)
    assert m, line
    assert CAUSE in Path(m.group(1)).read_text()  # the log named holds what the server printed
