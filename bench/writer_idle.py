"""CPU the writer process spends while a session is armed: idle, and per step at a server's pace.

    python bench/writer_idle.py [--idle-s 4] [--steps 200] [--pace-ms 11]

A recording session keeps one writer process per rank alive from `arm` to `disarm`; on a busy
server every CPU-millisecond it spends is taken from serving (bench/live_overhead.py). This
measures it with the kernel's own counters (`/proc/PID/task/*/stat`, user + system, every
thread of the writer process): first idle (a table written and flushed, then nothing), then
writing `--steps` steps of five tables shaped like the tiny world's (8 requests, 3 x 64 bf16
states per token, K = 3) at `--pace-ms`. Prints one JSON object: ms of CPU per second idle,
ms of CPU per step paced, and the per-thread split. Ticks are 10 ms: use seconds, not
fractions of one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch
from live_overhead import cpu_by_thread, thread_cpu

from hstrace.trace import TraceWriter, create_trace


def ms_by_thread(pid: int, before: dict) -> tuple[dict[str, float], dict]:
    """CPU ms per thread of `pid` since `before` (live_overhead's per-thread counters)."""
    now = thread_cpu(pid)
    return {k: 1e3 * v for k, v in cpu_by_thread(before, now).items()}, now


def step(w: TraceWriter, i: int) -> None:
    """Five tables of roughly one tiny-world engine step (8 requests verifying 3 drafts)."""
    w.write(
        "target",
        step={"step": i},
        tok={
            "hidden": torch.randn(32, 3, 64).to(torch.bfloat16),
            "token": torch.arange(32),
        },
    )
    w.write(
        "draft_step",
        step={"step": i},
        req={"topk_ids": torch.zeros(8, 3, 8, dtype=torch.int64), "topk_lp": torch.randn(8, 3, 8)},
    )
    w.write(
        "verify",
        step={"step": i},
        req={"accepted": torch.zeros(8, dtype=torch.int64), "lp": torch.randn(8, 4)},
    )
    w.write("requests", step={"step": i}, req={"rid": torch.arange(8)})
    w.write(
        "draft_extend",
        step={"step": i},
        tok={"hidden": torch.randn(32, 64).to(torch.bfloat16)},
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle-s", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--pace-ms", type=float, default=11.0)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="hstrace-writer-idle-")
    try:
        out = os.path.join(work, "t.zarr")
        create_trace(out, engine={"name": "bench", "version": "0"}, command_line=[], static={})
        w = TraceWriter(out, rank=0)
        pid = w.writer_pid
        step(w, 0)
        w.flush()
        time.sleep(3.0)  # past the first tail flush and commit: the idle loop alone
        a = thread_cpu(pid)
        time.sleep(args.idle_s)
        idle, a = ms_by_thread(pid, a)
        t0 = time.perf_counter()
        for i in range(1, args.steps + 1):
            step(w, i)
            time.sleep(args.pace_ms / 1e3)
        wall = time.perf_counter() - t0
        paced, _ = ms_by_thread(pid, a)
        w.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        json.dumps(
            {
                "idle_cpu_ms_per_s": round(sum(idle.values()) / args.idle_s, 1),
                "idle_by_thread_ms": idle,
                "paced_cpu_ms_per_step": round(sum(paced.values()) / args.steps, 3),
                "paced_share_of_a_core": round(sum(paced.values()) / 1e3 / wall, 3),
                "paced_by_thread_ms": paced,
                "steps": args.steps,
                "pace_ms": args.pace_ms,
                "load_avg": os.getloadavg(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
