"""Where a recording's cost lands inside vLLM's engine step: armed against dormant, segment by
segment, from timestamps taken in the server.

    git worktree add /tmp/seg HEAD && cd /tmp/seg && git apply bench/step_segments.patch
    V=$(bash scripts/vllm-venv.sh | tail -1); (cd /tmp && $V -m pip install -q --no-deps -e /tmp/seg)
    mkdir -p /tmp/seglog
    HSTRACE_GAPLOG=/tmp/seglog/gap $V bench/live_overhead.py --pairs 10 --new-tokens 256 \\
        --long-rounds 4 --long-cycles 1 --two-server-cycles 0
    python bench/step_segments.py /tmp/seglog

The patch (a scratch instrument, not part of hstrace: it adds work to every patch point) logs
`time.perf_counter()` (CLOCK_MONOTONIC, one clock for every process) in the worker at
`execute_model` entry (x) and return (X), `sample_tokens` entry (s) and return (e),
`RejectionSampler.forward` entry/return (r, R), `propose_draft_token_ids` entry/return (p, P),
`take_draft_token_ids` entry/return (d, D: vLLM's engine core taking the drafts in the gap),
each with whether a session was armed; the tap thread's work per step (w); the worker's
garbage collections (g, G: printed per step, armed and dormant) and, at each disarm, the
tracked objects by type grown since the arm with the steps still held (o: printed per held
step); and in the writer process its batches of steps, its encoder jobs and the spans between
two sleeps. Each process dumps its log as JSON at a disarm (the writer every few batches).

Prints, armed and dormant: the median and mean of each segment of a cycle (x->X the target
forward, X->s, s->r, r->R the rejection sampler with hstrace's verify snapshot, R->p, p->P
the drafter with hstrace's draft-side copies and the hand-over, P->e, e->next x the gap in
which vLLM's engine core schedules the next step; split at d and D into e->d (the worker's
output to the engine core, and its bookkeeping), d->D (the worker answering the draft call) and
D->x (the engine core schedules), each with the tap thread's work inside it), the gaps by a
step's place in its round
(a round's first steps carry the session's start), the serving thread's taps (each
`Recorder.run_tap` off the tap thread, timed: what the wrappers' own work costs a step, by
function), and the gaps a writer span (under 1 ms) overlaps against the others.
"""

from __future__ import annotations

import bisect
import glob
import json
import statistics as st
import sys
from pathlib import Path

ORDER = ["x", "X", "s", "r", "R", "p", "P", "e"]
# in the gap, where the tree's instrument marks it: the engine core's take_draft_token_ids call
# in the worker (entry d, return D)
GAP_ORDER = ["d", "D"]
# A new round: no step started for this long (its first steps carry prefill and a session's
# start); a step's gap is the stretch to the next step started within it.
NEW_ROUND_S = 0.03


def _logs(d: str) -> tuple[dict[str, list[tuple]], list[tuple]]:
    """Every server process's events by pid (`{HSTRACE_GAPLOG}.{pid}.{ns}.json`), and the
    writer's."""
    by_pid: dict[str, list[tuple]] = {}
    writer: list[tuple] = []
    for f in sorted(glob.glob(str(Path(d) / "*.json"))):
        rows = [tuple(e) for e in json.loads(Path(f).read_text())]
        if ".writer." in f:
            writer.extend(rows)
        else:
            by_pid.setdefault(Path(f).name.split(".")[1], []).extend(rows)
    return by_pid, writer


def load(d: str) -> tuple[list[tuple], list[tuple]]:
    by_pid, writer = _logs(d)
    worker = sorted((e for log in by_pid.values() for e in log), key=lambda e: e[1])
    return worker, sorted(writer)


