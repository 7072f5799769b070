"""CPU of writing an unsharded column's whole chunks: through the page cache against O_DIRECT.

    python bench/chunk_write.py [--dir DIR] [--mb 3] [--files 40] [--repeats 3]

Writes `--files` chunk files of `--mb` MB each (a Blosc frame of random bf16-like bytes in
page-aligned memory, as the writer holds it), alternately with `rowlog._write_file` (the page
cache: what every unsharded chunk took before the fifteenth pass) and
`rowlog._write_chunk_file` (O_DIRECT where the file system takes it, padded to whole blocks,
then cut to the frame), each file new and kept until the end, as a recording's are (freed
page-cache pages would be reused at a fraction of the cost). Counts this process's CPU
(`time.process_time`: user + system) per MB written, each round in a directory of its own under
`--dir` (default: a temp directory; put it on the file system a trace would be on), and the
wall time too (an O_DIRECT write waits for the device). Prints one JSON object: per variant the
CPU ms per MB of each repeat and their median, and the ratio O_DIRECT over page cache.

A guest VM's first touch of memory it never used before is what the page cache pays for here
(this project's 2-vCPU VM: ~4 ms per MB); on other hosts the page cache's copy is what remains.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from hstrace.trace.codecs.blosc_into import aligned_buffer
from hstrace.trace.write import rowlog


def frame(nbytes: int) -> rowlog.Aligned:
    """A chunk's frame in aligned memory: random high and low bytes, as an incompressible
    activation chunk stores (what is written is the cost here, not what it holds)."""
    block = aligned_buffer(nbytes)
    block[:nbytes] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    return rowlog.Aligned(block, nbytes)


def one(variant: str, data: rowlog.Aligned, files: int, parent: str) -> tuple[float, float]:
    """(CPU ms per MB, wall ms per MB) of writing `files` new chunk files one way."""
    d = tempfile.mkdtemp(prefix=f"{variant}-", dir=parent)
    mb = data.nbytes * files / 1e6
    c0, w0 = time.process_time(), time.perf_counter()
    for i in range(files):
        path = os.path.join(d, str(i))
        if variant == "page_cache":
            rowlog._write_file(path, rowlog._parts(data))
        else:
            rowlog._write_chunk_file(path, data)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    assert os.path.getsize(os.path.join(d, "0")) == data.nbytes
    return 1e3 * cpu / mb, 1e3 * wall / mb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--mb", type=float, default=3.0)
    ap.add_argument("--files", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rowlog.ENCODER.read_flags()
    parent = tempfile.mkdtemp(prefix="hstrace-chunk-write-", dir=args.dir)
    try:
        probe = os.path.join(parent, "probe")
        fd, direct = rowlog._open_new_file(probe)
        os.close(fd)
        os.unlink(probe)
        data = frame(int(args.mb * 1e6) + 123)  # not a whole number of blocks, as frames are
        runs: dict[str, list[tuple[float, float]]] = {"page_cache": [], "o_direct": []}
        for _ in range(args.repeats):  # alternated, so what the host does falls on both
            for variant in runs:
                runs[variant].append(one(variant, data, args.files, parent))
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    out: dict = {"mb_per_file": args.mb, "files": args.files, "o_direct_taken": direct}
    for variant, rs in runs.items():
        out[variant] = {
            "cpu_ms_per_mb": [round(c, 3) for c, _ in rs],
            "cpu_ms_per_mb_median": round(statistics.median(c for c, _ in rs), 3),
            "wall_ms_per_mb_median": round(statistics.median(w for _, w in rs), 3),
        }
    out["cpu_ratio_o_direct_over_page_cache"] = round(
        out["o_direct"]["cpu_ms_per_mb_median"] / out["page_cache"]["cpu_ms_per_mb_median"], 3
    )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
