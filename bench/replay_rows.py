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

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
WIDE = ("aux_hidden", "hidden_in")


def write(path: Path, steps: int, batch: int, draft_tokens: int, accept: int, hidden: int) -> None:
    from hstrace.trace import TraceWriter, create_trace, request_key

    create_trace(path, engine={"name": "reference", "version": "bench"}, command_line=["bench"])
    w = TraceWriter(path, rank=0, process=False)
    keys = torch.tensor([request_key(f"r{i}") for i in range(batch)], dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    lens = [64] * batch
    attrs = {"tok/aux_hidden": {"layer_ids": [2, 30, 57], "slot_width": hidden}}

    def rows(n: int) -> torch.Tensor:
        return torch.randn(n, 3 * hidden, generator=g).to(torch.bfloat16)

    def step(mode: int, n_tok: list[int], starts: list[int]) -> None:
        pos = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, n_tok, strict=True)])
        ids = torch.from_numpy((pos * 7 + 1) % 500)
        w.write(
            "target",
            step={"mode": mode},
            req={"req_key": keys, "n_tok": torch.tensor(n_tok)},
            tok={
                "input_ids": ids,
                "positions": torch.from_numpy(pos),
                "aux_hidden": rows(len(pos)),
            },
            column_attrs=attrs,
        )

    def extend(n_tok: list[int], starts: list[int]) -> None:
        pos = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, n_tok, strict=True)])
        k = torch.from_numpy(((pos[:, None] + np.arange(4)) % 256).astype(np.int64))
        w.write(
            "draft_extend",
            req={"req_key": keys, "n_tok": torch.tensor(n_tok)},
            tok={
                "input_ids": torch.from_numpy((pos * 7 + 1) % 500),
                "positions": torch.from_numpy(pos),
                "hidden_in": rows(len(pos)),
                "topk_draft_ids": k,
                "topk_target_ids": k,
                "topk_logprobs": torch.zeros(len(pos), 4),
            },
        )

    step(0, lens, [0] * batch)
    extend(lens, [0] * batch)
    for _ in range(steps):
        starts = [n - 1 for n in lens]
        step(1, [draft_tokens] * batch, starts)
        w.write(
            "verify",
            req={
                "req_key": keys,
                "accept_len": torch.full((batch,), accept),
                "bonus_id": torch.zeros(batch, dtype=torch.int64),
                "n_proposed": torch.full((batch,), draft_tokens - 1),
                "n_accepted": torch.full((batch,), accept),
            },
            proposed={"ids": torch.zeros(batch * (draft_tokens - 1), dtype=torch.int64)},
            accepted={"ids": torch.zeros(batch * accept, dtype=torch.int64)},
        )
        extend([1 + accept] * batch, [n for n in lens])
        lens = [n + 1 + accept for n in lens]
    w.close()


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
        write(trace, a.steps, a.batch, a.draft_tokens, a.accept, a.hidden)
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
