#!/usr/bin/env python3
"""Build hstrace's tiny world: `python traces/tiny-world/build.py [--out DIR]`.

Makes, deterministically (fixed seeds, `torch.use_deterministic_algorithms`, one CPU thread):
- `target/`: an 8-layer HF Llama trained briefly on a synthetic language (language.py), saved
  with `save_pretrained` in bf16 plus a word-level tokenizer;
- `training-speculators/`, `training-speculators-legacy/`, `training-specforge/`: the same
  samples dumped from HF forward passes of the *saved* target in each library's layout (dumps.py);
- `drafter-speculators/`, `drafter-specforge/`: one EAGLE-3 drafter trained on the dumped tensors
  (drafter.py) and saved by `hstrace.drafter.save_drafter` in each dialect, with the default aux
  layers (HF hs[2], hs[4], hs[5]) written in each dialect's convention ([2,4,5] / [1,3,4]);
- `MANIFEST.json`: seeds, sizes, held-out accuracies with their conventions, file hashes.

Output is bit-identical between runs on the same torch version and CPU type (kernels may pick
other code paths on other CPUs or torch versions; the hashes in MANIFEST.json say which).
Budget: under 2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from world_kernels import cpu_kernels  # noqa: E402

SEED = 20260801
N_SAMPLES, N_HELDOUT, SEQ_LEN = 48, 8, 64
DRAFT_VOCAB = 256
TARGET_STEPS, TARGET_BATCH, TARGET_LEN = 200, 32, 64
DRAFTER_STEPS, DRAFTER_LR = 300, 3e-3
ARTIFACTS = (
    "target",
    "training-speculators",
    "training-speculators-legacy",
    "training-specforge",
    "drafter-speculators",
    "drafter-specforge",
)


def file_hashes(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for name in ARTIFACTS
        for p in sorted((out / name).rglob("*"))
        if p.is_file()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args(argv)
    out: Path = args.out
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.set_num_threads(1)  # reduction order, hence the bits, depends on the thread count
    torch.use_deterministic_algorithms(True)

    import drafter as drafter_mod
    import dumps
    import language
    import target as target_mod
    from transformers import LlamaForCausalLM

    from hstrace.drafter import Eagle3Drafter, save_drafter
    from hstrace.metrics import TargetHead
    from hstrace.training import open_training

    t0, c0 = time.time(), time.process_time()
    for name in ARTIFACTS:
        shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)

    lang = language.Language.make(SEED)
    model, target_loss = target_mod.train_target(
        lang, SEED + 1, TARGET_STEPS, TARGET_BATCH, TARGET_LEN
    )
    target_mod.save_target(model, out / "target")
    # Everything downstream uses the target as saved (bf16 weights, run in fp32), so anyone who
    # loads target/ reproduces the dumps exactly.
    target = LlamaForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()

    ids, mask = lang.sample(N_SAMPLES, SEQ_LEN, (8, 16), torch.Generator().manual_seed(SEED + 2))
    train_ids = slice(0, N_SAMPLES - N_HELDOUT)
    d2t, t2d = dumps.vocab_mapping(
        ids[train_ids], mask[train_ids], language.VOCAB_SIZE, DRAFT_VOCAB
    )
    dumps.write_all(out, target, ids, mask, d2t, t2d)

    td = open_training(out / "training-speculators")
    samples = list(td.samples())
    head = TargetHead.from_pretrained(out / "target")
    torch.manual_seed(SEED + 3)
    cfg = drafter_mod.drafter_config(target.config, DRAFT_VOCAB)
    dm = Eagle3Drafter(cfg).float()
    with torch.no_grad():
        dm.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        dm.d2t.copy_(d2t)
        dm.t2d.copy_(t2d)
    fit = drafter_mod.train(dm, samples[train_ids], head, t2d, DRAFTER_STEPS, SEED + 4, DRAFTER_LR)
    dm.eval()
    held = samples[N_SAMPLES - N_HELDOUT :]
    with torch.no_grad():
        tl = [target(input_ids=s.input_ids[None]).logits[0] for s in held]
    metrics = drafter_mod.evaluate(dm, held, head, t2d, tl)

    save_drafter(
        drafter_mod.with_layer_ids(dm, [2, 4, 5]),
        out / "drafter-speculators",
        dialect="speculators",
        dtype=torch.bfloat16,
    )
    save_drafter(
        drafter_mod.with_layer_ids(dm, [1, 3, 4]),
        out / "drafter-specforge",
        dialect="specforge",
        dtype=torch.bfloat16,
    )

    manifest = {
        "builder": "traces/tiny-world/build.py",
        "torch_version": torch.__version__,
        # kernels (hence the bits) differ between AVX2 and AVX-512 machines: a rebuild is
        # bit-identical only where this matches (tests/test_tiny_world.py compares otherwise)
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_kernels": cpu_kernels(),  # the finer features MKL / oneDNN pick kernels by
        "seeds": {
            "language": SEED,
            "target": SEED + 1,
            "samples": SEED + 2,
            "drafter_init": SEED + 3,
            "drafter_train": SEED + 4,
        },
        "sizes": {
            "vocab": language.VOCAB_SIZE,
            "draft_vocab": DRAFT_VOCAB,
            "words_used": language.N_WORDS,
            "target_layers": target_mod.NUM_LAYERS,
            "hidden": target.config.hidden_size,
            "samples": N_SAMPLES,
            "heldout_samples": N_HELDOUT,
            "seq_len": SEQ_LEN,
            "heldout": f"samples {N_SAMPLES - N_HELDOUT}..{N_SAMPLES - 1} of every training dir",
            "target_train_steps": TARGET_STEPS,
            "drafter_train_steps": DRAFTER_STEPS,
        },
        "target_final_train_loss": round(target_loss, 4),
        "drafter_final_train_full_acc": [round(a, 4) for a in fit.full_acc],
        "heldout": {
            "acc0_teacher": metrics["acc0_teacher"],
            "acc0_target": metrics["acc0_target"],
            "rows": metrics["rows"],
            "per_position_full": metrics["per_position_full"],
            "per_position_uncond": metrics["per_position_uncond"],
            "sim_accept_len_with_bonus": metrics["sim_accept_len_with_bonus"],
        },
        "conventions": {
            "acc0_teacher": "draft-space argmax vs argmax of the library teacher "
            "lm_head(norm(last))[t2d] at t+1, rows with loss_mask[t+1] (speculators full_acc_0); "
            "drafter run in fp32 on the stored bf16 aux of training-speculators/",
            "acc0_target": "draft ids mapped by d2t vs the real target's full-vocab argmax at t+1 "
            "(HF forward of target/ in fp32), same rows",
            "per_position_full": "teacher-forced, target space, row correct at all steps 0..k "
            "over step-0 rows (speculators full_acc_k)",
            "per_position_uncond": "teacher-forced, target space, step k alone (SpecForge acc_k)",
            "sim_accept_len_with_bonus": "1 + sum_k per_position_full[k], K=3, bonus counted "
            "(SGLang accept_len convention)",
        },
        "aux_layers": {
            "physical_hf_indices": [2, 4, 5],
            "drafter-speculators": "eagle_aux_hidden_state_layer_ids [2, 4, 5] (before layer k)",
            "drafter-specforge": "eagle_config.eagle_aux_hidden_state_layer_ids [1, 3, 4] "
            "(output of layer k; SGLang adds 1)",
        },
        "files": file_hashes(out),
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    wall, cpu = time.time() - t0, time.process_time() - c0
    print(
        f"tiny world built in {out}: wall {wall:.1f}s, cpu {cpu:.1f}s; held-out "
        f"acc0_teacher={metrics['acc0_teacher']:.3f} acc0_target={metrics['acc0_target']:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
