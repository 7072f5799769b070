"""Write-path benchmark: hstrace's writer against what people do today, side by side.

One per-step workload (default: 8 target tokens x 3x7168 bf16 aux hidden states, 16 draft
rows of top-64 ids/log-probs + lse + full 32000-vocab bf16 logits, ids and positions; about
1.4 MB per step) is recorded in one process, method after method, in rounds:

  hstrace      TraceWriter as shipped (writer process, shared-memory staging, blosc zstd-1 on
               two encoding threads; while more than half a ring behind, chunks stored
               uncompressed as long as the trace stays within 0.8x its raw size)
  hstrace_1t   the same, one encoding thread, never uncompressed (the lossless rate)
  hstrace_1t_cblosc  the same with c-blosc zstd-1 on every chunk (HSTRACE_PLANES=0: the
               writer's encoder before the byte planes, side by side)
  hstrace_2t   the same, two encoding threads, never uncompressed
  hstrace_2t_budget  two encoding threads; while behind, chunks stored uncompressed only
               within 0.8x the raw size, never beyond (the producer waits instead)
  copy_only    the same bytes memmoved into a preallocated staging buffer (the producer's floor)
  torch_save   torch.save of a dict per step, one file per step (SGLang's dumper style)
  safetensors  safetensors.torch.save_file per step, one file per step
  raw_write    the same bytes appended to one open file, unbuffered (through the page cache:
               a memory copy while the dirty pages fit, as in a short run)
  raw_write_direct  the same bytes copied into a 16 MiB page-aligned buffer and appended with
               O_DIRECT (the device's own sequential write, as hstrace's shards are written)

Two modes: "paced" runs 10 ms of GIL-holding busy work per step (a scheduler loop) and times
only the record call (the producer-side cost); "firehose" records back to back and measures
sustained MB/s including the final flush/close. Numbers are medians over rounds; compare
methods within one run (ratios), never across machines.

Files: "files in a 1000-step run" (the firehose run) and, from one longer run of the same
workload (--growth-steps, default 3000), the marginal rate: files added per further 1000
steps. A paced step whose record call was preempted (an involuntary context switch of the
serving thread, Linux) is counted, so a p99 set by the host's load shows as such.

Bounds, in the same rounds: the writer's encoder alone (byte planes for the bf16 chunks,
c-blosc zstd-1 for the rest, on the same chunks, 1 and 2 threads, no I/O:
`codec_alone.codec_1t/2t`; c-blosc zstd-1 on every chunk: `codec_alone.cblosc_1t`) for the
lossless write rates, and Blosc's decoder alone on the writer's frames (2 threads into new
memory: `codec_alone.decode_2t`) for warm reads.

    python bench/write_path.py [--json] [--rounds 3] [--paced-steps 300] [--firehose-steps 1000]
                               [--growth-steps 3000]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest.mock import patch

import numpy as np
import torch

from hstrace.trace import TraceWriter, create_trace, open_trace

STEP_MS = 10.0


def make_pool(
    n: int, tokens: int, hidden: int, slots: int, draft_rows: int, topk: int, vocab: int
) -> list[dict]:
    """Pre-generated steps (generation is not timed). Values are shaped like real activations:
    per-channel log-normal scales and a few outlier channels, so compression is not flattered."""
    g = torch.Generator().manual_seed(0)
    scale = torch.exp(torch.randn(slots * hidden, generator=g) * 0.5)
    scale[torch.randint(0, slots * hidden, (6,), generator=g)] *= 200
    pool = []
    for i in range(n):
        logits = torch.randn(draft_rows, vocab, generator=g) * 2
        lp, ids = torch.log_softmax(logits, -1).topk(topk, -1)
        pool.append(
            {
                "target": {
                    "input_ids": torch.randint(0, vocab, (tokens,), generator=g, dtype=torch.int32),
                    "positions": torch.arange(tokens, dtype=torch.int32),
                    "aux_hidden": (torch.randn(tokens, slots * hidden, generator=g) * scale).to(
                        torch.bfloat16
                    ),
                },
                "draft": {
                    "input_ids": torch.randint(
                        0, vocab, (draft_rows,), generator=g, dtype=torch.int32
                    ),
                    "positions": torch.arange(draft_rows, dtype=torch.int32),
                    "topk_draft_ids": ids.to(torch.int32),
                    "topk_target_ids": ids.to(torch.int32),
                    "topk_logprobs": lp.to(torch.bfloat16),
                    "lse": torch.logsumexp(logits, -1),
                    "logits": logits.to(torch.bfloat16),
                },
                "target_req": {
                    "req_key": torch.tensor([i]),
                    "n_tok": torch.tensor([tokens]),
                },
                "draft_req": {
                    "req_key": torch.tensor([i]),
                    "n_tok": torch.tensor([draft_rows]),
                },
            }
        )
    return pool


# Parts of a pool step that every method stores (the request columns are hstrace's own
# book-keeping: 32 bytes a step, not counted in the workload's bytes).
STEP_PARTS = ("target", "draft")


def step_bytes(step: dict) -> int:
    return sum(t.numel() * t.element_size() for p in STEP_PARTS for t in step[p].values())


def bf16_bytes(step: dict) -> int:
    return sum(
        t.numel() * 2 for p in STEP_PARTS for t in step[p].values() if t.dtype == torch.bfloat16
    )


class Hstrace:
    """TraceWriter as shipped: two encoding threads; while the writer is more than half a ring
    behind, chunks stored uncompressed within rowlog.DISK_BUDGET (the commit record counts them)."""

    name = "hstrace"
    threads, raw_when_behind, raw_beyond_budget = 2, True, True
    env: dict[str, str] = {}  # for the writer process (it inherits this process's environment)

    def __init__(self, out: Path) -> None:
        self.path = out / "trace.zarr"
        create_trace(self.path, engine={"name": "bench"}, command_line=sys.argv)
        with patch.dict(os.environ, self.env):  # the writer process starts in here
            self.w = TraceWriter(
                self.path,
                rank=0,
                on_full="block",
                compress_threads=self.threads,
                raw_when_behind=self.raw_when_behind,
                raw_beyond_budget=self.raw_beyond_budget,
            )
        self.s = 0

    def blocked_s(self) -> float:
        return self.w.stats["blocked_s"]

    def copy_s(self) -> float:
        """Time spent in the memcpy into the ring itself (TraceWriter's own count)."""
        return self.w.stats["copy_s"]

    def writer_pid(self) -> int | None:
        return self.w.writer_pid

    def record(self, step: dict) -> None:
        # The request columns are tensors the server already has (built with the pool).
        self.w.write("target", step={"mode": 1}, req=step["target_req"], tok=step["target"])
        self.w.write("draft_step", step={"step_index": 0}, req=step["draft_req"], tok=step["draft"])
        self.s += 1

    def close(self) -> None:
        self.w.close()

    def root(self) -> Path:
        return self.path


class Hstrace1T(Hstrace):
    """One encoding thread, never stored uncompressed: the lossless rate of one thread."""

    name = "hstrace_1t"
    threads, raw_when_behind = 1, False


class Hstrace1TCBlosc(Hstrace1T):
    """One encoding thread, c-blosc zstd-1 on every chunk (no byte planes): the writer's
    encoder before issue 14's fifth pass, in the same run."""

    name = "hstrace_1t_cblosc"
    env = {"HSTRACE_PLANES": "0"}


class Hstrace2T(Hstrace):
    """Two encoding threads, never stored uncompressed: the lossless rate of two threads."""

    name = "hstrace_2t"
    threads, raw_when_behind = 2, False


class Hstrace2TBudget(Hstrace):
    """Two encoding threads; while behind, chunks go uncompressed only while the trace stays
    within rowlog.DISK_BUDGET of its raw size, never beyond it (the producer waits instead):
    the lossless rate of two threads at disk <= 0.8x raw."""

    name = "hstrace_2t_budget"
    threads, raw_when_behind, raw_beyond_budget = 2, True, False


class CopyOnly:
    """The copy alone: the same bytes memmoved into a preallocated 256 MiB staging buffer,
    64-byte aligned per column, from its start each step (as TraceWriter's ring does when the
    writer has caught up). The floor of any staging producer."""

    name = "copy_only"

    def __init__(self, out: Path) -> None:
        self.buf = np.zeros(256 << 20, np.uint8)  # zeroed: pages faulted in, as the ring's
        self.addr = self.buf.ctypes.data

    def record(self, step: dict) -> None:
        off = 0
        for part in STEP_PARTS:
            for t in step[part].values():
                n = t.numel() * t.element_size()
                ctypes.memmove(self.addr + off, t.data_ptr(), n)
                off += -(-n // 64) * 64

    def close(self) -> None:
        pass

    def root(self) -> None:
        return None


class TorchSave:
    name = "torch_save"

    def __init__(self, out: Path) -> None:
        self.dir = out / "torch_save"
        self.dir.mkdir()
        self.s = 0

    def record(self, step: dict) -> None:
        torch.save(
            {f"{p}.{k}": t for p in STEP_PARTS for k, t in step[p].items()},
            self.dir / f"step_{self.s:07d}.pt",
        )
        self.s += 1

    def close(self) -> None:
        pass

    def root(self) -> Path:
        return self.dir


class Safetensors(TorchSave):
    name = "safetensors"

    def __init__(self, out: Path) -> None:
        from safetensors.torch import save_file

        self.save_file = save_file
        self.dir = out / "safetensors"
        self.dir.mkdir()
        self.s = 0

    def record(self, step: dict) -> None:
        self.save_file(
            {f"{p}.{k}": t for p in STEP_PARTS for k, t in step[p].items()},
            str(self.dir / f"step_{self.s:07d}.safetensors"),
        )
        self.s += 1


class RawWrite:
    name = "raw_write"

    def __init__(self, out: Path) -> None:
        self.file = out / "raw.bin"
        self.f = open(self.file, "wb", buffering=0)  # noqa: SIM115 - held open for the whole run

    def record(self, step: dict) -> None:
        for p in STEP_PARTS:
            for t in step[p].values():
                self.f.write(
                    t.view(torch.uint8).numpy().data
                    if t.dtype == torch.bfloat16
                    else t.numpy().data
                )

    def close(self) -> None:
        self.f.close()

    def root(self) -> Path:
        return self.file


class RawWriteDirect:
    """The same bytes, sequentially, with O_DIRECT: copied into a page-aligned 16 MiB buffer
    and written a buffer at a time (O_DIRECT needs aligned memory and lengths), the file cut
    to its exact length at close. The device's sequential write, without the page cache."""

    name = "raw_write_direct"
    BUF = 16 << 20

    def __init__(self, out: Path) -> None:
        import mmap

        self.file = out / "raw.bin"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            self.fd = os.open(self.file, flags | os.O_DIRECT, 0o644)
        except OSError:  # a file system without O_DIRECT: through the page cache
            self.fd = os.open(self.file, flags, 0o644)
        self.buf = mmap.mmap(-1, self.BUF)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        self.fill = self.total = 0

    def _flush(self, n: int) -> None:
        view, got = memoryview(self.buf)[:n], 0
        while got < n:
            got += os.write(self.fd, view[got:])

    def record(self, step: dict) -> None:
        for p in STEP_PARTS:
            for t in step[p].values():
                src, n = t.data_ptr(), t.numel() * t.element_size()
                while n:
                    k = min(n, self.BUF - self.fill)
                    ctypes.memmove(self.addr + self.fill, src, k)
                    self.fill += k
                    self.total += k
                    src += k
                    n -= k
                    if self.fill == self.BUF:
                        self._flush(self.BUF)
                        self.fill = 0

    def close(self) -> None:
        if self.fill:
            self._flush(-(-self.fill // 4096) * 4096)
        os.ftruncate(self.fd, self.total)
        os.close(self.fd)

    def root(self) -> Path:
        return self.file


METHODS = [
    Hstrace,
    Hstrace1T,
    Hstrace1TCBlosc,
    Hstrace2T,
    Hstrace2TBudget,
    CopyOnly,
    TorchSave,
    Safetensors,
    RawWrite,
    RawWriteDirect,
]


def drop_cache(root: Path) -> None:
    """Evict the files under root from the page cache (fsync, then POSIX_FADV_DONTNEED: the
    pages are clean, the kernel drops them), so the next read comes from the device."""
    paths = (
        [root] if root.is_file() else [Path(d) / n for d, _, names in os.walk(root) for n in names]
    )
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_usage(root: Path | None) -> tuple[int, int, int]:
    """(bytes, files, of which metadata files: one zarr.json per array or group)."""
    if root is None:
        return 0, 0, 0
    if root.is_file():
        return root.stat().st_size, 1, 0
    files = [p for p in root.rglob("*") if p.is_file()]
    meta = sum(p.name == "zarr.json" for p in files)
    return sum(p.stat().st_size for p in files), len(files), meta


def involuntary_switches() -> int:
    """The calling thread's involuntary context switches so far (0 where not available)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return resource.getrusage(who).ru_nivcsw if who is not None else 0


def busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def run_one(
    cls, pool: list[dict], steps: int, paced: bool, workdir: Path, read: bool = False
) -> dict:
    out = Path(tempfile.mkdtemp(dir=workdir))
    m = cls(out)
    costs, blocked, cpu, preempted, copied = [], [], [], [], []
    blocked_s = getattr(m, "blocked_s", lambda: 0.0)
    copy_s = getattr(m, "copy_s", lambda: 0.0)
    ru0 = _cpu_s()
    t0 = time.perf_counter()
    for s in range(steps):
        if paced:
            busy(STEP_MS)
        b0, k0 = blocked_s(), copy_s()
        v0 = involuntary_switches()  # outside the timed region: a syscall each
        c = time.thread_time()
        a = time.perf_counter()
        m.record(pool[s % len(pool)])
        costs.append((time.perf_counter() - a) * 1000)
        cpu.append((time.thread_time() - c) * 1000)
        preempted.append(involuntary_switches() > v0)
        blocked.append((blocked_s() - b0) * 1000)
        copied.append((copy_s() - k0) * 1000)
    m.close()
    wall = time.perf_counter() - t0
    ru1 = _cpu_s()
    size, files, meta = disk_usage(m.root())
    result = {
        "costs_ms": costs,
        "cpu_ms": cpu,
        "blocked_ms": blocked,
        "copy_ms": copied,
        "preempted": preempted,
        "wall_s": wall,
        # CPU seconds of this process (all threads) and of finished children (the writer
        # process, which exits at close): the rate each would have on a core of its own.
        "cpu_self_s": ru1[0] - ru0[0],
        "cpu_children_s": ru1[1] - ru0[1],
        "disk_bytes": size,
        "files": files,
        "metadata_files": meta,
        "load_1min": os.getloadavg()[0],  # the host's load next to every number (2 shared vCPUs)
    }
    if issubclass(cls, Hstrace):
        if read:
            # From the device first (nothing in the page cache: its shards were written with
            # O_DIRECT, the rest is evicted), then again from the page cache, checked.
            drop_cache(m.root())
            result["read_cold_s"], _, _ = read_hstrace(m.root(), pool, steps, check=False)
            result["read_s"], result["read_cpu_s"], ok = read_hstrace(m.root(), pool, steps)
        else:
            ok = check_hstrace(m.root(), pool, steps)
        result["lossless"] = ok
        result["uncompressed_chunks"], result["chunks"] = chunk_counts(m.root())
    elif cls in (RawWrite, RawWriteDirect) and read:
        drop_cache(m.root())
        result["read_cold_s"] = read_raw(m.root(), fresh=True)  # new memory, as hstrace's
        c0 = _cpu_s()[0]
        result["read_s"] = read_raw(m.root())
        result["read_cpu_s"] = _cpu_s()[0] - c0
        result["read_fresh_s"] = read_raw(m.root(), fresh=True)
    shutil.rmtree(out)
    return result


def _cpu_s() -> tuple[float, float]:
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def read_raw(path: Path, fresh: bool = False) -> float:
    """Seconds to read the raw file sequentially into one buffer: allocated (and its pages
    touched) before the clock starts, or with `fresh`, new memory allocated inside the timed
    read, as any reader that returns new arrays (hstrace's, np.fromfile) pays for."""
    if fresh:
        t0 = time.perf_counter()
        buf = np.empty(path.stat().st_size, np.uint8)
    else:
        buf = bytearray(path.stat().st_size)
        t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        view, got = memoryview(buf), 0
        while got < len(buf):
            got += f.readinto(view[got:])
    return time.perf_counter() - t0


def read_hstrace(
    path: Path, pool: list[dict], steps: int, check: bool = True
) -> tuple[float, float, bool]:
    """Seconds to read every column of both tables through hstrace's reader (what `show`,
    `diff` and replay call), then (check) a bit-exact check of every step against what was
    written."""
    c0 = _cpu_s()[0]
    t0 = time.perf_counter()
    with open_trace(path) as tr:
        got = {}
        for name in ("target", "draft_step"):
            t = tr.rank(0).table(name)
            got[name] = (
                t.num_steps,
                t.offsets("tok"),
                {c: t.column("tok", c) for c in t.columns["tok"]},
            )
    dt = time.perf_counter() - t0
    cpu = _cpu_s()[0] - c0
    ok = True
    if not check:
        return dt, cpu, ok
    for name, part in (("target", "target"), ("draft_step", "draft")):
        n, off, cols = got[name]
        ok &= n == steps
        for c, arr in cols.items():
            a = arr.view(torch.int16).numpy() if isinstance(arr, torch.Tensor) else arr
            for s in range(steps if ok else 0):
                want = pool[s % len(pool)][part][c]
                want = (want.view(torch.int16) if want.dtype == torch.bfloat16 else want).numpy()
                ok &= bool(np.array_equal(a[off[s] : off[s + 1]], want))
    return dt, cpu, ok


def chunk_counts(path: Path) -> tuple[int, int]:
    """(chunks stored uncompressed while behind, as the commit record counts them; all chunks)."""
    import zarr

    g = zarr.open_group(str(path / "rank0"), mode="r")
    raw = sum(
        sum(e.get("uncompressed_chunks", {}).values())
        for e in g.attrs["hstrace"]["commit"]["tables"].values()
    )
    total = 0
    for tname in ("target", "draft_step"):
        for _, a in g[tname].arrays():
            total += -(-a.shape[0] // a.chunks[0])
    return raw, total


def check_hstrace(path: Path, pool: list[dict], steps: int) -> bool:
    """The trace holds every step, bit-exact (spot-checked at both ends)."""
    with open_trace(path) as tr:
        t = tr.rank(0).table("target")
        d = tr.rank(0).table("draft_step")
        if t.num_steps != steps or d.num_steps != steps:
            return False
        for s in (0, steps - 1):
            want = pool[s % len(pool)]
            got_t, got_d = t.step(s)["tok"], d.step(s)["tok"]
            for k, v in want["target"].items():
                if not torch.equal(
                    torch.as_tensor(got_t[k]).view(
                        torch.int16 if v.dtype == torch.bfloat16 else v.dtype
                    ),
                    v.view(torch.int16) if v.dtype == torch.bfloat16 else v,
                ):
                    return False
            if not torch.equal(
                got_d["logits"].view(torch.int16), want["draft"]["logits"].view(torch.int16)
            ):
                return False
    return True


def _proc_status_mb(pid: int | None, key: str) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _proc_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system) process pid has used so far (Linux /proc), else None."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _proc_written(pid: int | None) -> int | None:
    """Bytes process pid has sent to the block device so far (/proc/<pid>/io write_bytes:
    its O_DIRECT writes, its page-cache writes, in-kernel copies), else None."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/io") as f:
            return int(next(x for x in f if x.startswith("write_bytes:")).split()[1])
    except (OSError, ValueError, StopIteration):
        return None


def _files(root: Path) -> tuple[int, int]:
    n = size = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            n += 1
            st = os.stat(os.path.join(dirpath, name))
            # A shard live at its key is sparse (rowlog._Shard): count what it holds.
            size += min(st.st_size, st.st_blocks * 512)
    return n, size


def _read_files_raw(root: Path) -> tuple[float, int]:
    """Seconds to read every file of the trace sequentially (16 MiB reads), and bytes read."""
    buf = bytearray(16 << 20)
    view, total = memoryview(buf), 0
    t0 = time.perf_counter()
    for dirpath, _, names in os.walk(root):
        for name in sorted(names):
            with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                while n := f.readinto(view):
                    total += n
    return time.perf_counter() - t0, total


def _read_files_raw_fresh(root: Path) -> tuple[float, int]:
    """Seconds to read every file of the trace into new memory of its size (the pages are
    the reader's to fault in, as hstrace's reader's output is), and bytes read."""
    total = 0
    t0 = time.perf_counter()
    for dirpath, _, names in os.walk(root):
        for name in sorted(names):
            p = os.path.join(dirpath, name)
            buf = np.empty(os.path.getsize(p), np.uint8)
            with open(p, "rb", buffering=0) as f:
                view, got = memoryview(buf), 0
                while got < len(buf) and (n := f.readinto(view[got:])):
                    got += n
            total += got
            del buf
    return time.perf_counter() - t0, total


def _read_hstrace_all(root: Path, slice_rows: int = 8192) -> tuple[float, int]:
    """Seconds to read every committed row of every column through hstrace's reader, in
    slices (the trace does not fit in RAM), and the logical bytes read."""
    total = 0
    t0 = time.perf_counter()
    with open_trace(root) as tr:
        for name in tr.rank(0).tables:
            t = tr.rank(0).table(name)
            for axis, cols in t.columns.items():
                n = t.num_rows(axis)
                for c in cols:
                    for a in range(0, n, slice_rows):
                        x = t.column(axis, c, a, min(n, a + slice_rows))
                        total += x.numel() * x.element_size() if hasattr(x, "numel") else x.nbytes
    return time.perf_counter() - t0, total


def run_large(pool: list[dict], steps: int, workdir: Path, window: int, step_ms: float) -> dict:
    """One long paced recording with the shipped writer: per window of steps, the producer's
    cost, the writer process's memory and the files; then whole-trace read rates."""
    from hstrace.trace import summarize

    out = Path(tempfile.mkdtemp(dir=workdir))
    m = Hstrace(out)
    pid = m.writer_pid()
    sb = step_bytes(pool[0])
    windows, costs = [], []
    t0 = time.perf_counter()
    for s in range(steps):
        if step_ms:
            busy(step_ms)
        a = time.perf_counter()
        m.record(pool[s % len(pool)])
        costs.append((time.perf_counter() - a) * 1000)
        if (s + 1) % window == 0 or s + 1 == steps:
            files, size = _files(m.root())
            windows.append(
                {
                    "steps": s + 1,
                    "logical_gb": (s + 1) * sb / 1e9,
                    "disk_gb": size / 1e9,
                    "files": files,
                    "producer_ms_median": pct(costs[-window:], 50),
                    "producer_ms_p99": pct(costs[-window:], 99),
                    "writer_rss_mb": _proc_status_mb(pid, "VmRSS"),
                    "writer_peak_rss_mb": _proc_status_mb(pid, "VmHWM"),
                    # RSS counts the staging ring's pages it has read (shared with the
                    # producer); the writer's own memory is its anonymous part.
                    "writer_rss_anon_mb": _proc_status_mb(pid, "RssAnon"),
                    "writer_rss_shmem_mb": _proc_status_mb(pid, "RssShmem"),
                    "blocked_s_total": m.blocked_s(),
                    "writer_cpu_s": _proc_cpu_s(pid),
                    # Device writes over the bytes the trace holds: 1 is every byte written
                    # once (tail flushes that copied each shard so far wrote more).
                    "writer_written_gb": (_proc_written(pid) or 0) / 1e9,
                }
            )
    m.close()
    wall = time.perf_counter() - t0
    files, size = _files(m.root())
    res = {
        "steps": steps,
        "step_ms": step_ms,
        "logical_gb": steps * sb / 1e9,
        "disk_gb": size / 1e9,
        "files": files,
        "wall_s": wall,
        "windows": windows,
    }
    rounds = []
    for _ in range(2):  # alternating, the second round of each is reported (caches settled)
        raw_s, raw_bytes = _read_files_raw(m.root())
        fresh_s, _ = _read_files_raw_fresh(m.root())
        hs_s, hs_bytes = _read_hstrace_all(m.root())
        t = time.perf_counter()
        with open_trace(m.root()) as tr:
            summarize(tr)  # what `hstrace show` computes
        show_s = time.perf_counter() - t
        rounds.append((raw_s, raw_bytes, hs_s, hs_bytes, show_s, fresh_s, os.getloadavg()[0]))
    raw_s, raw_bytes, hs_s, hs_bytes, show_s, fresh_s, _ = rounds[-1]
    # From the device: the same files read raw into new memory, then through hstrace's
    # reader, each after evicting them from the page cache.
    drop_cache(m.root())
    cold_raw_s, _ = _read_files_raw_fresh(m.root())
    drop_cache(m.root())
    cold_hs_s, _ = _read_hstrace_all(m.root())
    res.update(
        {
            "raw_read_cold_mb_s": raw_bytes / 1e6 / cold_raw_s,
            "hstrace_read_cold_logical_mb_s": hs_bytes / 1e6 / cold_hs_s,
            "hstrace_read_cold_logical_vs_raw_cold": (hs_bytes / cold_hs_s)
            / (raw_bytes / cold_raw_s),
        }
    )
    res.update(
        {
            "raw_read_disk_mb_s": raw_bytes / 1e6 / raw_s,
            "raw_read_fresh_disk_mb_s": raw_bytes / 1e6 / fresh_s,
            "hstrace_read_logical_vs_raw_fresh": (hs_bytes / hs_s) / (raw_bytes / fresh_s),
            "hstrace_read_logical_mb_s": hs_bytes / 1e6 / hs_s,
            "hstrace_read_disk_mb_s": size / 1e6 / hs_s,
            "hstrace_read_logical_vs_raw_disk": (hs_bytes / hs_s) / (raw_bytes / raw_s),
            "read_rounds": rounds,
            "show_s": show_s,
        }
    )
    shutil.rmtree(out)
    return res


def codec_chunks(pool: list[dict]) -> list[np.ndarray]:
    """The pool's columns cut into the writer's own chunks (rows per chunk as the writer picks
    them, bf16 as its uint16 bits): what the codec-alone baseline encodes."""
    from hstrace.trace.schema import unit_rows

    chunks = []
    for part in STEP_PARTS:
        for col in pool[0][part]:
            rows = torch.cat([step[part][col] for step in pool])
            if rows.dtype == torch.bfloat16:
                rows = rows.view(torch.int16)
            a = rows.numpy().view(np.uint16) if rows.dtype == torch.int16 else rows.numpy()
            cr, _ = unit_rows(a.itemsize * math.prod(a.shape[1:]))
            chunks += [np.ascontiguousarray(a[i : i + cr]) for i in range(0, len(a) - cr + 1, cr)]
    return chunks


def writer_encode(chunk: np.ndarray, out: np.ndarray) -> int:
    """One chunk encoded exactly as the writer encodes it into its page-aligned buffer
    (rowlog._compress_into: byte planes for 2-byte values, c-blosc zstd-1 for the rest)."""
    from hstrace.trace.write import rowlog

    return rowlog._compress_into(chunk, out).nbytes


def codec_alone(
    chunks: list[np.ndarray], total_bytes: int, threads: int, cblosc: bool = False
) -> dict:
    """The writer's encoder alone (writer_encode) on `total_bytes` of the workload's chunks, on
    `threads` threads: no ring, no gather copy, no file, no Python per step. The bound the
    writer's lossless rate is measured against. `cblosc`: c-blosc zstd-1 with byte shuffle on
    every chunk instead (the codec issue 14 names, and the writer's before the byte planes)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from numcodecs import Blosc

    from hstrace.trace.codecs import blosc_into
    from hstrace.trace.write import rowlog

    rowlog.configure(0, False)  # one Blosc thread per call, as in the writer process
    big = max(c.nbytes for c in chunks) + blosc_into.MAX_OVERHEAD
    local = threading.local()

    def one(c: np.ndarray) -> int:
        out = getattr(local, "out", None)
        if out is None:  # one reused page-aligned buffer per thread, as the writer's
            out = local.out = blosc_into.aligned_buffer(big)
        if cblosc:
            return blosc_into.compress_into(
                c, out, rowlog.CNAME, rowlog.CLEVEL, Blosc.SHUFFLE, rowlog.BLOCKSIZE
            )
        return writer_encode(c, out)

    work, n, i = [], 0, 0
    while n < total_bytes:
        work.append(chunks[i % len(chunks)])
        n += work[-1].nbytes
        i += 1
    c0 = _cpu_s()[0]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        out = sum(ex.map(one, work))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "cpu_s": _cpu_s()[0] - c0, "bytes": n, "out_bytes": out}


def decode_alone(chunks: list[np.ndarray], total_bytes: int, threads: int) -> dict:
    """The reader's decoder alone (chunkread's: byte-plane frames through blosc_planes, the
    rest through c-blosc; HSTRACE_BENCH_DECODER=cblosc: c-blosc on all) on `total_bytes` of
    the same chunks, compressed as the writer stores them (encoded once, not timed), decoded
    into one new array (as hstrace's reader returns new arrays, and the raw read into new
    memory reads), on `threads` threads: no file, no read, no Python per row. The bound a
    warm (page-cache) read of a compressed trace is measured against."""
    from concurrent.futures import ThreadPoolExecutor

    from numcodecs import Blosc

    from hstrace.trace.codecs import blosc_into, blosc_planes
    from hstrace.trace.write import rowlog

    rowlog.configure(0, False)
    buf = blosc_into.aligned_buffer(max(c.nbytes for c in chunks) + blosc_into.MAX_OVERHEAD)
    frames = [bytes(buf[: writer_encode(c, buf)]) for c in chunks]
    sizes = [c.nbytes for c in chunks]
    work, n, i = [], 0, 0
    while n < total_bytes:
        work.append(i % len(chunks))
        n += sizes[work[-1]]
        i += 1
    dec = Blosc()
    at = np.cumsum([0] + [sizes[j] for j in work])

    planes = os.environ.get("HSTRACE_BENCH_DECODER", "reader") == "reader"
    # Memory the guest never touched before costs a hypervisor fault per page: faulting in
    # 1.38 GB of new memory took 2.08 s the first time in a process here, 0.068 s every time
    # after. The reads this bound is set against land in memory already touched once (earlier
    # runs'), so this does too: touched and freed, untimed.
    np.ones(int(at[-1]), np.uint8)

    def one(k: int) -> int:  # as chunkread decodes a whole chunk (or c-blosc alone)
        dest = out[at[k] : at[k + 1]]
        if not (planes and blosc_planes.decompress_into(frames[work[k]], dest)):
            dec.decode(frames[work[k]], out=dest)
        return sizes[work[k]]

    c0 = _cpu_s()[0]
    t0 = time.perf_counter()
    out = np.empty(int(at[-1]), np.uint8)  # new memory, as the reader's (and raw_fresh's)
    with ThreadPoolExecutor(threads) as ex:
        got = sum(ex.map(one, range(len(work))))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "cpu_s": _cpu_s()[0] - c0, "bytes": got}


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def slowest_preempted_share(p: dict) -> float:
    """Of the paced steps at or above the p99 cost, the share whose call was preempted."""
    cut = pct(p["costs_ms"], 99)
    slow = [v for c, v in zip(p["costs_ms"], p["preempted"], strict=True) if c >= cut]
    return sum(slow) / len(slow)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--methods",
        default=",".join(m.name for m in METHODS),
        help="comma-separated subset (e.g. 'hstrace' for a quick paced p99 check); "
        "the x-raw ratios need raw_write",
    )
    ap.add_argument("--paced-steps", type=int, default=300)
    ap.add_argument("--firehose-steps", type=int, default=1000)
    ap.add_argument(
        "--growth-steps",
        type=int,
        default=3000,
        help="one longer firehose run per method for the marginal file rate (0: skip)",
    )
    ap.add_argument(
        "--large-steps",
        type=int,
        default=0,
        help="one long paced recording of this many steps with the shipped writer (e.g. "
        "14000: 19 GB logical, 13 GB on disk; deleted after), then whole-trace reads (0: skip)",
    )
    ap.add_argument("--large-window", type=int, default=1000)
    ap.add_argument("--large-step-ms", type=float, default=STEP_MS)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--draft-rows", type=int, default=16)
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument(
        "--workdir",
        default=None,
        help="where the outputs go (default: a temp dir on the same disk as /tmp)",
    )
    args = ap.parse_args(argv)
    methods = [m for m in METHODS if m.name in args.methods.split(",")]
    if not methods and not args.large_steps:
        ap.error("--methods names none of " + ", ".join(m.name for m in METHODS))
    if args.firehose_steps < 1:
        ap.error("--firehose-steps must be at least 1")

    pool = make_pool(
        32, args.tokens, args.hidden, args.slots, args.draft_rows, args.topk, args.vocab
    )
    sb, bb = step_bytes(pool[0]), bf16_bytes(pool[0])
    workdir = Path(tempfile.mkdtemp(prefix="hstrace-bench-", dir=args.workdir))
    raw: dict[str, dict[str, list[dict]]] = {m.name: {"paced": [], "firehose": []} for m in methods}
    chunks = codec_chunks(pool)
    codec_runs: dict[str, list[dict]] = {"codec_1t": [], "codec_2t": [], "cblosc_1t": []}
    decode_runs: list[dict] = []
    try:
        for r in range(args.rounds):
            order = methods if r % 2 == 0 else methods[::-1]  # alternate order against drift
            for cls in order:
                raw[cls.name]["paced"].append(run_one(cls, pool, args.paced_steps, True, workdir))
                raw[cls.name]["firehose"].append(
                    run_one(cls, pool, args.firehose_steps, False, workdir, read=True)
                )
                if not args.json:
                    print(f"round {r + 1}/{args.rounds} {cls.name} done", file=sys.stderr)
            if methods:  # the codec alone on the same bytes, in the same round
                total = args.firehose_steps * sb
                for k in (1, 2):
                    codec_runs[f"codec_{k}t"].append(codec_alone(chunks, total, k))
                codec_runs["cblosc_1t"].append(codec_alone(chunks, total, 1, cblosc=True))
                decode_runs.append(decode_alone(chunks, total, 2))
        large = None
        if args.large_steps:
            large = run_large(
                pool, args.large_steps, workdir, args.large_window, args.large_step_ms
            )
            if not args.json:
                print(f"{args.large_steps}-step large run done", file=sys.stderr)
        if args.growth_steps > args.firehose_steps:
            # File counts do not depend on timing: one longer run per method is enough.
            for cls in methods:
                raw[cls.name]["growth"] = [run_one(cls, pool, args.growth_steps, False, workdir)]
                if not args.json:
                    print(f"{args.growth_steps}-step run {cls.name} done", file=sys.stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    results = {}
    for name, modes in raw.items():
        paced, fire = modes["paced"], modes["firehose"]
        med = statistics.median
        tokens = args.firehose_steps * args.tokens
        entry = {
            "producer_ms_median": med(pct(p["costs_ms"], 50) for p in paced),
            "producer_ms_p99": med(pct(p["costs_ms"], 99) for p in paced),
            # CPU the serving thread itself spent (the wall time above also counts preemption).
            "producer_cpu_ms_median": med(pct(p["cpu_ms"], 50) for p in paced),
            # The same, less time spent waiting for room in the staging ring (backpressure when
            # the writer process falls behind): what the copy + queue put itself costs.
            "staging_ms_median": med(
                pct([c - b for c, b in zip(p["costs_ms"], p["blocked_ms"], strict=True)], 50)
                for p in paced
            ),
            "staging_ms_p99": med(
                pct([c - b for c, b in zip(p["costs_ms"], p["blocked_ms"], strict=True)], 99)
                for p in paced
            ),
            # Of the record call, the memcpy into the staging ring alone (hstrace's own count),
            # and everything else (checks, ring allocation, the pipe message).
            "producer_copy_ms_median": med(pct(p["copy_ms"], 50) for p in paced),
            "producer_other_ms_median": med(
                pct([c - k for c, k in zip(p["costs_ms"], p["copy_ms"], strict=True)], 50)
                for p in paced
            ),
            "blocked_steps_share": med(
                sum(b > 0 for b in p["blocked_ms"]) / len(p["blocked_ms"]) for p in paced
            ),
            "sustained_mb_s": med(args.firehose_steps * sb / 1e6 / f["wall_s"] for f in fire),
            "bytes_on_disk_per_token": med(f["disk_bytes"] / tokens for f in fire),
            "disk_vs_raw_bytes": med(f["disk_bytes"] / (args.firehose_steps * sb) for f in fire),
            "files_per_1000_steps": med(f["files"] * 1000 / args.firehose_steps for f in fire),
            # The constant part of the count: one zarr.json per array/group, whatever the length.
            "metadata_files": med(f["metadata_files"] for f in fire),
            # Steps whose record call was preempted by the OS (not time the writer cost).
            "preempted_steps_share": med(sum(p["preempted"]) / len(p["preempted"]) for p in paced),
            "p99_steps_preempted_share": med(slowest_preempted_share(p) for p in paced),
            "producer_ms_p99_not_preempted": med(
                pct([c for c, v in zip(p["costs_ms"], p["preempted"], strict=True) if not v], 99)
                for p in paced
            ),
        }
        if modes.get("growth"):
            # The steady rate: the further steps of the longer run over the time they added,
            # without the start and the close (the ring's last drain, tails, zarr.json), which
            # both runs pay once.
            extra_s = modes["growth"][0]["wall_s"] - med(f["wall_s"] for f in fire)
            entry["steady_mb_s"] = (
                (args.growth_steps - args.firehose_steps) * sb / 1e6 / extra_s
                if extra_s > 0
                else None
            )
            long_files = modes["growth"][0]["files"]
            entry[f"files_in_{args.growth_steps}_steps"] = long_files
            entry["files_per_extra_1000_steps"] = (
                (long_files - med(f["files"] for f in fire))
                * 1000
                / (args.growth_steps - args.firehose_steps)
            )
        entry["load_1min_median"] = med(f["load_1min"] for f in fire)
        entry["producer_share_of_10ms_step"] = entry["producer_ms_median"] / STEP_MS
        if name.startswith("hstrace"):
            entry["lossless_bit_exact"] = all(
                x["lossless"] for x in paced + fire + modes.get("growth", [])
            )
            entry["uncompressed_chunk_share_firehose"] = med(
                f["uncompressed_chunks"] / max(1, f["chunks"]) for f in fire
            )
        # Logical MB per CPU second spent (producer + writer process): load-independent.
        entry["mb_per_cpu_s"] = med(
            args.firehose_steps * sb / 1e6 / max(1e-9, f["cpu_self_s"] + f["cpu_children_s"])
            for f in fire
        )
        entry["writer_cpu_s_per_gb"] = med(
            f["cpu_children_s"] / (args.firehose_steps * sb / 1e9) for f in fire
        )
        if all("read_s" in f for f in fire):
            entry["read_mb_s"] = med(args.firehose_steps * sb / 1e6 / f["read_s"] for f in fire)
        if all("read_fresh_s" in f for f in fire):
            entry["read_fresh_mb_s"] = med(
                args.firehose_steps * sb / 1e6 / f["read_fresh_s"] for f in fire
            )
        if all("read_cold_s" in f for f in fire):
            entry["read_cold_mb_s"] = med(
                args.firehose_steps * sb / 1e6 / f["read_cold_s"] for f in fire
            )
        if all("read_cpu_s" in f for f in fire):
            entry["read_mb_per_cpu_s"] = med(
                args.firehose_steps * sb / 1e6 / max(1e-9, f["read_cpu_s"]) for f in fire
            )
        results[name] = entry
    base = results.get("raw_write")
    codec = {}
    for k, runs in codec_runs.items():
        if runs:
            med = statistics.median
            codec[k] = {
                "mb_s": med(x["bytes"] / 1e6 / x["wall_s"] for x in runs),
                "mb_per_cpu_s": med(x["bytes"] / 1e6 / max(1e-9, x["cpu_s"]) for x in runs),
                "ratio": med(x["out_bytes"] / x["bytes"] for x in runs),
            }
            if base:
                codec[k]["mb_s_vs_raw"] = codec[k]["mb_s"] / base["sustained_mb_s"]
            if "raw_write_direct" in results:
                codec[k]["mb_s_vs_raw_direct"] = (
                    codec[k]["mb_s"] / results["raw_write_direct"]["sustained_mb_s"]
                )
    if decode_runs:
        med = statistics.median
        codec["decode_2t"] = {
            "mb_s": med(x["bytes"] / 1e6 / x["wall_s"] for x in decode_runs),
            "mb_per_cpu_s": med(x["bytes"] / 1e6 / max(1e-9, x["cpu_s"]) for x in decode_runs),
        }
        fresh = (base or {}).get("read_fresh_mb_s")
        if fresh:  # the decoder's bound on a warm read, against the raw read into new memory
            codec["decode_2t"]["mb_s_vs_raw_read_fresh"] = codec["decode_2t"]["mb_s"] / fresh
    for name, e in results.items():
        # A warm read against the decoder alone (both on two threads, into new memory).
        if name.startswith("hstrace") and "decode_2t" in codec and "read_mb_s" in e:
            e["read_vs_decode_alone"] = e["read_mb_s"] / codec["decode_2t"]["mb_s"]
        # The writer against the codec alone with as many threads (1 for hstrace_1t, else 2).
        c = codec.get(
            {"hstrace_1t": "codec_1t", "hstrace_1t_cblosc": "cblosc_1t"}.get(name, "codec_2t")
        )
        if name.startswith("hstrace") and c:
            e["mb_s_vs_codec_alone"] = e["sustained_mb_s"] / c["mb_s"]
    copy = results.get("copy_only")
    for e in results.values():
        e["producer_vs_raw"] = (
            e["producer_ms_median"] / base["producer_ms_median"] if base else None
        )
        e["producer_vs_copy"] = (
            e["producer_ms_median"] / copy["producer_ms_median"] if copy else None
        )
        e["mb_s_vs_raw"] = e["sustained_mb_s"] / base["sustained_mb_s"] if base else None
        if base and "read_mb_s" in e and "read_mb_s" in base:
            e["read_vs_raw"] = e["read_mb_s"] / base["read_mb_s"]
            if "read_fresh_mb_s" in base:  # both land in new memory
                e["read_vs_raw_fresh"] = e["read_mb_s"] / base["read_fresh_mb_s"]
        if base and "read_cold_mb_s" in e and "read_cold_mb_s" in base:
            # Both from the device (page cache evicted), both into new memory.
            e["read_cold_vs_raw_cold"] = e["read_cold_mb_s"] / base["read_cold_mb_s"]
        direct = results.get("raw_write_direct")
        if direct:
            e["mb_s_vs_raw_direct"] = e["sustained_mb_s"] / direct["sustained_mb_s"]
            if e.get("steady_mb_s") and direct.get("steady_mb_s"):  # both without start/close
                e["steady_vs_raw_direct_steady"] = e["steady_mb_s"] / direct["steady_mb_s"]
        if base:
            e["mb_per_cpu_s_vs_raw"] = e["mb_per_cpu_s"] / base["mb_per_cpu_s"]
    report = {
        "workload": {
            "step_bytes": sb,
            "bf16_bytes_per_step": bb,
            "tokens_per_step": args.tokens,
            "aux_hidden": [args.tokens, args.slots * args.hidden],
            "draft_rows": args.draft_rows,
            "topk": args.topk,
            "vocab": args.vocab,
            "paced_steps": args.paced_steps,
            "firehose_steps": args.firehose_steps,
            "growth_steps": args.growth_steps,
            "rounds": args.rounds,
            "step_ms": STEP_MS,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
        },
        "results": results,
        # The codec alone on the firehose's bytes, in the writer's chunks, 1 and 2 threads,
        # measured in every round next to the methods: the bound of a lossless writer.
        "codec_alone": codec,
        "load_average": os.getloadavg(),
    }
    if large is not None:
        report["large"] = large
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"workload: {sb / 1e6:.3f} MB/step ({bb / sb:.0%} bf16), {args.tokens} tokens/step; medians of {args.rounds} rounds"
        )
        hdr = f"{'method':<12} {'prod med ms':>11} {'p99 ms':>8} {'p99 !pre':>8} {'cpu ms':>7} {'% of 10ms':>9} {'MB/s':>8} {'x raw':>6} {'x direct':>8} {'steady':>7} {'B/token':>9} {'disk/raw':>8} {'files/1k':>9} {'+files/1k':>9}"
        print(hdr)
        for name, e in results.items():
            growth = e.get("files_per_extra_1000_steps")
            print(
                f"{name:<12} {e['producer_ms_median']:>11.3f} {e['producer_ms_p99']:>8.3f} {e['producer_ms_p99_not_preempted']:>8.3f} {e['producer_cpu_ms_median']:>7.3f} {e['producer_share_of_10ms_step']:>9.1%} "
                f"{e['sustained_mb_s']:>8.0f} {e['mb_s_vs_raw'] or math.nan:>6.2f} {e.get('mb_s_vs_raw_direct') or math.nan:>8.2f} {e.get('steady_mb_s') or math.nan:>7.0f} {e['bytes_on_disk_per_token']:>9.0f} {e['disk_vs_raw_bytes']:>8.3f} {e['files_per_1000_steps']:>9.0f} "
                + (f"{growth:>9.1f}" if growth is not None else f"{'-':>9}")
            )
        print(
            "p99 !pre: p99 of the steps whose record call was not preempted; "
            "+files/1k: files added per further 1000 steps (from one longer run); x direct: "
            "MB/s against raw_write_direct; steady: MB/s of the longer run's further steps"
        )
        if large is not None:
            print(
                f"large: {large['steps']} steps, {large['logical_gb']:.1f} GB logical, "
                f"{large['disk_gb']:.1f} GB on disk, {large['files']} files; read: hstrace "
                f"{large['hstrace_read_logical_mb_s']:.0f} MB/s logical vs raw read of its files "
                f"{large['raw_read_disk_mb_s']:.0f} MB/s; show {large['show_s']:.2f} s"
            )
            for w in large["windows"]:
                print(
                    f"  {w['steps']:>6} steps {w['logical_gb']:6.1f} GB  producer median "
                    f"{w['producer_ms_median']:.3f} p99 {w['producer_ms_p99']:.3f} ms  writer RSS "
                    f"{w['writer_rss_mb'] or 0:.0f} MB (peak {w['writer_peak_rss_mb'] or 0:.0f}, "
                    f"own {w['writer_rss_anon_mb'] or 0:.0f}, ring {w['writer_rss_shmem_mb'] or 0:.0f})  "
                    f"files {w['files']}  device writes / disk "
                    f"{w['writer_written_gb'] / max(w['disk_gb'], 1e-9):.2f}"
                )
        for k, c in codec.items():
            if k == "decode_2t":  # the decoder alone has no stored/raw, and its own baseline
                print(
                    f"{k}: the decoder alone into new memory {c['mb_s']:.0f} MB/s "
                    f"({c.get('mb_s_vs_raw_read_fresh') or math.nan:.2f}x a raw read), "
                    f"{c['mb_per_cpu_s']:.0f} MB per CPU s"
                )
                continue
            print(
                f"{k}: the codec alone on the same bytes {c['mb_s']:.0f} MB/s "
                f"({c.get('mb_s_vs_raw') or math.nan:.2f}x raw_write), {c['mb_per_cpu_s']:.0f} MB "
                f"per CPU s, stored/raw {c['ratio']:.3f}"
            )
        h = results.get("hstrace")
        if h is None:
            return report
        print(
            f"hstrace: staging only (excluding waits for ring room) median {h['staging_ms_median']:.3f} ms, p99 {h['staging_ms_p99']:.3f} ms; "
            f"steps that waited for the writer: {h['blocked_steps_share']:.1%}; lossless (bit-exact read-back): {h['lossless_bit_exact']}"
        )
        print(
            f"hstrace: {h['metadata_files']:.0f} of its files are zarr.json metadata (one per array/group, "
            f"constant); steps at or above p99 that were preempted: {h['p99_steps_preempted_share']:.0%}"
        )
    return report


if __name__ == "__main__":
    main()
