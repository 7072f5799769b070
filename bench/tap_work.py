"""The vLLM tap thread's work for one step, alone in this process: no server, no writer.

    $(bash scripts/vllm-venv.sh | tail -1) bench/tap_work.py [--steps 500] [--batch 8] \
        [--drafter eagle3|mtp] [--profile]

What `hooks/vllm_patches.py: _emit_step` does on the tap thread for each step (the verify's
rule inputs, one top-k over the step's draft logits, the rows of every table), on stand-ins of
the world's shapes (`live_overhead.WORLD`: hidden, aux slots, K, both vocabularies) and the
verify snapshot `_verify_tap` takes on the serving thread under vLLM's own sampling objects.
The rows are built and dropped (`Recorder.emit` is a no-op here: the writer's staging is
`live_overhead`'s `staging` stage). One torch thread, as in vLLM's CPU worker bound to one
core; the steps are made before the clock starts and the collector is frozen, so the figure
is the tap thread's own CPU. Before/after a change: run it twice, alternating, with the other
tree first on `PYTHONPATH` (`git archive REV hstrace hooks` plus its built extensions).

Prints one JSON object: ms per step (median, min) and the thread's CPU per step, and with
--profile the calls that cost most (every torch call on the tap thread gives the GIL to the
serving thread and takes it back: their number is the figure to watch).

`--gap-ms G` puts G ms between steps (the tap thread in a server wakes once a step, after the
engine's step has run), spent as `--gap-work` says: `sleep` (the core idles: a wake from idle
costs this host's vCPU more than anything a server does, whose cores never idle while vLLM's
loops spin), `spin` (a Python loop reading the clock: the core busy, its caches left alone) or
`forward` (a stand-in for the engine's step: the tiny world's shapes through eight small
decoder layers in eager torch, dispatch-bound as its forward is; the closest of the three to
the server, bench/README.md, twenty-fifth pass), and `--spinner` runs a stand-in for vLLM's
waiting worker thread beside it, pinned to the same core: a Python loop that reads a flag and
calls `os.sched_yield()`, as `SpinCondition.wait` does between steps (it takes the GIL each
time a torch call lets it go).
Together they say whether the tap thread's cost in a server (about three times this figure)
comes from the GIL hand-overs or from running cold (bench/README.md, sixteenth pass).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import threading
import time

import live_overhead as lo
import torch
from hstrace.hooks import vllm_patches as vp

from hstrace.engines.vllm import taps


def steps_of(n: int, batch: int) -> tuple[vp.VLLMRecorder, list[taps.Step]]:
    w = lo.WORLD
    VD, V, T = w.draft_vocab, w.vocab, batch * (w.k + 1)
    d2t = torch.zeros(VD, dtype=torch.int64) if VD < V else None
    g = torch.Generator().manual_seed(0)
    logits = torch.full((batch, V), float("-inf"))
    logits[:, :VD] = torch.randn(batch, VD, generator=g)
    sampler, a, proc = lo.verify_step(batch, T)
    rec = vp.VLLMRecorder({"out": "unused", "streams": lo.STREAMS}, (0, 32, 0))
    rec.capture_layers = list(w.capture)
    rec.capture_convention = "mtp_target_output" if w.spec["method"] == "mtp" else None
    rec.emit = lambda writes: None  # rows built, not staged
    meta = a["metadata"]
    out = []
    for _ in range(n):  # what the serving thread hands over (fresh stand-ins per step)
        step = lo.stand_in_step(batch, lo.stand_in_sources(batch, g), copy=False)
        for call in step.calls:
            call.logits, call.d2t = logits.clone(), d2t  # compute_logits' tap keeps these
        if hasattr(vp, "_raw_snapshot"):  # what begin() copies (the raw logit at each token)
            raw = vp._raw_snapshot(a["logits"], meta, a["sampling_metadata"])
        else:  # an older tree's
            raw = a["logits"].index_select(0, meta.target_logits_indices.to(torch.int64)).float()
        step.verify_probs = vp._verify_tap(sampler, a, raw, proc)
        out.append(step)
    return rec, out


class Spinner:
    """vLLM 0.32.0's worker between steps (`shm_broadcast.SpinCondition.wait`, busy for up to
    1 s): read the queue's flag words, then `os.sched_yield()` (which lets the GIL go), on the
    core the tap work is pinned to."""

    def __init__(self) -> None:
        self.core = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {self.core})  # this (the tap work's) thread
        self.flags = bytearray(64)
        self.running = True
        self.yields = 0
        self.thread = threading.Thread(target=self._loop, daemon=True)

    @classmethod
    def start(cls) -> Spinner:
        s = cls()
        s.thread.start()
        return s

    def _loop(self) -> None:
        os.sched_setaffinity(0, {self.core})
        flags = self.flags
        while self.running:
            if flags[0] and sum(flags[1:4]) != 3:  # never set: the queue stays empty
                break
            time.monotonic()
            os.sched_yield()
            self.yields += 1

    def stop(self) -> int:
        self.running = False
        self.thread.join()
        return self.yields


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _Forward:
    """The gap spent on a stand-in for the engine's step: the tiny world's target shapes (a
    batch's 32 rows of hidden 64, MLP 128, vocabulary 512, eight layers) through eager torch,
    small calls that each cost their dispatch more than their arithmetic, as the world's forward
    does in vLLM (fixed seed; the result is dropped)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.emb = torch.randn(512, 64, generator=g)
        self.up = torch.randn(128, 64, generator=g)
        self.down = torch.randn(64, 128, generator=g)
        self.norm = torch.ones(64)
        self.ids = torch.arange(32)

    def once(self) -> torch.Tensor:
        fn = torch.nn.functional
        h = fn.embedding(self.ids, self.emb)
        for _ in range(8):
            a = fn.layer_norm(h, (64,), self.norm)
            a = torch.softmax(a @ a.T / 8.0, dim=-1) @ a
            h = h + fn.linear(fn.silu(fn.linear(a, self.up)), self.down)
        return torch.argmax(fn.linear(h, self.emb), dim=-1)

    def __call__(self, seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            self.once()


GAPS = {"sleep": time.sleep, "spin": _spin, "forward": _Forward()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--drafter", choices=sorted(lo.WORLDS), default="eagle3")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--gap-ms", type=float, default=0.0, help="ms between steps")
    ap.add_argument(
        "--gap-work",
        choices=("sleep", "spin", "forward"),
        default="sleep",
        help="what the time between steps is spent on",
    )
    ap.add_argument(
        "--spinner",
        action="store_true",
        help="a sched_yield loop thread beside the tap work, both pinned to one core",
    )
    args = ap.parse_args()
    lo.WORLD = lo.WORLDS[args.drafter]
    torch.set_num_threads(1)
    warm = 50
    rec, steps = steps_of(args.steps + warm, args.batch)
    gc.collect()
    gc.freeze()
    for step in steps[:warm]:
        vp._emit_step(rec, step, None)
    spinner = Spinner.start() if args.spinner else None
    prof = cProfile.Profile() if args.profile else None
    times, cpu = [], []
    between = GAPS[args.gap_work]
    for step in steps[warm:]:
        if args.gap_ms:
            between(args.gap_ms / 1e3)
        t0, c0 = time.perf_counter(), time.thread_time()
        if prof is not None:
            prof.enable()
        vp._emit_step(rec, step, None)
        if prof is not None:
            prof.disable()
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    spins = spinner.stop() if spinner is not None else None
    result: dict = {
        "drafter": args.drafter,
        "batch": args.batch,
        "steps": args.steps,
        "gap_ms": args.gap_ms,
        "gap_work": args.gap_work if args.gap_ms else None,
        "spinner_yields": spins,
        "ms_per_step_median": round(1e3 * statistics.median(times), 3),
        "ms_per_step_min": round(1e3 * min(times), 3),
        "cpu_ms_per_step_median": round(1e3 * statistics.median(cpu), 3),
        "taps_disabled": sorted(rec.disabled),  # a tap that raised would make it look cheap
    }
    if prof is not None:
        st = pstats.Stats(prof)
        top = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:15]  # by own time
        torch_calls = sum(v[1] for fn, v in st.stats.items() if fn[0] == "~" and "torch" in fn[2])
        result["torch_calls_per_step"] = round(torch_calls / args.steps, 1)
        result["calls_per_step_by_own_time"] = {
            f"{fn[0].rsplit('/', 1)[-1]}:{fn[2]}": round(v[1] / args.steps, 2) for fn, v in top
        }
    print(json.dumps(result, indent=1))
    if rec.disabled:
        raise SystemExit(f"taps disabled: {sorted(rec.disabled)}")


if __name__ == "__main__":
    main()
