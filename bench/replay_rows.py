"""Replay's trace read (`hstrace.replay.serving.read_serving`): whole columns vs committed rows.

Writes a trace through the real TraceWriter with Kimi-K2.5-wide aux rows (3 x 7168 bf16,
43 KB a row: 64-row chunks inside 2048-row shards) and verify rounds whose drafts are mostly
rejected, then reads it with the current `read_serving` and with the one of a git ref (default
0beb8c3, before the windowed read), each in a fresh process, side by side: wall time, peak RSS,
and the rows / bytes of `target.aux_hidden` and `draft_extend.hidden_in` requested through
`TableView.column` (what the chunk reader decodes). Both reads must give the same tensors.

    python bench/replay_rows.py --steps 60 --batch 8 --draft-tokens 32 --accept 2 --json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
WIDE = ("aux_hidden", "hidden_in")


def _helper():
    """tests/helpers/wide_trace.py (the trace the tests use too), loaded by path."""
    path = REPO / "tests" / "helpers" / "wide_trace.py"
    spec = importlib.util.spec_from_file_location("wide_trace", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _serving_module(ref: str | None):
    if ref is None:
        from hstrace.replay import serving

        return serving
    src = subprocess.run(
        ["git", "show", f"{ref}:hstrace/replay/serving.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    spec = importlib.util.spec_from_loader("serving_at_ref", loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serving_at_ref"] = mod
    exec(compile(src, f"{ref}:hstrace/replay/serving.py", "exec"), mod.__dict__)  # noqa: S102
    return mod


def measure(path: Path, ref: str | None, dump: Path) -> dict:
    """One read in this process: the counts, the time, the peak RSS; tensors saved to `dump`."""
    from hstrace.trace import open_trace
    from hstrace.trace.reader import TableView

    serving = _serving_module(ref)
    asked: dict[str, list[int]] = {}
    column = TableView.column

    def counting(self, axis, name, start=None, stop=None):
        out = column(self, axis, name, start, stop)
        if name in WIDE:
            a = asked.setdefault(f"{self.name}.{name}", [0, 0])
            a[0] += len(out)
            a[1] += int(out.numel()) * out.element_size()
        return out

    TableView.column = counting
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with open_trace(path) as tr:
        data = serving.read_serving(tr)
        n_rows = {
            "target.aux_hidden": tr.rank(0).table("target").num_rows("tok"),
            "draft_extend.hidden_in": tr.rank(0).table("draft_extend").num_rows("tok"),
        }
    wall = time.perf_counter() - t0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.save(
        {
            "aux": [r.aux for r in data.requests],
            "hidden_in": [r.draft.hidden_in for r in data.requests],
            "tokens": [torch.from_numpy(r.tokens) for r in data.requests],
        },
        dump,
    )
    return {
        "wall_s": round(wall, 3),
        "peak_rss_mb": round(rss1 / 1024, 1),  # the process's peak; before the read: next
        "rss_before_read_mb": round(rss0 / 1024, 1),
        "peak_rss_growth_mb": round((rss1 - rss0) / 1024, 1),
        "column_rows": n_rows,
        "rows_requested": {k: v[0] for k, v in asked.items()},
        "mb_requested": {k: round(v[1] / 2**20, 1) for k, v in asked.items()},
        "committed_aux_rows": sum(r.aux_rows for r in data.requests),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--draft-tokens", type=int, default=32, help="target rows per verify")
    ap.add_argument("--accept", type=int, default=2, help="accepted drafts per verify")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ref", default="0beb8c3", help="git ref of the whole-column read")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--_measure", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._measure:
        path, ref, dump = a._measure
        print(json.dumps(measure(Path(path), None if ref == "-" else ref, Path(dump))))
        return
    with tempfile.TemporaryDirectory(prefix="hstrace-replay-rows-") as tmp:
        trace = Path(tmp) / "t.zarr"
        t0 = time.perf_counter()
        _helper().write_wide_trace(trace, a.steps, a.batch, a.draft_tokens, a.accept, a.hidden)
        disk = sum(f.stat().st_size for f in trace.rglob("*") if f.is_file())
        out: dict = {"args": vars(a) | {"_measure": None}, "write_s": time.perf_counter() - t0}
        out["disk_mb"] = round(disk / 2**20, 1)
        runs: dict[str, list[dict]] = {"whole_columns": [], "windowed": []}
        for _ in range(a.rounds):  # alternate, so both see the same machine load
            for label, ref in (("whole_columns", a.ref), ("windowed", "-")):
                dump = Path(tmp) / f"{label}.pt"
                res = subprocess.run(
                    [sys.executable, __file__, "--_measure", str(trace), ref, str(dump)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                runs[label].append(json.loads(res.stdout.strip().splitlines()[-1]))
        old = torch.load(Path(tmp) / "whole_columns.pt", weights_only=True)
        new = torch.load(Path(tmp) / "windowed.pt", weights_only=True)
        out["identical"] = all(
            all(torch.equal(x, y) for x, y in zip(old[k], new[k], strict=True)) for k in old
        )
        out["runs"] = runs
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        for label, rs in runs.items():
            print(
                label, [(r["wall_s"], r["peak_rss_growth_mb"]) for r in rs], rs[-1]["mb_requested"]
            )
        print("identical:", out["identical"])


if __name__ == "__main__":
    main()
