"""CPU the writer process spends while a session is armed: idle, and per step at a server's pace.

    python bench/writer_idle.py [--idle-s 4] [--steps 200] [--pace-ms 11]
    $(bash scripts/vllm-venv.sh | tail -1) bench/writer_idle.py --tiny-world-rows [--drafter mtp]

A recording session keeps one writer process per rank alive from `arm` to `disarm`; on a busy
server every CPU-millisecond it spends is taken from serving (bench/live_overhead.py). This
measures it with the kernel's own counters (`/proc/PID/task/*/stat`, user + system, every
thread of the writer process): first idle (a table written and flushed, then nothing), then
writing `--steps` steps of five tables shaped like the tiny world's (8 requests, 3 x 64 bf16
states per token, K = 3) at `--pace-ms`. Prints one JSON object: ms of CPU per second idle,
ms of CPU per step paced, and the per-thread split. Ticks are 10 ms: use seconds, not
fractions of one.

`--tiny-world-rows` (the vLLM venv): instead of the five synthetic tables, the rows the vLLM
hooks build for the world's steps (`tap_work.py`'s stand-ins of the live bench's world, built
and emitted by `hooks/vllm_patches.py: _emit_step` before the clock starts: every table and
column a live recording writes, ~50 arrays), written at `--pace-ms`. This is the writer's work
of a kept session in `live_overhead.py` (tail flushes and commits included) without a server,
so two trees can be compared by CPU counters rather than by tokens/s.

`--against DIR` (side by side): a second writer process, started from the checkout at DIR
(its `hstrace.trace.write.writer_process`, with this tree's producer: the ring protocol is
the same), is handed every step right after this tree's, into its own trace; both writers'
CPU is read over the same paced window, so what the host does meanwhile falls on both. Run it
from outside both checkouts (the writer is started with -m: the current directory would come
first on its path). Prints both figures and their ratio (this tree over DIR).
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


def world_steps(n: int, batch: int, drafter: str) -> list[list]:
    """The TableWrites of n tiny-world steps as the vLLM hooks emit them (tap_work's steps)."""
    import live_overhead as lo
    import tap_work
    from hstrace.hooks import vllm_patches as vp

    lo.WORLD = lo.WORLDS[drafter]
    rec, steps = tap_work.steps_of(n, batch)
    out: list[list] = []
    for s in steps:
        got: list = []
        rec.emit = got.extend
        vp._emit_step(rec, s, None)
        if rec.disabled:
            raise SystemExit(f"taps disabled: {sorted(rec.disabled)}")
        out.append(got)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle-s", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--pace-ms", type=float, default=11.0)
    ap.add_argument("--tiny-world-rows", action="store_true", help="the hooks' rows (vLLM venv)")
    ap.add_argument("--drafter", choices=["eagle3", "mtp"], default="eagle3")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--against", default="", help="a checkout whose writer runs side by side")
    args = ap.parse_args()
    world = world_steps(args.steps + 1, args.batch, args.drafter) if args.tiny_world_rows else None
    if world is not None:
        from hstrace.hooks.common import write_rows  # what Recorder.emit calls for each table

    def one(w: TraceWriter, i: int) -> None:
        if world is None:
            step(w, i)
        else:
            for tw in world[i]:
                write_rows(w, tw)

    work = tempfile.mkdtemp(prefix="hstrace-writer-idle-")
    try:
        writers = {"this": start_writer(os.path.join(work, "t.zarr"), None)}
        if args.against:
            writers["against"] = start_writer(os.path.join(work, "a.zarr"), args.against)
        for w in writers.values():
            one(w, 0)
            w.flush()
        time.sleep(3.0)  # past the first tail flush and commit: the idle loop alone
        pids = {name: w.writer_pid for name, w in writers.items()}
        a = {name: thread_cpu(pid) for name, pid in pids.items()}
        time.sleep(args.idle_s)
        idle = {}
        for name, pid in pids.items():
            idle[name], a[name] = ms_by_thread(pid, a[name])
        t0 = time.perf_counter()
        staging = []  # this thread's CPU per step handing the rows over (TraceWriter.write)
        order = list(writers.values())
        for i in range(1, args.steps + 1):
            for w in order if i % 2 else order[::-1]:  # who is handed the step first alternates
                c0 = time.thread_time()
                one(w, i)
                if w is writers["this"]:
                    staging.append(time.thread_time() - c0)
            time.sleep(args.pace_ms / 1e3)
        wall = time.perf_counter() - t0
        paced = {name: ms_by_thread(pid, a[name])[0] for name, pid in pids.items()}
        for w in writers.values():
            w.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    per_step = {name: sum(p.values()) / args.steps for name, p in paced.items()}
    out = {
        "idle_cpu_ms_per_s": round(sum(idle["this"].values()) / args.idle_s, 1),
        "idle_by_thread_ms": idle["this"],
        "paced_cpu_ms_per_step": round(per_step["this"], 3),
        "paced_share_of_a_core": round(per_step["this"] * args.steps / 1e3 / wall, 3),
        "paced_by_thread_ms": paced["this"],
        "staging_cpu_ms_per_step_median": round(1e3 * sorted(staging)[len(staging) // 2], 3),
        "staging_cpu_ms_per_step_mean": round(1e3 * sum(staging) / len(staging), 3),
        "steps": args.steps,
        "pace_ms": args.pace_ms,
        "rows": f"tiny-world {args.drafter}" if world is not None else "synthetic",
        "load_avg": os.getloadavg(),
    }
    if args.against:
        out["against"] = {
            "tree": os.path.abspath(args.against),
            "idle_cpu_ms_per_s": round(sum(idle["against"].values()) / args.idle_s, 1),
            "paced_cpu_ms_per_step": round(per_step["against"], 3),
            "paced_by_thread_ms": paced["against"],
            "ratio_this_over_against": round(per_step["this"] / per_step["against"], 3),
        }
    print(json.dumps(out, indent=1))


def start_writer(out: str, tree: str | None) -> TraceWriter:
    """A trace at `out` and its writer; `tree`: start the writer process from that checkout."""
    from hstrace.trace.write import process_sink

    create_trace(out, engine={"name": "bench", "version": "0"}, command_line=[], static={})
    saved = process_sink._PACKAGE_ROOT
    if tree is not None:
        process_sink._PACKAGE_ROOT = os.path.abspath(tree)  # first on the writer's path
    try:
        return TraceWriter(out, rank=0)
    finally:
        process_sink._PACKAGE_ROOT = saved


if __name__ == "__main__":
    main()
