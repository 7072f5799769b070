"""`hstrace bundle`: cut, redact, write, report, hash and zip, in that order.

The zip holds the trace's store keys at its root (so `open_trace` and a plain zarr `ZipStore`
read it as a trace) and the bundle's own files under `hstrace-bundle/`. Members are stored,
not deflated: trace chunks are already compressed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hstrace import redaction as rd
from hstrace.bundle import manifest as mf
from hstrace.bundle.select import RankPlan, choose_events, parse_requests, parse_steps, plan_rank
from hstrace.bundle.subset import Redaction, SubsetStats, write_subset
from hstrace.errors import HstraceError

# The bundle group's zarr.json: makes `hstrace-bundle/` a (data-less) zarr group, so listing
# the trace root does not warn about an unknown object.
_GROUP_JSON = json.dumps(
    {"zarr_format": 3, "node_type": "group", "attributes": {"hstrace_bundle": mf.BUNDLE_FORMAT}}
)


@dataclass
class BundleOptions:
    steps: str | None = None
    requests: str | None = None
    max_size: int | None = None  # bytes, whole zip
    redact: tuple[str, ...] = ()
    salt: bytes | None = None
    drafter: str | None = None
    with_drafter: bool = False
    against: str | None = None  # training dir for the replay verdict
    # (markdown, replay JSON) of the verdict on a bundled store; with `against` it must be
    # given from above (`hstrace.pipelines.bundle` passes the replay): bundle never runs it.
    verdict: Callable[[Path], tuple[str, dict[str, Any]]] | None = None


@dataclass
class BundleResult:
    path: Path
    size: int
    engine_steps: dict[int, list[int]]
    total_engine_steps: dict[int, int]
    events: dict[str, int]
    report_kind: str  # "replay" or "summary"
    reproduce: str
    salt_written: Path | None = None
    attempts: list[dict[str, int]] = field(default_factory=list)
    # With --against: the replay's JSON on the bundled subset (docs/replay-json.md), whose
    # `exit_code` the command exits with.
    replay: dict[str, Any] | None = None

    @property
    def exit_code(self) -> int:
        """The verdict's exit code with --against (0, 1 or 3), else 0."""
        if not self.replay:
            return 0
        code = self.replay.get("exit_code")
        if code in (0, 1, 3):
            return int(code)
        return 1 if (self.replay.get("verdict") or {}).get("severity") == "fault" else 0

    def to_json(self) -> dict[str, Any]:
        """`hstrace bundle --json`: what was written, what was kept, the verdict when replayed."""
        v = (self.replay or {}).get("verdict") or {}
        return {
            "path": str(self.path),
            "bytes": self.size,
            "engine_steps": {str(r): len(s) for r, s in self.engine_steps.items()},
            "total_engine_steps": {str(r): n for r, n in self.total_engine_steps.items()},
            "events": dict(self.events),
            "report": self.report_kind,
            "reproduce": self.reproduce,
            "salt_written": str(self.salt_written) if self.salt_written else None,
            "verdict": (
                {k: v.get(k) for k in ("code", "stage", "severity", "summary")}
                if self.replay
                else None
            ),
            "complete": (self.replay or {}).get("complete", True),
            "failed": dict((self.replay or {}).get("failed") or {}),
            "exit_code": self.exit_code,
        }


def parse_size(text: str) -> int:
    """`50MB`, `1.5GiB`, `200k`, `1000000` -> bytes (decimal units; KiB/MiB/GiB binary)."""
    t = text.strip().lower().replace(" ", "")
    units = {
        "kib": 1 << 10,
        "mib": 1 << 20,
        "gib": 1 << 30,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "k": 10**3,
        "m": 10**6,
        "g": 10**9,
        "b": 1,
    }
    for suffix, mult in units.items():
        if t.endswith(suffix):
            t, factor = t[: -len(suffix)], mult
            break
    else:
        factor = 1
    try:
        value = float(t)
    except ValueError:
        raise HstraceError(f"--max-size {text!r}: expected a size like 50MB or 200KiB") from None
    if value <= 0:
        raise HstraceError(f"--max-size {text!r} must be positive")
    return int(value * factor)


