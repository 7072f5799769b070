"""Who holds each CPU in vLLM's steps and in the gaps between them, armed against dormant: the
kernel's context switches (`perf record -e sched:sched_switch`) laid over the step log of
`bench/step_segments.patch`.

    # during a segments run (bench/step_segments.py's docstring), once the first armed round
    # is done, trace every CPU's switches for a few seconds on the log's clock:
    perf record -e sched:sched_switch -a -k CLOCK_MONOTONIC -o /tmp/sw.data -- sleep 6
    perf script -i /tmp/sw.data -F cpu,time,event,trace > /tmp/sw.txt
    python bench/gap_cores.py /tmp/sw.txt /tmp/seglog [--from-step 21]

The step log's timestamps are `time.perf_counter()` (CLOCK_MONOTONIC), the clock `perf -k
CLOCK_MONOTONIC` stamps the switches with. A gap runs from `sample_tokens`' return (e) to the
next `execute_model` (x); the step before it from that x to e. Only gaps inside the trace's
window count, and only from step `--from-step` of a round on (a round: steps whose gaps are all
started within 30 ms of the one before; its first steps carry prefill and a session's start).

Prints, for armed and dormant gaps and for the steps before them: the median and mean gap, and
per CPU the milliseconds each kind of thread held it, per gap (or step). Threads are told apart
by the kernel's name: hstrace's `hstrace-taps`, `hstrace-writer`, `hstrace-encode`; vLLM's
`VLLM::Worker` (the serving thread: it busy-waits between steps, `SpinCondition`),
`VLLM::EngineCor` (the engine core, which schedules the next step in the gap), their `ZMQbg`
I/O threads; `python` is the API server and the bench's own client alike (both are Python
processes of that name); `idle` the idle task. This is how the twentieth pass found the tap
thread's gap work pushing the `python` processes from CPU 0 onto the engine core's CPU
(bench/README.md).
"""

from __future__ import annotations

import argparse
import bisect
import re
import statistics as st
import sys
from collections import defaultdict
from pathlib import Path

from step_segments import NEW_ROUND_S, load

SWITCH = re.compile(
    r"\[(\d+)\]\s+([\d.]+):\s+sched:sched_switch:.*?==> next_comm=(.*?) next_pid=(\d+)"
)
KINDS = (
    ("hstrace-taps", "tap thread"),
    ("hstrace-writer", "writer"),
    ("hstrace-encode", "writer's encoders"),
    ("VLLM::Worker", "worker"),
    ("VLLM::EngineCor", "engine core"),
    ("ZMQbg", "zmq I/O"),
    ("python", "python (API server, client)"),
    ("uvicorn", "python (API server, client)"),
)


def kind(comm: str, pid: int) -> str:
    if pid == 0:
        return "idle"
    for prefix, name in KINDS:
        if comm.startswith(prefix):
            return name
    return "other"


def switches(path: Path) -> dict[int, list[tuple[float, str]]]:
    """Per CPU, (time, kind of the thread switched in), in time order."""
    runs: dict[int, list[tuple[float, str]]] = defaultdict(list)
    for line in path.read_text(errors="replace").splitlines():
        m = SWITCH.search(line)
        if m:
            cpu, t, comm, pid = m.groups()
            runs[int(cpu)].append((float(t), kind(comm, int(pid))))
    for r in runs.values():
        r.sort()
    return runs


def held(run: list[tuple[float, str]], times: list[float], a: float, b: float) -> dict[str, float]:
    """Seconds each kind held this CPU within [a, b)."""
    out: dict[str, float] = defaultdict(float)
    i = bisect.bisect_right(times, a) - 1
    if i < 0:
        return out
    while i < len(run) and run[i][0] < b:
        start = max(a, run[i][0])
        end = min(b, run[i + 1][0] if i + 1 < len(run) else b)
        if end > start:
            out[run[i][1]] += end - start
        i += 1
    return out


def windows(
    ev: list[tuple], lo: float, hi: float, from_step: int
) -> list[tuple[bool, float, float, float]]:
    """(armed, step start x, step end e, next x) of each step and the gap after it, from step
    `from_step` of its round on (rounds as step_segments.py counts them: NEW_ROUND_S)."""
    xs = [e for e in ev if e[0] == "x"]
    es = [e for e in ev if e[0] == "e"]
    et = [e[1] for e in es]
    out, place, last = [], 0, None
    for i, x in enumerate(xs):
        place = 1 if last is None or x[1] - last > NEW_ROUND_S else place + 1
        last = x[1]
        if i + 1 >= len(xs) or place < from_step:
            continue
        nx = xs[i + 1][1]
        j = bisect.bisect_right(et, x[1])  # this step's end: the first e after its start
        if j >= len(es) or et[j] >= nx or nx - et[j] > NEW_ROUND_S:
            continue
        if lo <= x[1] and nx <= hi:
            out.append((bool(es[j][2]), x[1], et[j], nx))
    return out


def bad(message: str) -> None:
    """Bad input: one line on stderr, exit 2."""
    print(f"gap_cores: {message}", file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("switches", type=Path, help="`perf script -F cpu,time,event,trace` output")
    ap.add_argument("steplog", help="the HSTRACE_GAPLOG directory of the same run")
    ap.add_argument("--from-step", type=int, default=21, help="skip a round's first steps")
    args = ap.parse_args()
    if not args.switches.is_file():
        bad(f"{args.switches}: no such file (the `perf script` output)")
    runs = switches(args.switches)
    if not runs:
        bad(f"{args.switches}: no sched_switch events")
    times = {cpu: [t for t, _ in r] for cpu, r in runs.items()}
    lo = max(r[0][0] for r in runs.values())
    hi = min(r[-1][0] for r in runs.values())
    if not Path(args.steplog).is_dir():
        bad(f"{args.steplog}: no such directory (the HSTRACE_GAPLOG directory)")
    try:
        ev, _ = load(args.steplog)
    except (ValueError, TypeError, IndexError) as exc:
        bad(f"{args.steplog}: not a step log ({type(exc).__name__}: {exc})")
    if not any(e[0] == "x" for e in ev):
        bad(f"{args.steplog}: no steps logged (was the server run with HSTRACE_GAPLOG?)")
    acc = {
        (armed, part): {cpu: defaultdict(float) for cpu in runs}
        for armed in (False, True)
        for part in ("gap", "step")
    }
    gaps: dict[bool, list[float]] = {False: [], True: []}
    for armed, x, e, nx in windows(ev, lo, hi, args.from_step):
        gaps[armed].append(nx - e)
        for cpu, run in runs.items():
            for part, (a, b) in (("gap", (e, nx)), ("step", (x, e))):
                for k, s in held(run, times[cpu], a, b).items():
                    acc[armed, part][cpu][k] += s
    print(f"trace window {hi - lo:.1f} s; steps from {args.from_step} of a round on")
    for armed in (False, True):
        n = len(gaps[armed])
        if not n:
            continue
        g = gaps[armed]
        print(
            f"{'armed' if armed else 'dormant'}: {n} gaps, median {1e3 * st.median(g):.3f} ms, "
            f"mean {1e3 * st.mean(g):.3f}"
        )
        for part in ("gap", "step"):
            for cpu in sorted(runs):
                top = sorted(acc[armed, part][cpu].items(), key=lambda kv: -kv[1])
                shown = ", ".join(f"{k} {1e3 * s / n:.3f}" for k, s in top if 1e3 * s / n >= 0.005)
                print(f"  {part:4s} cpu {cpu}: {shown}")


if __name__ == "__main__":
    main()
