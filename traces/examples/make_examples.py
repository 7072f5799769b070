"""Build the bundled example traces from the tiny world with the reference engine.

    python traces/examples/make_examples.py [NAME.zarr ...]   # all of them by default

Each example is a real trace (Zarr v3) recorded by `hstrace record --engine reference` on the
tiny world's held-out samples, with one engine fault knob set or one edited checkpoint served;
paths in its static audit are relative to the repository root, so `hstrace replay` finds the
drafter and the target from any checkout. Deterministic: fixed prompts, greedy decoding.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from hstrace.engines import EngineConfig, Prompt, RecordOptions, get_engine
from hstrace.training import open_training

ROOT = Path(__file__).resolve().parents[2]
WORLD = Path("traces/tiny-world")
DRAFTER = WORLD / "drafter-speculators"
# The README demo's checkpoint, as a parameters-only export saves it: the buffers d2t / t2d
# are not in model.safetensors. An engine loading it keeps a zero vocab map (vLLM 0.32's
# Eagle3LlamaForCausalLM.load_weights leaves draft_id_to_target_id at zeros): draft id i is
# proposed as target id i, and the target rejects nearly every draft.
NO_D2T = Path("traces/examples/drafter-no-d2t")
EXAMPLES: dict[str, tuple[Path, dict]] = {
    # The fault the README points to: fixing it is worth more than one accepted token a step.
    "vocab-map-missing.zarr": (NO_D2T, {}),
    # SGLang reads explicit aux ids as "output of layer k" (+1); the speculators drafter wrote
    # them as "before layer k": every captured layer is one too deep. Caught, but on the tiny
    # world neighbouring layers are nearly alike: it costs nothing measurable (low priority).
    "aux-layer-shift.zarr": (DRAFTER, {"capture_convention": "output_of_layer"}),
    # A correctly wired engine: replay must find nothing to rewire.
    "clean.zarr": (DRAFTER, {}),
}


def export_without_vocab_map(src: Path, out: Path) -> None:
    """`src` copied with d2t / t2d left out of its weights (config.json unchanged)."""
    from safetensors.torch import load_file, save_file

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.copy(src / "config.json", out / "config.json")
    weights = load_file(src / "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if k not in ("d2t", "t2d")},
        out / "model.safetensors",
        metadata={"format": "pt"},
    )


def main(names: list[str]) -> None:
    unknown = sorted(set(names) - set(EXAMPLES))
    if unknown:
        raise SystemExit(f"make_examples: unknown example(s) {unknown} (have {list(EXAMPLES)})")
    os.chdir(ROOT)
    export_without_vocab_map(DRAFTER, NO_D2T)
    td = open_training(WORLD / "training-speculators")
    prompts = [
        Prompt(input_ids=tuple(td[i].input_ids[:24].tolist()), source_id=f"heldout:{i}")
        for i in range(40, 48)
    ]
    for name, (drafter, knobs) in EXAMPLES.items():
        if names and name not in names:
            continue
        out = Path("traces/examples") / name
        shutil.rmtree(out, ignore_errors=True)
        engine = get_engine(
            "reference",
            EngineConfig(target=WORLD / "target", drafter=drafter, extra=knobs),
        )
        engine.check_supported()
        result = engine.record(prompts, out, RecordOptions(max_new_tokens=16, show_progress=False))
        print(f"{out}: {result.prompts_completed} requests, ok={result.ok}")


if __name__ == "__main__":
    main(sys.argv[1:])