def _column_attrs_reader(trace: Any):
    def attrs(rank: int, table: str, axis: str, column: str) -> dict[str, Any]:
        t = trace.rank(rank).table(table)
        return t.column_attrs(axis, column)

    return attrs


def _zip_dir(store: Path, out: Path, extras: dict[str, bytes]) -> dict[str, str]:
    """Zip a store dir (keys relative to its root) plus extra members; returns name -> sha256."""
    hashes: dict[str, str] = {}
    tmp = out.with_name(out.name + ".partial")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for f in sorted(p for p in store.rglob("*") if p.is_file()):
            if f.name.endswith(".partial") or ".partial" in f.suffixes:
                continue
            name = f.relative_to(store).as_posix()
            zf.write(f, name)
            hashes[name] = mf.sha256_file(f)
        for name, data in extras.items():
            zf.writestr(name, data)
            if name != mf.MANIFEST:
                hashes[name] = mf.sha256_bytes(data)
    tmp.replace(out)
    return hashes


def _step_cost(trace: Any, plans: dict[int, RankPlan]) -> dict[int, list[int]]:
    """Raw (uncompressed) bytes per engine step, per rank: what choosing a step costs."""
    costs: dict[int, list[int]] = {}
    for rank, plan in plans.items():
        view = trace.rank(rank)
        cost = [0] * plan.num_engine_steps
        per_table: dict[str, Any] = {}
        for name in {ev.table for ev in plan.events}:
            t = view.table(name)
            row_bytes = {}
            for axis, cols in t.columns.items():
                row_bytes[axis] = sum(_row_nbytes(t, axis, c) for c in cols)
            offs = {a: t.offsets(a) for a in t.columns if a != "step"}
            per_table[name] = (row_bytes, offs)
        for ev in plan.events:
            row_bytes, offs = per_table[ev.table]
            b = row_bytes.get("step", 0)
            for axis, off in offs.items():
                b += row_bytes[axis] * int(off[ev.step + 1] - off[ev.step])
            if ev.engine_step < len(cost):
                cost[ev.engine_step] += b
        costs[rank] = cost
    return costs


def _row_nbytes(t: Any, axis: str, column: str) -> int:
    a = t.column(axis, column, start=0, stop=1)
    return (
        int(a.element_size() * a.numel())
        if hasattr(a, "element_size")
        else int(getattr(a, "nbytes", 8))
    )


def open_checked(path: str | os.PathLike[str]) -> Any:
    """`open_trace`, after the zip-bomb and path checks when `path` is a zip (a bundle)."""
    from hstrace.trace import open_trace
    from hstrace.trace.safezip import check_zip

    if Path(path).is_file():
        check_zip(path)
    return open_trace(path)


