#!/usr/bin/env python3
"""Build hstrace's MTP world: `python traces/mtp-world/build.py [--out DIR]`.

Makes, deterministically (fixed seeds, `torch.use_deterministic_algorithms`, one CPU thread):
- `target/`: a dense MiMo-style target in vLLM's native MTP layout: a 4-layer Qwen2 model
  (head_dim 32 for vLLM's CPU attention) trained briefly on the tiny world's synthetic language
  (traces/tiny-world/language.py, another seed), saved in bf16 with
  `architectures: ["MiMoForCausalLM"]`, `model_type: "qwen2"` (transformers has no `mimo`
  type), `num_nextn_predict_layers: 1`, and one MTP layer under `model.mtp_layers.0.*`
  (`token_layernorm`, `hidden_layernorm`, `input_proj`, `final_layernorm` + a Qwen2 decoder
  block), plus the word-level tokenizer. vLLM 0.32 serves it with
  `--speculative-config '{"method": "mtp", "num_speculative_tokens": N}'` (`mimo_mtp`).
- The MTP layer is trained post hoc on the target's own outputs: for row t it is fed the
  target's last-layer state of token t BEFORE the final norm (what vLLM's `MiMoModel` hands
  the proposer), the embedding of token t+1 (zeroed at position 0, as vLLM does), and learns
  the target's greedy prediction at t+1 (the token the target would emit at t+2), with the
  target's embedding and lm_head frozen and shared. The math is `hstrace.drafter.mtp.MTPHead`.
- `training/`: the tensors the head was trained on, in hstrace's MTP dump format
  (`hstrace.training.mtp`: `mtp_training.json` + `samples/sample_{i}.safetensors` with
  input_ids, loss_mask and the bf16 hidden states it was fed); samples 40..47 are held out.
- `MANIFEST.json`: seeds, sizes, held-out accuracies with their conventions, file hashes.

Why MiMo and not the second world's DeepSeek-V3 shape (MLA + MoE): the reference head here
implements dense decoder blocks only, and the dense MiMo layout is the one measured to load and
draft on vLLM 0.32's CPU backends, while the second world's DeepSeek-V3 target is not run by
vLLM or SGLang on this CPU (traces/second-world/build.py says so; serving a DeepSeek-V3 MTP
target was not tried here). A DeepSeek-V3 MTP world is left for later.
Output is bit-identical between runs on the same torch version and CPU type.
Budget: well under 2 minutes on 2 CPU cores.
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
sys.path.insert(0, str(HERE.parent / "tiny-world"))
from world_kernels import cpu_kernels  # noqa: E402

SEED = 20261301
N_SAMPLES, N_HELDOUT, SEQ_LEN = 48, 8, 64
NUM_LAYERS = 4
TARGET_STEPS, TARGET_BATCH, TARGET_LEN = 200, 32, 64
MTP_STEPS, MTP_LR = 300, 3e-3
ARTIFACTS = ("target", "training")


def target_config():
    from language import BOS, EOS, PAD, VOCAB_SIZE
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2,  # head_dim 32: vLLM's CPU attention refuses 16
        num_key_value_heads=1,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        attn_implementation="sdpa",
    )


def train_target(lang, seed: int):
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(target_config()).float()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=6e-3, total_steps=TARGET_STEPS, pct_start=0.1
    )
    g = torch.Generator().manual_seed(seed + 1)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(TARGET_STEPS):
        ids, _ = lang.sample(TARGET_BATCH, TARGET_LEN, (4, 12), g)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return model.eval(), float(loss.detach())


def pre_norm_states(target, ids):
    """The last layer's residual stream before the final norm (vLLM MiMoModel's output) and the
    target's logits, fp32. ids [B, T] -> ([B, T, H], [B, T, V])."""
    import torch

    # HF's hidden_states[-1] is after the final norm: capture the norm's input instead
    seen = {}
    hook = target.model.norm.register_forward_hook(lambda m, a, o: seen.update(x=a[0]))
    with torch.no_grad():
        out = target(input_ids=ids)
    hook.remove()
    return seen["x"].float(), out.logits.float()


