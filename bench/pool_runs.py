"""Pool runs of `live_overhead.py`: the figures bench/README.md gives since the twenty-sixth pass.

    python bench/pool_runs.py [--key pair|long|drain|session] 'held-*.json' ['streamed-*.json']

Each file is one run's stdout (the JSON `live_overhead.py` prints). For each
glob: the runs' own medians, the median of all their samples pooled, and its 95 % interval
by a bootstrap over runs then samples (each resample draws as many runs as there are, with
replacement, then each drawn run's samples, with replacement): a run's server, placement and
host minute are a level of their own, so the interval holds the spread between runs, not just
the spread between pairs. With two globs, the first's pooled median minus the second's, by the
same bootstrap drawn for both. Samples (`--key`): `pair` the short rounds' armed/dormant ratio
per pair (`ratio_per_pair`), `long` the long blocks' ratio per cycle, `drain` and `session`
the `--drain-round` ratios. Fixed seeds: the same files give the same figures.

Exit 0; 2 with one line on stderr for a glob that matches no file or a file that is not such a
run (an empty file, a run that failed, is skipped and named on stderr).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import random
import statistics
import sys
from pathlib import Path

KEYS = {
    "pair": ("ratio_per_pair",),
    "long": ("long_session", "ratio_per_cycle"),
    "drain": ("ratio_per_pair_drain",),
    "session": ("ratio_per_pair_session",),
}
DRAWS = 4000


class BadInput(Exception):
    pass


def samples(path: Path, key: str) -> list[float]:
    """One run's samples of `key`."""
    try:
        node = json.loads(path.read_text())["one_server_armed_vs_dormant"]
        for part in KEYS[key]:
            node = node[part]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadInput(
            f"{path}: not a live_overhead.py run with {key!r} samples ({exc!r})"
        ) from None
    if not isinstance(node, list) or not node or not all(_ratio(x) for x in node):
        raise BadInput(f"{path}: its {key!r} samples are not a non-empty list of finite numbers")
    return [float(x) for x in node]


def _ratio(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def runs_of(pattern: str, key: str) -> list[list[float]]:
    files = sorted(Path(f) for f in glob.glob(pattern))
    if not files:
        raise BadInput(f"{pattern}: no file matches")
    runs = []
    for f in files:
        if f.stat().st_size == 0:
            print(f"pool_runs: {f}: empty (a run that failed), skipped", file=sys.stderr)
            continue
        runs.append(samples(f, key))
    if not runs:
        raise BadInput(f"{pattern}: every file is empty")
    return runs


def resample(runs: list[list[float]], rng: random.Random) -> float:
    """One bootstrap draw: runs with replacement, then each one's samples with replacement."""
    pool: list[float] = []
    for run in (rng.choice(runs) for _ in runs):
        pool += [rng.choice(run) for _ in run]
    return statistics.median(pool)


def interval(draws: list[float]) -> tuple[float, float]:
    d = sorted(draws)
    return d[int(0.025 * len(d))], d[int(0.975 * len(d)) - 1]


def pooled(runs: list[list[float]], seed: int = 0, n: int = DRAWS) -> dict:
    rng = random.Random(seed)
    lo, hi = interval([resample(runs, rng) for _ in range(n)])
    return {
        "runs": len(runs),
        "samples": sum(map(len, runs)),
        "per_run_median": [round(statistics.median(r), 3) for r in runs],
        "pooled_median": round(statistics.median([x for r in runs for x in r]), 3),
        "ci95": [round(lo, 3), round(hi, 3)],
    }


def difference(a: list[list[float]], b: list[list[float]], seed: int = 1, n: int = DRAWS) -> dict:
    rng = random.Random(seed)
    d = [resample(a, rng) - resample(b, rng) for _ in range(n)]
    lo, hi = interval(d)
    return {"median": round(statistics.median(d), 3), "ci95": [round(lo, 3), round(hi, 3)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--key", choices=sorted(KEYS), default="pair")
    ap.add_argument("globs", nargs="+", help="one or two globs of run files")
    args = ap.parse_args(argv)
    if len(args.globs) > 2:
        print(f"pool_runs: one or two globs, not {len(args.globs)}", file=sys.stderr)
        return 2
    try:
        sets = [runs_of(g, args.key) for g in args.globs]
    except BadInput as exc:
        print(f"pool_runs: {exc}", file=sys.stderr)
        return 2
    out: dict = {g: pooled(runs) for g, runs in zip(args.globs, sets, strict=True)}
    if len(sets) == 2:
        out["first_minus_second"] = difference(*sets)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