def segments(ev: list[tuple]) -> dict[bool, dict[str, list[float]]]:
    cycles, cur = [], None
    for e in ev:
        if e[0] == "x":
            if cur:
                cycles.append(cur)
            cur = {"armed": e[2], "x": e[1]}
        elif cur is not None and e[0] in ORDER + GAP_ORDER and e[0] not in cur:
            cur[e[0]] = e[1]
        elif cur is not None and e[0] == "w":  # the tap thread's work (start, end)
            cur.setdefault("w", []).append((e[1], e[2]))
    out: dict[bool, dict[str, list[float]]] = {True: {}, False: {}}
    for c, n in zip(cycles, cycles[1:], strict=False):
        if not all(k in c for k in ORDER) or n["x"] - c["x"] > 0.05:
            continue
        seg = {f"{a}->{b}": c[b] - c[a] for a, b in zip(ORDER, ORDER[1:], strict=False)}
        seg["gap"], seg["cycle"] = n["x"] - c["e"], n["x"] - c["x"]
        if all(k in c for k in GAP_ORDER) and c["e"] <= c["d"] <= c["D"] <= n["x"]:
            seg["e->d"], seg["d->D"], seg["D->x"] = (
                c["d"] - c["e"],
                c["D"] - c["d"],
                n["x"] - c["D"],
            )
            # the tap thread's work inside each part of the gap (spans logged in this cycle or
            # the next: a span is logged under the cycle it started in)
            spans = c.get("w", []) + n.get("w", [])
            for name, a, b in (
                ("e->d", c["e"], c["d"]),
                ("d->D", c["d"], c["D"]),
                ("D->x", c["D"], n["x"]),
            ):
                seg[f"tap in {name}"] = sum(max(0.0, min(b, t1) - max(a, t0)) for t0, t1 in spans)
        for k, v in seg.items():
            out[c["armed"]].setdefault(k, []).append(v)
    return out


def round_buckets(ev: list[tuple]) -> dict[bool, dict[str, list[float]]]:
    """Gaps by the step's place in its round (a new round: no step for NEW_ROUND_S)."""
    names = [(5, "1-5"), (20, "6-20"), (60, "21-60"), (1 << 30, "61+")]
    out: dict[bool, dict[str, list[float]]] = {True: {}, False: {}}
    k, last_x, last_e = 0, None, None
    for e in ev:
        if e[0] == "e":
            last_e = e
        elif e[0] == "x":
            k = 1 if last_x is None or e[1] - last_x > NEW_ROUND_S else k + 1
            if last_e is not None and k > 1 and e[1] - last_e[1] < NEW_ROUND_S:
                name = next(n for top, n in names if k - 1 <= top)
                out[last_e[2]].setdefault(name, []).append(e[1] - last_e[1])
            last_x = e[1]
    return out


def writer_overlap(ev: list[tuple], writer: list[tuple]) -> dict[str, list[float]]:
    xt = [e[1] for e in ev if e[0] == "x"]
    spans = sorted((a, b) for a, b, kind in writer if kind == -2 and b - a < 0.001)
    starts = [a for a, _ in spans]
    out: dict[str, list[float]] = {"overlapped": [], "not": []}
    for e in ev:
        if e[0] != "e" or not e[2]:
            continue
        i = bisect.bisect_right(xt, e[1])
        if i >= len(xt) or xt[i] - e[1] > 0.02:
            continue
        j, o = max(0, bisect.bisect_left(starts, e[1] - 0.002)), 0.0
        while j < len(spans) and spans[j][0] < xt[i]:
            o += max(0.0, min(xt[i], spans[j][1]) - max(e[1], spans[j][0]))
            j += 1
        out["overlapped" if o > 0 else "not"].append(xt[i] - e[1])
    return out


def serving_taps(ev: list[tuple]) -> dict[str, list[float]]:
    """The serving thread's taps (`Recorder.run_tap` off the tap thread), by function: the
    seconds each call took."""
    out: dict[str, list[float]] = {}
    for e in ev:
        if e[0] == "t":
            out.setdefault(e[3].replace("<locals>.", ""), []).append(e[2])
    return out


