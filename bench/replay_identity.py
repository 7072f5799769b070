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


def replay_all(traces: Path) -> dict:
    from hstrace.pipelines import replay

    paths = sorted(EXAMPLES.glob("*.zarr")) + sorted(traces.glob("*.zarr"))
    paths += sorted(traces.glob("*.zip"))
    out = {}
    for p in paths:
        key = f"{p.parent.name}/{p.name}"
        try:
            out[key] = replay(p, TRAINING).to_json()
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