def make_bundle(
    trace_path: str | os.PathLike[str], out: str | os.PathLike[str], opts: BundleOptions
) -> BundleResult:
    from hstrace.bundle.report_md import reproduce_line, write_report
    from hstrace.trace import request_key

    out = Path(out)
    if out.suffix != ".zip":
        raise HstraceError(f"{out}: a bundle is a .zip file (use -o NAME.zip)")
    if not out.parent.exists():
        raise HstraceError(f"{out.parent}: output directory does not exist")
    trace = open_checked(trace_path)
    how = Redaction(ids="ids" in opts.redact, hidden="hidden" in opts.redact)
    if how.ids and opts.against:
        # The drafter cannot embed hashed ids, and a verdict computed on the clear ids could
        # quote them in its evidence: the two do not go together.
        raise HstraceError(
            "--redact ids cannot be combined with --against: replay needs the clear token ids and "
            "its evidence may quote them; bundle without --against, or drop --redact ids"
        )
    salt_written = None
    if how.ids:
        if opts.salt is None:
            how.salt = rd.new_salt()
            salt_written = out.with_name(out.name + ".salt")
            salt_written.write_bytes(how.salt)  # the file holds the salt itself
            os.chmod(salt_written, 0o600)
        else:
            how.salt = opts.salt
    drafter = mf.drafter_record(opts.drafter) if opts.drafter else None
    if opts.with_drafter and drafter is None:
        raise HstraceError(
            "--with-drafter needs --drafter PATH (the drafter checkpoint to include)"
        )

    plans = {r: plan_rank(trace.rank(r), r) for r in trace.ranks}
    requests = parse_requests(opts.requests, request_key)
    wanted = {r: parse_steps(opts.steps, p.num_engine_steps) for r, p in plans.items()}
    costs = _step_cost(trace, plans) if opts.max_size else {}

    drafter_members: dict[str, bytes] = {}
    if opts.with_drafter and opts.drafter:
        base = Path(opts.drafter) if Path(opts.drafter).is_dir() else Path(opts.drafter).parent
        for f in mf.drafter_files(opts.drafter):
            drafter_members[f"{mf.DRAFTER_DIR}/{f.relative_to(base).as_posix()}"] = f.read_bytes()

    redaction_info = {
        "modes": how.modes,
        "salt_sha256": rd.salt_digest(how.salt) if how.ids else None,
        "id_hash": "blake2b-64(id as int64 LE, key=blake2b(salt, person=domain)) & (2**63-1)"
        if how.ids
        else None,
        "hidden": {
            "stats": list(rd.STATS),
            "sketch_dim": rd.SKETCH_DIM,
            "sketch_seed": rd.SKETCH_SEED,
        }
        if how.hidden
        else None,
    }
    attempts: list[dict[str, int]] = []
    keep = {r: len(s) for r, s in wanted.items()}  # how many of the wanted steps (a prefix)
    if opts.max_size:
        budget = opts.max_size - 64 * 1024 - sum(len(v) for v in drafter_members.values())
        for r, steps in wanted.items():
            keep[r] = _prefix_that_fits(steps, costs[r], budget)
    best: BundleResult | None = None
    work_root = Path(tempfile.mkdtemp(prefix=".hstrace-bundle-", dir=out.parent))
    try:
        for attempt in range(6):
            chosen_steps = {r: wanted[r][: keep[r]] for r in wanted}
            result = _build_once(
                trace,
                trace_path,
                plans,
                chosen_steps,
                requests,
                how,
                redaction_info,
                drafter,
                drafter_members,
                opts,
                out,
                work_root / f"a{attempt}",
                write_report,
                reproduce_line,
            )
            attempts.append(
                {"steps": sum(len(v) for v in chosen_steps.values()), "bytes": result.size}
            )
            if not opts.max_size:
                best = result
                break
            if result.size <= opts.max_size:
                if best is None or result.size > best.size:
                    best = result
                # Fits: try once more with the measured compression, if more steps are wanted.
                grown = _rescale(
                    keep, wanted, costs, opts.max_size, result.size, chosen_steps, grow=True
                )
                if grown == keep or attempt >= 3:
                    break
                keep = grown
                continue
            if best is not None or all(k <= 1 for k in keep.values()):
                break
            keep = _rescale(
                keep, wanted, costs, opts.max_size, result.size, chosen_steps, grow=False
            )
        if best is None:
            raise HstraceError(
                f"--max-size {opts.max_size} bytes: even one engine step per rank packs to "
                f"{attempts[-1]['bytes']} bytes; raise the limit or use --redact hidden"
            )
        shutil.move(best.path, out)
        best.path = out
        best.size = out.stat().st_size
    finally:
        shutil.rmtree(work_root, ignore_errors=True)
    best.attempts = attempts
    best.salt_written = salt_written
    return best


def _prefix_that_fits(steps, cost, budget: float) -> int:
    """How many leading steps fit in `budget` raw bytes (at least one: a bundle is never empty)."""
    total, n = 0, 0
    for s in steps:
        total += cost[s]
        if total > budget:
            break
        n += 1
    return max(1, n)


