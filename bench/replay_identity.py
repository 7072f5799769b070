"""Replay JSON of a fixed set of traces, to compare two hstrace trees byte for byte.

`--record DIR` records the fault traces once (the reference engine of the tree that runs it,
tiny world, one knob set each) plus `--redact hidden` bundles of the examples; `--replay DIR
--out FILE` replays every trace in DIR and the bundled examples (traces/examples/*.zarr)
against the tiny world's training dump and writes {name: replay JSON}. Run `--replay` with
each tree (the older one with PYTHONPATH=<its copy>, from another directory) and compare the
files: a redesign of replay's memory must not change one byte of what replay concludes.

    python bench/replay_identity.py --record /tmp/s3traces
    (cd /tmp && PYTHONPATH=/tmp/s3before python /work/main/bench/replay_identity.py \
        --replay /tmp/s3traces --out /tmp/before.json)
    python bench/replay_identity.py --replay /tmp/s3traces --out /tmp/after.json
    cmp /tmp/before.json /tmp/after.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORLD = REPO / "traces" / "tiny-world"
EXAMPLES = REPO / "traces" / "examples"
TRAINING = WORLD / "training-speculators"

# One recorded trace per knob set: every replay path that touches the wide tensors (slots,
# health, dead rows, crossed rows, step-0 accuracy, engine vs reference, chains, the what-if
# search, cache hits and their rebuilt spans, chunk seams, batch coupling).
CASES: dict[str, dict] = {
    "clean": {},
    "corrupt-zeros": {"corrupt": "zeros"},
    "corrupt-constant": {"corrupt": "constant"},
    "corrupt-other-request": {"corrupt": "other-request"},
    "skip-fc": {"skip_fc": True},
    "weights-dropped": {"drop_weights": "layers.0."},
    "norm-flag": {"norm_flags": {"norm_before_residual": False}},
    "feed-normed": {"norm_flags": {"feed_normed": True}},
    "rope": {"rope_theta": 500000.0},
    "window": {"sliding_window": 8},
    "token-shift": {"token_shift": 1},
    "position-shift": {"position_shift": 3},
    "aux-order": {"aux_order": [2, 0, 1]},
    "default-layers": {"default_layers": True},
    "target-noise": {"target_noise": 0.2},
    "d2t-table": {"d2t_as_table": True},
    "prefix-cache": {"prefix_cache": True},
    "kv-stale": {"prefix_cache": True, "draft_kv_stale": "zeros"},
    "chunked": {"chunked_prefill_size": 8},
}


def record(out: Path) -> None:
    from hstrace.bundle import BundleOptions, make_bundle
    from hstrace.engines import EngineConfig, Prompt, RecordOptions, get_engine
    from hstrace.training import open_training

    out.mkdir(parents=True, exist_ok=True)
    td = open_training(TRAINING)
    for name, knobs in CASES.items():
        n = 24
        ids = [tuple(td[i].input_ids[:n].tolist()) for i in range(40, 44)]
        if knobs.get("prefix_cache"):  # later prompts share the first one's leading tokens
            ids = [ids[0], ids[0][:16] + ids[1][16:], ids[0][:12] + ids[2][12:], ids[3]]
        prompts = [Prompt(input_ids=p, source_id=f"heldout:{i}") for i, p in enumerate(ids)]
        engine = get_engine(
            "reference",
            EngineConfig(
                target=WORLD / "target", drafter=WORLD / "drafter-speculators", extra=knobs
            ),  # fmt: skip
        )
        res = engine.record(prompts, out / f"{name}.zarr", RecordOptions(max_new_tokens=8,
                                                                      show_progress=False))  # fmt: skip
        print(name, "ok" if res.ok else res, file=sys.stderr)
    for name in ("clean", "aux-layer-shift"):
        make_bundle(EXAMPLES / f"{name}.zarr", out / f"{name}-redacted.zip",
                    BundleOptions(redact=("hidden",)))  # fmt: skip
    _batched(out)


def _batched(out: Path) -> None:
    """Batched steps (batch coupling's cosine per step): the first two requests' prefill,
    draft extend and first verify in one step each; then the second request's rows copied
    from the first's (aux) or fed the first's tokens, its draft top-k recomputed, as
    tests/test_field_scenarios.py builds them with the third-party producer."""
    import importlib.util

    from hstrace.drafter import load_drafter
    from hstrace.trace import open_trace, request_key

    spec = importlib.util.spec_from_file_location(
        "field_producer", REPO / "tests" / "helpers" / "field_producer.py"
    )
    fp = importlib.util.module_from_spec(spec)
    sys.modules["field_producer"] = fp  # (dataclasses look their module up)
    spec.loader.exec_module(fp)
    drafter, _ = load_drafter(WORLD / "drafter-speculators")
    clean = out / "clean.zarr"
    with open_trace(clean) as tr:
        rids = [r.decode() if isinstance(r, bytes) else r for r in _rids(tr)]
    a, b = request_key(rids[0]), request_key(rids[1])
    for what in ("none", "aux", "tokens"):
        t = fp.read(clean)
        for table in ("target", "draft_extend", "verify"):
            first = next(e for e in t.of(table) if e.keys == [a])
            second = next(e for e in t.of(table) if e.keys == [b])
            t.events[t.events.index(first)] = fp.merge_steps(first, second)
            t.events.remove(second)
        if what != "none":
            table = "target" if what == "aux" else "draft_extend"
            step = next(e for e in t.of(table) if set(e.keys) == {a, b})
            (_, a0, a1), (_, b0, b1) = step.blocks()
            n = min(a1 - a0, b1 - b0)
            tok = step.axes["tok"]
            if what == "aux":
                tok["aux_hidden"][b0 : b0 + n] = tok["aux_hidden"][a0 : a0 + n]
                d = next(e for e in t.of("draft_extend") if set(e.keys) == {a, b})
                (_, da0, _), (_, db0, _) = d.blocks()
                hid = d.axes["tok"]["hidden_in"]
                hid[db0 : db0 + n] = hid[da0 : da0 + n]
            else:
                tok["input_ids"][b0 : b0 + n] = tok["input_ids"][a0 : a0 + n]
            fp.redraft(t, b, drafter)
        fp.write(t, out / f"batched-{what}.zarr")
        print(f"batched-{what}", "ok", file=sys.stderr)


def _rids(tr) -> list[str]:
    from hstrace.replay.read import read_serving

    return [r.rid for r in read_serving(tr).requests]


def replay_all(traces: Path) -> dict:
    from hstrace import replay_trace

    paths = sorted(EXAMPLES.glob("*.zarr")) + sorted(traces.glob("*.zarr"))
    paths += sorted(traces.glob("*.zip"))
    runs = [(f"{p.parent.name}/{p.name}", p, TRAINING) for p in paths]
    # a second trace as the training side (its requests stand in for samples)
    runs.append(("examples/clean.zarr@against-trace", EXAMPLES / "clean.zarr",
                 traces / "prefix-cache.zarr"))  # fmt: skip
    out = {}
    for key, p, against in runs:
        try:
            out[key] = replay_trace(p, against).to_json()
        except Exception as exc:  # noqa: BLE001 -- an error is a result to compare too
            out[key] = {"error": f"{type(exc).__name__}: {exc}"}
        print(key, out[key].get("verdict", {}).get("code", out[key].get("error")), file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", type=Path)
    ap.add_argument("--replay", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.record:
        record(a.record)
    if a.replay:
        import hstrace

        print("hstrace from", Path(hstrace.__file__).parent, file=sys.stderr)
        doc = replay_all(a.replay)
        text = json.dumps(doc, indent=1, sort_keys=True)
        if a.out:
            a.out.write_text(text)
        else:
            print(text)


if __name__ == "__main__":
    main()