def mtp_examples(ids, hidden, labels):
    """Row t: (token t+1, hidden t) -> label t+1 (the target's prediction of token t+2).
    The last row has no token t+1 and is dropped."""
    return ids[:, 1:], hidden[:, :-1], labels[:, 1:]


def train_head(head, ids, hidden, labels, weight, seed: int):
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    params = [
        p for n, p in head.named_parameters() if not n.startswith(("embed_tokens", "lm_head"))
    ]
    opt = torch.optim.AdamW(params, lr=MTP_LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=MTP_LR, total_steps=MTP_STEPS, pct_start=0.1
    )
    g = torch.Generator().manual_seed(seed)
    acc = 0.0
    for _ in range(MTP_STEPS):
        b = torch.randint(0, ids.shape[0], (16,), generator=g)
        out = head(ids[b], hidden[b])
        w = weight[b]
        ce = F.cross_entropy(out.logits.flatten(0, 1), labels[b].flatten(), reduction="none")
        loss = (ce * w.flatten()).sum() / w.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        acc = float(((out.logits.argmax(-1) == labels[b]).float() * w).sum() / w.sum())
    return acc


def file_hashes(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for name in ARTIFACTS
        for p in sorted((out / name).rglob("*"))
        if p.is_file()
    }


def mtp_state_dict(head) -> dict:
    """The head's layer 0 under MiMo checkpoint keys (`model.mtp_layers.0.*`)."""
    from hstrace.drafter.mtp import MTP_KEYS

    role_to_key = {v: k for k, v in MTP_KEYS["mimo"].items()}
    out = {}
    for name, t in head.layers[0].state_dict().items():
        out[f"model.mtp_layers.0.{role_to_key.get(name, name)}"] = t
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args(argv)
    out: Path = args.out
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    import language
    import target as tiny_target
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2ForCausalLM

    from hstrace.drafter.mtp import MTPConfig, MTPHead
    from hstrace.training.mtp import FORMAT, META

    t0, c0 = time.time(), time.process_time()
    for name in ARTIFACTS:
        shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)

    lang = language.Language.make(SEED)
    model, target_loss = train_target(lang, SEED + 1)
    model.to(torch.bfloat16).save_pretrained(out / "target", safe_serialization=True)
    tiny_target.save_tokenizer(out / "target")
    target = Qwen2ForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()

    ids, mask = lang.sample(N_SAMPLES, SEQ_LEN, (8, 16), torch.Generator().manual_seed(SEED + 2))
    hidden, logits = pre_norm_states(target, ids)
    hidden_bf16 = hidden.to(torch.bfloat16)  # as dumped; the head trains on what is stored
    greedy = logits.argmax(-1)  # the target's own prediction at every position

    hf = json.loads((out / "target" / "config.json").read_text())
    hf["num_nextn_predict_layers"] = 1
    cfg = MTPConfig.mimo(hf)
    torch.manual_seed(SEED + 3)
    head = MTPHead(cfg).float()
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        head.lm_head.weight.copy_(target.lm_head.weight)
        block = target.model.layers[-1].state_dict()  # start the block from the last layer's
        head.layers[0].load_state_dict(block, strict=False)
    x_ids, x_hidden, y = mtp_examples(ids, hidden_bf16.float(), greedy)
    # rows whose label position t+2 is a response token (the loss mask shifted by two)
    weight = mask[:, 2:].float()
    weight = torch.cat([weight, weight.new_zeros(N_SAMPLES, 1)], 1)
    tr = slice(0, N_SAMPLES - N_HELDOUT)
    train_acc = train_head(head, x_ids[tr], x_hidden[tr], y[tr], weight[tr], SEED + 4)
    head.eval()

    # save the head into the target checkpoint, in bf16, and the config as vLLM reads it
    weights = load_file(out / "target" / "model.safetensors")
    weights.update({k: v.to(torch.bfloat16).contiguous() for k, v in mtp_state_dict(head).items()})
    save_file(weights, str(out / "target" / "model.safetensors"), metadata={"format": "pt"})
    hf["architectures"] = ["MiMoForCausalLM"]
    (out / "target" / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")

    # held-out accuracy of the head as saved (bf16 weights, run in fp32)
    from hstrace.drafter.mtp_checkpoint import load_mtp_head

    saved, _ = load_mtp_head(out / "target")
    held = slice(N_SAMPLES - N_HELDOUT, N_SAMPLES)
    with torch.no_grad():
        pred = saved(x_ids[held], x_hidden[held]).logits.argmax(-1)
        chain, _ = saved.draft_chain(x_ids[held], x_hidden[held], steps=2)
    w = weight[held].bool()
    acc0 = float((pred == y[held])[w].float().mean())
    # depth 1 of the serving chain predicts the target's token after the depth-0 label
    y1 = torch.cat([y[held][:, 1:], y.new_zeros(N_HELDOUT, 1)], 1)
    w1 = w & torch.cat([w[:, 1:], w.new_zeros(N_HELDOUT, 1)], 1)
    acc1 = float(((chain[..., 0] == y[held]) & (chain[..., 1] == y1))[w1].float().mean())

    tdir = out / "training" / "samples"
    tdir.mkdir(parents=True)
    for i in range(N_SAMPLES):
        save_file(
            {
                "input_ids": ids[i].contiguous(),
                "loss_mask": mask[i].to(torch.uint8).contiguous(),
                "hidden_states": hidden_bf16[i].contiguous(),
            },
            str(tdir / f"sample_{i:05d}.safetensors"),
        )
    meta = {
        "format": FORMAT,
        "version": 1,
        "hidden_source": cfg.hidden_source,
        "hidden_layer": NUM_LAYERS,
        "hidden_dtype": "bfloat16",
        "pairing": "hidden row t with the embedding of token t+1; label at row t: the target's "
        "greedy token at position t+1 (it predicts token t+2)",
        "concat_order": cfg.concat_order,
        "zero_embed_at_position0": cfg.zero_embed_at_position0,
        "family": cfg.family,
        "num_samples": N_SAMPLES,
        "heldout": f"samples {N_SAMPLES - N_HELDOUT}..{N_SAMPLES - 1}",
    }
    (out / "training" / META).write_text(json.dumps(meta, indent=2) + "\n")

    manifest = {
        "builder": "traces/mtp-world/build.py",
        "torch_version": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_kernels": cpu_kernels(),  # the finer features MKL / oneDNN pick kernels by
        "shape": "dense MiMo (MiMoForCausalLM: Qwen2 config + num_nextn_predict_layers 1, MTP "
        "layer under model.mtp_layers.0.*), served by vLLM 0.32 as mimo_mtp; not the "
        "DeepSeek-V3 MLA+MoE shape: the reference MTP head implements dense blocks only",
        "seeds": {
            "language": SEED,
            "target": SEED + 1,
            "samples": SEED + 2,
            "head_init": SEED + 3,
            "head_train": SEED + 4,
        },
        "sizes": {
            "vocab": language.VOCAB_SIZE,
            "target_layers": NUM_LAYERS,
            "hidden": 64,
            "num_nextn_predict_layers": 1,
            "samples": N_SAMPLES,
            "heldout_samples": N_HELDOUT,
            "seq_len": SEQ_LEN,
            "target_train_steps": TARGET_STEPS,
            "mtp_train_steps": MTP_STEPS,
        },
        "mtp": cfg.to_dict(),
        "target_final_train_loss": round(target_loss, 4),
        "mtp_final_train_acc": round(train_acc, 4),
        "heldout": {"acc0": acc0, "rows": int(w.sum()), "chain_acc_depth1": acc1},
        "conventions": {
            "acc0": "depth-0 argmax of the saved head (fp32 run of bf16 weights) on the stored "
            "bf16 hidden states vs the target's greedy token at t+1, rows whose token t+2 is "
            "a response token",
            "chain_acc_depth1": "serving chain (depth 1 fed depth 0's argmax and its normed "
            "output, layer 0, vLLM 0.32's way): both depths right, same rows (and t+3 a "
            "response token)",
        },
        "files": file_hashes(out),
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    wall, cpu = time.time() - t0, time.process_time() - c0
    print(
        f"MTP world built in {out}: wall {wall:.1f}s, cpu {cpu:.1f}s; held-out acc0={acc0:.3f} "
        f"chain depth1={acc1:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