def worker_logs(d: str) -> list[tuple]:
    """The worker's events (the process whose logs hold the step marks), in time order."""
    by_pid, _ = _logs(d)
    ev = [e for log in by_pid.values() if any(e[0] == "x" for e in log) for e in log]
    return sorted(ev, key=lambda e: e[1])


def collections(d: str) -> dict[bool, dict[int, list[float]]]:
    """The worker's garbage collections, by whether the step they fell in was armed: each
    collection's seconds, by generation, and the number of steps of each kind (key -1),
    counted as `segments` does not (every step started, none left out)."""
    out: dict[bool, dict[int, list[float]]] = {True: {-1: []}, False: {-1: []}}
    armed, start = None, None
    for e in worker_logs(d):
        if e[0] == "x":
            armed = e[2]
            out[armed][-1].append(0.0)
        elif e[0] == "g":
            start = e[1]
        elif e[0] == "G" and start is not None and armed is not None:
            out[armed].setdefault(e[2], []).append(e[1] - start)
            start = None
    return out


def held_objects(d: str) -> list[tuple[int, int, list]]:
    """Per session of the worker that held steps at its disarm: (steps held, tracked objects
    more than at the arm, the types that grew most): what a held step keeps alive."""
    return [(e[2], e[3], e[4]) for e in worker_logs(d) if e[0] == "o" and e[2] > 0]


def ms(v: list[float]) -> str:
    return f"{1e3 * st.median(v):.3f}/{1e3 * st.mean(v):.3f}" if v else "-"


def main() -> None:
    ev, writer = load(sys.argv[1])
    seg = segments(ev)
    print("segment   dormant med/mean ms   armed med/mean ms   armed - dormant")
    for k in seg[False]:
        a, d = seg[True].get(k, []), seg[False][k]
        diff = f"{1e3 * (st.median(a) - st.median(d)):+.3f}/{1e3 * (st.mean(a) - st.mean(d)):+.3f}"
        print(f"{k:8s}  {ms(d):>20s}  {ms(a):>18s}  {diff if a else ''}")
    print(
        "cycles", {("armed" if k else "dormant"): len(v.get("cycle", [])) for k, v in seg.items()}
    )
    for armed, b in round_buckets(ev).items():
        row = " | ".join(f"{n} n{len(v)} {ms(v)}" for n, v in b.items())
        print(f"gaps by step in round, {'armed' if armed else 'dormant'}: {row}")
    taps = serving_taps(ev)
    if taps:
        print("serving-thread taps, calls and us a call (median/mean):")
        for name, v in sorted(taps.items(), key=lambda kv: -sum(kv[1])):
            if len(v) > 1:  # a load-time audit tap runs once
                print(
                    f"  {name:70s} {len(v):6d}  {1e6 * st.median(v):6.1f}/{1e6 * st.mean(v):6.1f}"
                )
    gcs = collections(sys.argv[1])
    for armed in (False, True):
        steps = len(gcs[armed][-1])
        if steps:
            row = "  ".join(
                f"gen {g}: {1e3 * len(v) / steps:.1f} a 1000 steps, {1e3 * sum(v) / steps:.3f} ms a step"
                for g, v in sorted(gcs[armed].items())
                if g >= 0
            )
            print(
                f"worker collections, {'armed' if armed else 'dormant'} ({steps} steps): {row or 'none'}"
            )
    held = held_objects(sys.argv[1])
    if held:
        per = [n / k for k, n, _ in held]
        print(
            f"tracked objects a held step keeps: {st.median(per):.1f} (median of {len(held)} "
            f"sessions, {min(per):.1f}-{max(per):.1f}); grown most, last session: {held[-1][2]}"
        )
    if writer:
        w = writer_overlap(ev, writer)
        print("armed gaps a writer span overlaps:", len(w["overlapped"]), ms(w["overlapped"]),
              "  others:", len(w["not"]), ms(w["not"]))  # fmt: skip


if __name__ == "__main__":
    main()
