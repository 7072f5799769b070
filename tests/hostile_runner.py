"""Runs many `hstrace` command lines, each in its own forked process with a memory and time limit.

Used by tests/test_hostile_inputs.py: importing hstrace's CLI (and torch) once and forking per
command line keeps hundreds of runs affordable on 2 shared cores, while every run is still a
fresh process going through the real entry point (`hstrace.cli.main.main`), with its own exit
status, stderr and peak RSS.

    python tests/hostile_runner.py CASES.json RESULTS.json

CASES.json: [{"id": str, "argv": [...], "timeout_s": float, "mem_mb": int}, ...].
RESULTS.json: [{"id", "rc", "signal", "stderr", "stdout_tail", "wall_s", "rss_mb"}, ...];
`rc` None when the run was killed (`signal`: 14 = ran past its time limit).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _run_one(case: dict, tmp: str) -> dict:
    err_path = os.path.join(tmp, "stderr")
    out_path = os.path.join(tmp, "stdout")
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child: limits, redirected output, the real entry point
        try:
            fd_err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            fd_out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd_out, 1)
            os.dup2(fd_err, 2)
            # Address space: what the preloaded parent already maps, plus the case's budget.
            limit = _vm_size() + int(case["mem_mb"]) * (1 << 20)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            signal.alarm(max(1, int(case["timeout_s"])))
            sys.argv = ["hstrace", *case["argv"]]
            from hstrace.cli.main import main

            main(case["argv"])
            os._exit(0)
        except SystemExit as exc:
            sys.stdout.flush()
            sys.stderr.flush()
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            os._exit(code)
        except BaseException:  # noqa: BLE001 - anything main() let through is a failure
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            os._exit(99)
    _, status, usage = os.wait4(pid, 0)
    wall = time.monotonic() - t0
    with open(err_path, errors="replace") as f:
        stderr = f.read()
    with open(out_path, errors="replace") as f:
        stdout = f.read()
    return {
        "id": case["id"],
        "rc": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "stderr": stderr[-4000:],
        "stdout_tail": stdout[-2000:],
        "wall_s": round(wall, 3),
        "rss_mb": round(usage.ru_maxrss / 1024, 1),
    }


def main() -> None:
    cases_path, results_path = sys.argv[1], sys.argv[2]
    with open(cases_path) as f:
        cases = json.load(f)
    # Preload what the commands import, so each fork starts warm; no torch op runs here
    # (forking after torch has started its thread pools could hang a child).
    import hstrace.cli.main  # noqa: F401
    import torch  # noqa: F401

    for mod in ("hstrace.cli.show", "hstrace.cli.replay", "hstrace.cli.diff", "hstrace.cli.report"):
        __import__(mod)
    for mod in ("hstrace.cli.bundle", "hstrace.cli.check", "hstrace.replay", "hstrace.trace"):
        __import__(mod)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tmp = os.path.dirname(os.path.abspath(results_path))
    results = []
    for case in cases:
        res = _run_one(case, tmp)
        res["base_rss_mb"] = round(base_rss, 1)
        results.append(res)
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
