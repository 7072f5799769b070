"""CPU of one tail flush of a recording's columns, this tree beside another checkout's.

    $(bash scripts/vllm-venv.sh | tail -1) bench/tail_flush.py [--flushes 10] [--against DIR]

A recording's writer makes every appended row durable every 2 s (a tail flush: each column's
partly filled chunk encoded and written at its key, then the commit record). This writes the
rows the vLLM hooks build for tiny-world steps (`writer_idle.world_steps`: every table and
column of a live recording, 59 columns) into a trace with the in-process recorder
(`TraceWriter(process=False)`), 20 steps between flushes, and reads each flush's CPU with
`time.process_time` (the recorder runs on the caller's thread: no encoding threads). The first
two flushes of a column are its key's creation and its spare's (rowlog.TailFile); the median
is over the flushes after them. `--against DIR`: the same, run again in a child process whose
path starts with DIR (a checkout, or `git archive REV hstrace hooks` plus its built
extensions), alternated with this tree's run, `--repeats` times. Run it from outside both
checkouts (the current directory would come first on the path). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def flush_cpu_ms(flushes: int, steps_between: int) -> list[float]:
    sys.path.insert(0, str(HERE))
    import writer_idle
    from hstrace.hooks.common import write_rows

    from hstrace.trace import TraceWriter, create_trace

    world = writer_idle.world_steps(steps_between * (flushes + 1), 8, "eagle3")
    with tempfile.TemporaryDirectory(prefix="hstrace-tail-flush-") as work:
        out = os.path.join(work, "t.zarr")
        create_trace(out, engine={"name": "vllm", "version": "0.32.0"}, command_line=[], static={})
        w = TraceWriter(out, rank=0, process=False, tail_flush_s=1e9)  # flushed here only
        got = []
        for k in range(flushes):
            for i in range(k * steps_between, (k + 1) * steps_between):
                for tw in world[i]:
                    write_rows(w, tw)
            t0 = time.process_time()
            w.flush()
            got.append(1e3 * (time.process_time() - t0))
        w.close()
    return got


def run_tree(tree: str | None, flushes: int, steps_between: int) -> list[float]:
    """This tree in a child process (the same interpreter), or DIR first on its path."""
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
    code = (
        f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import tail_flush, hstrace; "
        f"print(json.dumps([hstrace.__file__, tail_flush.flush_cpu_ms({flushes}, "
        f"{steps_between})]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"tail_flush: the run of {tree or 'this tree'} failed:\n{proc.stderr}")
    where, ms = json.loads(proc.stdout.strip().splitlines()[-1])
    if tree and not where.startswith(os.path.abspath(tree)):
        raise SystemExit(f"tail_flush: {tree} was not imported ({where}): run outside checkouts")
    return ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flushes", type=int, default=10)
    ap.add_argument("--steps-between", type=int, default=20)
    ap.add_argument("--against", default="", help="a checkout to run side by side")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if args.flushes < 3:
        ap.error("--flushes must be at least 3 (the first two create files)")
    trees = {"this": None, **({"against": args.against} if args.against else {})}
    runs: dict[str, list[list[float]]] = {name: [] for name in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            runs[name].append(run_tree(tree, args.flushes, args.steps_between))
    out: dict = {"flushes": args.flushes, "steps_between": args.steps_between}
    for name, rs in runs.items():
        later = [ms for r in rs for ms in r[2:]]
        out[name] = {
            "tree": os.path.abspath(trees[name]) if trees[name] else str(HERE.parent),
            "first_two_flushes_cpu_ms": [[round(x, 1) for x in r[:2]] for r in rs],
            "flush_cpu_ms_median": round(statistics.median(later), 1),
            "flush_cpu_ms_min_max": [round(min(later), 1), round(max(later), 1)],
        }
    if args.against:
        out["ratio_this_over_against"] = round(
            out["this"]["flush_cpu_ms_median"] / out["against"]["flush_cpu_ms_median"], 3
        )
    out["load_avg"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
