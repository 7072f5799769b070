"""Replay's trace read (`hstrace.replay.read.read_serving`): whole columns vs committed rows;
and (`--requests`) a whole replay of many mostly-prefill requests, two hstrace trees side by side.

Writes a trace through the real TraceWriter with Kimi-K2.5-wide aux rows (3 x 7168 bf16,
43 KB a row: 64-row chunks inside 2048-row shards) and verify rounds whose drafts are mostly
rejected, then reads it with the current `read_serving` and with the one of a git ref (default
0beb8c3, before the windowed read), each in a fresh process, side by side: wall time, peak RSS,
and the rows / bytes of `target.aux_hidden` and `draft_extend.hidden_in` requested through
`TableView.column` (what the chunk reader decodes). Both reads must give the same tensors.

    python bench/replay_rows.py --steps 60 --batch 8 --draft-tokens 32 --accept 2 --json

`--requests 16,64`: a trace of that many requests, each one prefill of `--prompt` tokens with
`--hidden`-wide aux slots (3 of them, bf16) and its draft extend (hidden input = the aux concat,
top-k from the reference drafter itself: a clean trace), written once per size; then a full
`hstrace replay` of it against the tiny world's training dump with a random drafter of that
width (`--draft-vocab` rows of lm_head), in a fresh process per run, alternating this tree and
the one at `--before` (a copy of an older tree's `hstrace/`, e.g. `git archive HEAD hstrace |
tar -x -C /tmp/s3before`; run from /tmp with it first on PYTHONPATH): wall, peak RSS, rows and
MB of the wide columns read, and the replay JSON's digest (both trees must conclude the same).

    python bench/replay_rows.py --requests 16,64 --prompt 1024 --hidden 768 \
        --before /tmp/s3before --rounds 2 --json
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
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
        from hstrace.replay import read

        return read
    # The module was hstrace/replay/serving.py before the replay's stages were named.
    for path in ("hstrace/replay/read.py", "hstrace/replay/serving.py"):
        got = subprocess.run(
            ["git", "show", f"{ref}:{path}"], cwd=REPO, capture_output=True, text=True
        )
        if got.returncode == 0:
            break
    got.check_returncode()
    src = got.stdout
    spec = importlib.util.spec_from_loader("serving_at_ref", loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serving_at_ref"] = mod
    exec(compile(src, f"{ref}:{path}", "exec"), mod.__dict__)  # noqa: S102
    return mod


def count_wide_reads() -> dict[str, list[int]]:
    """From now on in this process, count the rows and bytes every read of a wide column
    returns: {"table.column": [rows, bytes]} (one measurement per process)."""
    from hstrace.trace.reader import TableView

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
    return asked


def measure(path: Path, ref: str | None, dump: Path) -> dict:
    """One read in this process: the counts, the time, the peak RSS; tensors saved to `dump`."""
    from hstrace.trace import open_trace

    serving = _serving_module(ref)
    asked = count_wide_reads()
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


# -- many requests, a whole replay ---------------------------------------------------------------
WORLD_TRAINING = REPO / "traces" / "tiny-world" / "training-speculators"


def _drafter(hidden: int, vocab: int, draft_vocab: int):
    from hstrace.drafter import DrafterConfig, Eagle3Drafter

    cfg = DrafterConfig(
        hidden_size=hidden,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        intermediate_size=2 * hidden,
        max_position_embeddings=8192,
        aux_layer_ids=[2, 4, 5],
    )
    torch.manual_seed(0)
    model = Eagle3Drafter(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.05 * torch.randn_like(p))
        model.d2t.copy_(
            torch.arange(draft_vocab) * (vocab // draft_vocab) - torch.arange(draft_vocab)
        )
        model.t2d.zero_()
        model.t2d[torch.arange(draft_vocab) * (vocab // draft_vocab)] = True
    return model.eval()


def write_many(path: Path, ckpt: Path, requests: int, prompt: int, hidden: int, draft_vocab: int):
    """One prefill step and one draft extend per request (SGLang runs a long prefill alone);
    the engine's top-k is the reference drafter's own (fp32), so the trace replays clean."""
    from hstrace.drafter.checkpoint import save_drafter
    from hstrace.reference.step0 import Step0Input, step0_logits
    from hstrace.trace import TraceWriter, create_trace, request_key

    vocab = 2 * draft_vocab
    model = _drafter(hidden, vocab, draft_vocab)
    save_drafter(model, ckpt, dialect="speculators")
    create_trace(path, engine={"name": "reference", "version": "bench"}, command_line=["bench"])
    w = TraceWriter(path, rank=0, process=False)
    g = torch.Generator().manual_seed(1)
    attrs = {"tok/aux_hidden": {"layer_ids": [2, 4, 5], "slot_width": hidden}}
    for i in range(requests):
        key = torch.tensor([request_key(f"r{i}")], dtype=torch.int64)
        ids = torch.randint(0, vocab, (prompt + 1,), generator=g)
        pos = torch.arange(prompt)
        aux = (torch.randn(prompt, 3 * hidden, generator=g) * 4).to(torch.bfloat16)
        w.write(
            "target",
            step={"mode": 0},
            req={"req_key": key, "n_tok": torch.tensor([prompt])},
            tok={"input_ids": ids[:prompt], "positions": pos, "aux_hidden": aux},
            column_attrs=attrs,
        )
        with torch.inference_mode():
            (logits,) = step0_logits(model, [Step0Input(ids[1:], aux, pos)])
        lp = torch.log_softmax(logits.float(), -1)
        top = lp.topk(8, dim=-1)
        w.write(
            "draft_extend",
            req={"req_key": key, "n_tok": torch.tensor([prompt])},
            tok={
                "input_ids": ids[1:],
                "positions": pos,
                "hidden_in": aux,
                "topk_draft_ids": top.indices,
                "topk_target_ids": top.indices * (vocab // draft_vocab),
                "topk_logprobs": top.values,
            },
        )
    w.close()


def measure_replay(path: Path, ckpt: Path) -> dict:
    """One whole replay in this process: wall, peak RSS, the wide rows read, the JSON digest."""
    import hstrace
    from hstrace import replay_trace

    asked = count_wide_reads()
    u0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    doc = replay_trace(path, WORLD_TRAINING, ckpt).to_json()
    wall = time.perf_counter() - t0
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    rss0, rss1 = u0.ru_maxrss, u1.ru_maxrss
    text = json.dumps(doc, sort_keys=True)
    return {
        "tree": str(Path(hstrace.__file__).parent.parent),
        "wall_s": round(wall, 2),
        # CPU seconds (user + system) of the replay: what the machine's load does not change
        "cpu_s": round(u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime, 2),
        "peak_rss_mb": round(rss1 / 1024, 1),
        "rss_before_replay_mb": round(rss0 / 1024, 1),
        "verdict": doc["verdict"]["code"],
        "json_sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
        "rows_requested": {k: v[0] for k, v in asked.items()},
        "mb_requested": {k: round(v[1] / 2**20, 1) for k, v in asked.items()},
    }


def many(a) -> dict:
    sizes = [int(x) for x in a.requests.split(",")]
    trees = {"before": Path(a.before).resolve(), "after": REPO}
    out: dict = {"args": {k: v for k, v in vars(a).items() if not k.startswith("_")}}
    with tempfile.TemporaryDirectory(prefix="hstrace-replay-many-") as tmp:
        traces = {}
        for n in sizes:
            trace, ckpt = Path(tmp) / f"many-{n}.zarr", Path(tmp) / f"drafter-{n}"
            t0 = time.perf_counter()
            write_many(trace, ckpt, n, a.prompt, a.hidden, a.draft_vocab)
            disk = sum(f.stat().st_size for f in trace.rglob("*") if f.is_file())
            traces[n] = (trace, ckpt)
            out[f"trace_{n}"] = {
                "write_s": round(time.perf_counter() - t0, 1),
                "disk_mb": round(disk / 2**20, 1),
                "aux_mb": round(n * a.prompt * 3 * a.hidden * 2 / 2**20, 1),
            }
        runs: dict[str, list[dict]] = {}
        for _ in range(a.rounds):  # alternate, so both trees see the same machine load
            for n in sizes:
                for label, tree in trees.items():
                    env = dict(os.environ, PYTHONPATH=str(tree))
                    env.update(kv.split("=", 1) for kv in a.env)
                    trace, ckpt = traces[n]
                    res = subprocess.run(
                        [sys.executable, str(Path(__file__).resolve()), "--_replay",
                         str(trace), str(ckpt)],
                        capture_output=True, text=True, cwd="/tmp", env=env,
                    )  # fmt: skip
                    if res.returncode:
                        raise SystemExit(f"{label} {n}: {res.stderr[-2000:]}")
                    got = json.loads(res.stdout.strip().splitlines()[-1])
                    runs.setdefault(f"{label}_{n}", []).append(got)
                    print(
                        label, n, got["wall_s"], got["cpu_s"], got["peak_rss_mb"], file=sys.stderr
                    )
        out["runs"] = runs
        out["same_json"] = {
            n: len({r["json_sha256"] for k in (f"before_{n}", f"after_{n}") for r in runs[k]}) == 1
            for n in sizes
        }
    return out


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
    ap.add_argument("--requests", help="many-requests replay case: sizes, e.g. 16,64")
    ap.add_argument("--prompt", type=int, default=1024, help="prefill tokens per request")
    ap.add_argument("--draft-vocab", type=int, default=1024)
    ap.add_argument("--before", default="/tmp/s3before", help="the older tree (with hstrace/)")
    ap.add_argument("--_replay", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        help="KEY=VALUE for the replay processes (e.g. MALLOC_MMAP_THRESHOLD_=131072: glibc "
        "then returns every large freed block, so peak RSS shows what was allocated)",
    )
    a = ap.parse_args()
    if a._replay:
        print(json.dumps(measure_replay(Path(a._replay[0]), Path(a._replay[1]))))
        return
    if a.requests:
        doc = many(a)
        print(json.dumps(doc, indent=1))
        return
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
