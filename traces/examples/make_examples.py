"""Build the bundled example traces from the tiny world with the reference engine.

    python traces/examples/make_examples.py

Each example is a real trace (Zarr v3) recorded by `hstrace record --engine reference` on the
tiny world's held-out samples, with one engine fault knob set; paths in its static audit are
relative to the repository root, so `hstrace replay` finds the drafter and the target from
any checkout. Deterministic: fixed prompts, greedy decoding.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hstrace.engines import EngineConfig, Prompt, RecordOptions, get_engine
from hstrace.training import open_training

ROOT = Path(__file__).resolve().parents[2]
WORLD = Path("traces/tiny-world")
EXAMPLES = {
    # SGLang reads explicit aux ids as "output of layer k" (+1); the speculators drafter wrote
    # them as "before layer k": every captured layer is one too deep.
    "aux-layer-shift.zarr": {"capture_convention": "output_of_layer"},
    # A correctly wired engine: replay must find nothing to rewire.
    "clean.zarr": {},
}


def main() -> None:
    os.chdir(ROOT)
    td = open_training(WORLD / "training-speculators")
    prompts = [
        Prompt(input_ids=tuple(td[i].input_ids[:24].tolist()), source_id=f"heldout:{i}")
        for i in range(40, 48)
    ]
    for name, knobs in EXAMPLES.items():
        out = Path("traces/examples") / name
        shutil.rmtree(out, ignore_errors=True)
        engine = get_engine(
            "reference",
            EngineConfig(
                target=WORLD / "target", drafter=WORLD / "drafter-speculators", extra=knobs
            ),
        )
        engine.check_supported()
        result = engine.record(prompts, out, RecordOptions(max_new_tokens=16, show_progress=False))
        print(f"{out}: {result.prompts_completed} requests, ok={result.ok}")


if __name__ == "__main__":
    main()
