"""Issue 14 item 6 on a CUDA machine: what recording GPU tensors costs the serving thread.

    python bench/gpu_path.py [--json] [--steps 300] [--rounds 3] [--step-ms 10]

The write_path.py workload (8 target tokens of 3 x 7168 bf16 aux, 16 draft rows of top-64 and
full 32000-vocab bf16 logits: ~1.4 MB a step), its tensors on the GPU. Every step is ~10 ms of
GPU work (fp32 matmuls standing in for the forward, calibrated once), a synchronize (a
scheduler waits for the forward's results), then the record call, timed on the CPU.
Contenders, interleaved round by round on the same tensors:

  none       no record call: the step alone (what the others' whole steps are compared to)
  hstrace    the shipped TraceWriter: async D2H into the page-locked staging ring, a CUDA
             event, the completer thread sending the step once its copy is done
  d2h_floor  the same bytes copied non_blocking into one page-locked buffer, plus one event
             record: the least an asynchronous recorder does on the serving thread
  sync_cpu   `.cpu()` of every tensor (a naive dumper): the serving thread waits for the copy

Reported per contender: the record call's median / p99 ms, its share of the step (target
<= 1 %), x d2h_floor, and the whole step's median against `none` (the D2H copies share the
GPU's stream with the next forward). Every hstrace trace is read back and every step compared
bit for bit. Exit 2 when torch sees no CUDA device. `--cpu-dry-run` runs the same script
with CPU tensors (no pinning, no events; the numbers mean nothing) to check it end to end
before spending device time on it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from write_path import STEP_PARTS, make_pool, step_bytes  # noqa: E402 - the same workload

from hstrace.trace import TraceWriter, create_trace, open_trace  # noqa: E402

CUDA = True  # False under --cpu-dry-run


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def calibrate(step_ms: float, device: str) -> tuple[int, torch.Tensor]:
    """Matmuls per step so that the GPU work takes ~step_ms, and their operand."""
    a = torch.randn(2048 if CUDA else 256, 2048 if CUDA else 256, device=device)
    for _ in range(3):
        a @ a
    sync()
    t0 = time.perf_counter()
    for _ in range(50):
        a @ a
    sync()
    per = (time.perf_counter() - t0) / 50
    return max(1, round(step_ms / 1000 / per)), a


class Hstrace:
    name = "hstrace"

    def __init__(self, out: Path) -> None:
        self.path = out / "trace.zarr"
        create_trace(self.path, engine={"name": "bench-gpu"}, command_line=sys.argv)
        self.w = TraceWriter(self.path, rank=0, on_full="block")

    def record(self, step: dict) -> None:
        self.w.write("target", step={"mode": 1}, req=step["target_req"], tok=step["target"])
        self.w.write("draft_step", step={"step_index": 0}, req=step["draft_req"], tok=step["draft"])

    def close(self) -> None:
        self.w.close()


class D2HFloor:
    name = "d2h_floor"

    def __init__(self, out: Path, nbytes: int) -> None:
        self.buf = torch.empty(nbytes + 64 * 32, dtype=torch.uint8)
        if CUDA:
            self.buf = self.buf.pin_memory()

    def record(self, step: dict) -> None:
        off = 0
        for p in STEP_PARTS:
            for t in step[p].values():
                n = t.numel() * t.element_size()
                dst = self.buf[off : off + n].view(t.dtype).view(t.shape)
                dst.copy_(t, non_blocking=True)
                off += -(-n // 64) * 64
        if CUDA:
            torch.cuda.Event().record()

    def close(self) -> None:
        sync()


class SyncCpu:
    name = "sync_cpu"

    def __init__(self, out: Path) -> None:
        self.keep: list = []

    def record(self, step: dict) -> None:
        self.keep = [t.cpu() for p in STEP_PARTS for t in step[p].values()]

    def close(self) -> None:
        pass


class Nothing:
    name = "none"

    def __init__(self, out: Path) -> None:
        pass

    def record(self, step: dict) -> None:
        pass

    def close(self) -> None:
        pass


def on_gpu(step: dict, device: str) -> dict:
    return {
        part: {k: v.to(device) if part in STEP_PARTS else v for k, v in cols.items()}
        for part, cols in step.items()
    }


def check(path: Path, pool: list[dict], steps: int) -> bool:
    """Every step of both tables, bit for bit."""
    with open_trace(path) as tr:
        for name, part in (("target", "target"), ("draft_step", "draft")):
            t = tr.rank(0).table(name)
            if t.num_steps != steps:
                return False
            off = t.offsets("tok")
            for c in t.columns["tok"]:
                got = t.column("tok", c)
                got = got.view(torch.int16) if got.dtype == torch.bfloat16 else got
                for s in range(steps):
                    want = pool[s % len(pool)][part][c]
                    want = want.view(torch.int16) if want.dtype == torch.bfloat16 else want
                    if not torch.equal(torch.as_tensor(got[off[s] : off[s + 1]]), want):
                        return False
    return True


def run(cls, pool_gpu, pool_cpu, steps, k, a, out, nbytes) -> dict:
    m = cls(out, nbytes) if cls is D2HFloor else cls(out)
    rec, whole = [], []
    for s in range(steps):
        t0 = time.perf_counter()
        for _ in range(k):  # the forward
            a @ a
        sync()  # the scheduler waits for its results
        t1 = time.perf_counter()
        m.record(pool_gpu[s % len(pool_gpu)])
        t2 = time.perf_counter()
        rec.append((t2 - t1) * 1000)
        whole.append((t2 - t0) * 1000)
    m.close()
    sync()
    res = {"record_ms": rec, "step_ms": whole}
    if cls is Hstrace:
        res["bit_exact"] = check(m.path, pool_cpu, steps)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args()
    global CUDA
    CUDA = not args.cpu_dry_run
    if CUDA and not torch.cuda.is_available():
        print("gpu_path: error: torch sees no CUDA device", file=sys.stderr)
        return 2
    dev = "cuda" if CUDA else "cpu"
    pool_cpu = make_pool(32, 8, 7168, 3, 16, 64, 32000)
    pool_gpu = [on_gpu(s, dev) for s in pool_cpu]
    nbytes = step_bytes(pool_cpu[0])
    k, a = calibrate(args.step_ms, dev)
    methods = [Nothing, Hstrace, D2HFloor, SyncCpu]
    raw: dict[str, list[dict]] = {m.name: [] for m in methods}
    with tempfile.TemporaryDirectory(prefix="hstrace-gpu-") as tmp:
        for r in range(args.rounds):
            for cls in methods if r % 2 == 0 else methods[::-1]:
                out = Path(tempfile.mkdtemp(dir=tmp))
                raw[cls.name].append(run(cls, pool_gpu, pool_cpu, args.steps, k, a, out, nbytes))
    med = statistics.median
    base_step = med(med(x["step_ms"]) for x in raw["none"])
    results = {}
    for name, runs in raw.items():
        e = {
            "record_ms_median": med(float(np.percentile(x["record_ms"], 50)) for x in runs),
            "record_ms_p99": med(float(np.percentile(x["record_ms"], 99)) for x in runs),
            "step_ms_median": med(med(x["step_ms"]) for x in runs),
        }
        e["share_of_step"] = e["record_ms_median"] / base_step
        e["step_vs_none"] = e["step_ms_median"] / base_step
        if any("bit_exact" in x for x in runs):
            e["bit_exact"] = all(x["bit_exact"] for x in runs)
        results[name] = e
    floor = results["d2h_floor"]["record_ms_median"]
    for e in results.values():
        e["record_vs_d2h_floor"] = e["record_ms_median"] / floor if floor else None
    report = {
        "device": torch.cuda.get_device_name(0) if CUDA else "cpu (dry run)",
        "torch": torch.__version__,
        "step_bytes": nbytes,
        "matmuls_per_step": k,
        "step_ms_without_recording": base_step,
        "steps": args.steps,
        "rounds": args.rounds,
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{report['device']}: {nbytes / 1e6:.2f} MB a step, a {base_step:.2f} ms step "
            f"({k} matmuls), {args.steps} steps x {args.rounds} rounds"
        )
        for name, e in results.items():
            print(
                f"  {name:10s} record median {e['record_ms_median']:.3f} ms p99 "
                f"{e['record_ms_p99']:.3f} ({e['share_of_step']:.2%} of the step; "
                f"x{e['record_vs_d2h_floor'] or 0:.2f} the floor); whole step x"
                f"{e['step_vs_none']:.3f}"
                + (f"; bit-exact {e['bit_exact']}" if "bit_exact" in e else "")
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
