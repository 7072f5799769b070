"""What the verify tap copies on vLLM's serving thread before the rejection sampler runs, by
vocabulary size: the drafted rows whole (`tapmath.gather_rows`, what the hooks copied before
the thirty-second pass, and still where vLLM's processors are rerun on the rows) against the raw
logit at each drafted token (`tapmath.gather_at`, what they copy now), side by side in this
process, interleaved call by call on the same logits.

    python bench/raw_snapshot.py [--vocab 512 32000 128256] [--batch 8] [--k 3] [--calls 300]

Prints one JSON object: per vocabulary, each route's median us a call, the bytes it copies and
the rows route's time over the values route's. A step of `--batch` requests with `--k` drafts
each; float32 logits of batch * (k + 1) rows, as vLLM's CPU path hands `RejectionSampler.forward`
(the tiny world of bench/live_overhead.py: 512; Llama-2: 32000; Llama-3: 128256). Back to back,
warm: the serving thread runs these cold, after the target's forward (bench/README.md,
nineteenth pass), so the figures are lower bounds of what a step pays. Exit 2 with one line
when the native module is not built (both routes need it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from hstrace.engines import tapmath


def measure(vocab: int, batch: int, k: int, calls: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(batch * (k + 1), vocab, generator=g)
    # vLLM's int32 indices: each request's k drafted rows, then its bonus row
    at = torch.arange(batch * (k + 1)).reshape(batch, k + 1)[:, :k].reshape(-1).to(torch.int32)
    ids = torch.randint(0, vocab, (batch * k,), generator=g, dtype=torch.int32)
    routes = {
        "rows": lambda: tapmath.gather_rows(logits, at),
        "values": lambda: tapmath.gather_at(logits, at, ids),
    }
    times: dict[str, list[float]] = {name: [] for name in routes}
    copied: dict[str, int] = {}
    for _ in range(calls):
        for name, route in routes.items():  # interleaved: the same minute for both
            t0 = time.perf_counter()
            snap = route()
            times[name].append(time.perf_counter() - t0)
            copied[name] = len(snap.buf)
    us = {name: statistics.median(ts) * 1e6 for name, ts in times.items()}
    return {
        "rows_us": round(us["rows"], 2),
        "values_us": round(us["values"], 2),
        "rows_bytes": copied["rows"],
        "values_bytes": copied["values"],
        "rows_over_values": round(us["rows"] / us["values"], 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[512, 32000, 128256])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args(argv)
    if tapmath.native() is None:
        print("raw_snapshot: the native module is not built (pip install -e .)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # the serving thread's own copy: one thread
    out = {
        "batch": args.batch,
        "k": args.k,
        "by_vocab": {str(v): measure(v, args.batch, args.k, args.calls) for v in args.vocab},
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