def _rescale(keep, wanted, costs, limit, size, chosen_steps, grow: bool) -> dict[int, int]:
    """New prefix lengths so that the estimated packed size lands just under `limit`."""
    raw = sum(costs[r][s] for r, steps in chosen_steps.items() for s in steps) or 1
    per_raw = size / raw  # packed bytes per raw byte, measured
    out = {}
    for r, steps in wanted.items():
        target = 0.97 * limit / per_raw * (sum(costs[r][s] for s in chosen_steps[r]) / raw)
        n = _prefix_that_fits(steps, costs[r], target)
        out[r] = max(n, keep[r]) if grow else min(n, max(1, keep[r] - 1))
    return out


def _build_once(
    trace,
    trace_path,
    plans,
    chosen_steps,
    requests,
    how,
    redaction_info,
    drafter,
    drafter_members,
    opts,
    out,
    work,
    write_report,
    reproduce_line,
) -> BundleResult:
    chosen = {r: choose_events(plans[r], chosen_steps[r], requests) for r in plans}
    if not any(chosen.values()):
        raise HstraceError("the selection (--steps/--requests) keeps no event of the trace")
    work.mkdir(parents=True)
    store = work / "trace.zarr"
    selection = {
        "steps": opts.steps,
        "requests": opts.requests,
        "max_size": opts.max_size,
        "engine_steps": {str(r): s for r, s in chosen_steps.items()},
        "total_engine_steps": {str(r): p.num_engine_steps for r, p in plans.items()},
        "step_definition": "one target forward plus the events recorded after it (hstrace.bundle.select)",
    }
    stats: SubsetStats = write_subset(
        trace,
        store,
        chosen,
        how,
        extra_static={
            "bundle": {
                "selection": selection,
                "redaction": redaction_info,
                "source_engine_steps": selection["total_engine_steps"],
            }
        },
        column_attrs=_column_attrs_reader(trace),
    )
    redaction_info = {**redaction_info, "dropped_columns": stats.dropped_columns}
    reproduce = reproduce_line(out, opts)
    replay_store = store
    if opts.against and how.modes:
        # Redacted hidden states cannot be replayed; the verdict is computed on the same subset
        # before redaction (its evidence is numbers: cosines, norms, rates), and REPORT.md says so.
        replay_store = work / "clear.zarr"
        write_subset(
            trace,
            replay_store,
            chosen,
            Redaction(),
            extra_static={},
            column_attrs=_column_attrs_reader(trace),
        )
    report_md, report_kind, replay_json = write_report(replay_store, opts, how, reproduce)
    extras = {
        f"{mf.BUNDLE_DIR}/zarr.json": _GROUP_JSON.encode(),
        mf.REPORT: report_md.encode(),
        mf.REPRODUCE: (reproduce + "\n").encode(),
        **drafter_members,
    }
    members = {name: mf.sha256_bytes(data) for name, data in extras.items()}
    for f in sorted(p for p in store.rglob("*") if p.is_file()):
        members[f.relative_to(store).as_posix()] = mf.sha256_file(f)
    meta = trace.meta
    source = {
        "path": str(Path(trace_path).resolve()),
        "schema_version": meta.get("schema_version"),
        "engine": meta.get("engine"),
        "command_line": meta.get("command_line"),
        "created": meta.get("created"),
        "hstrace_version": meta.get("hstrace_version"),
        "ranks": list(trace.ranks),
    }
    manifest = mf.build_manifest(
        source=source,
        selection={**selection, "events": stats.events},
        redaction=redaction_info,
        drafter=({**drafter, "included": bool(drafter_members)} if drafter else None),
        members=members,
        reproduce=reproduce,
        replay=replay_json,
    )
    extras[mf.MANIFEST] = json.dumps(manifest, indent=2, sort_keys=False).encode()
    zip_path = work.with_suffix(".zip")
    _zip_dir(store, zip_path, extras)
    shutil.rmtree(work, ignore_errors=True)
    return BundleResult(
        path=zip_path,
        size=zip_path.stat().st_size,
        engine_steps=dict(stats.engine_steps),
        total_engine_steps={r: p.num_engine_steps for r, p in plans.items()},
        events=stats.events,
        report_kind=report_kind,
        reproduce=reproduce,
        replay=replay_json,
    )
