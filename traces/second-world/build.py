#!/usr/bin/env python3
"""Build hstrace's second world with the real libraries' own code:
`~/.cache/hstrace/venv-second-world/bin/python traces/second-world/build.py [--out DIR]`.

A differently shaped world than traces/tiny-world/ (8-layer Llama, hidden 64, vocab 512):
- `target/`: HF `DeepseekV3ForCausalLM` (DeepSeek-V3 / Kimi-K2 architecture: MLA attention with
  q/kv LoRA, qk head dim 32+16 rope, v head dim 32; MoE with 4 routed + 1 shared expert, top-2,
  the first layer dense), 7 layers, hidden 96, vocab 320, trained briefly on a synthetic language;
  saved by `save_pretrained` in bf16, sharded (SpecForge's `TargetHead` needs the index file).
- `training-speculators/`: speculators v0.5+ layout. The rows go through speculators'
  `build_speculator_training_dataset` (its speculator-format pass-through) and HF
  `save_to_disk`; d2t/t2d from speculators' `save_token_frequency_distribution` +
  `build_vocab_mappings_from_distribution`; the layer ids from speculators'
  `resolve_target_layer_ids` ([2, N//2, N-3] + N); every `hs_{i}.safetensors` validated by
  speculators' `check_hidden_states` and read back through speculators' `ArrowDataset`.
- `training-speculators-embed/`: the same layout with the layer set of the seed incident
  ([embed, L3, L31, L59] stored for [2, 30, 58] served), here ids [0, 3, 4] + 7: slot 0 is the
  token embedding.
- `training-specforge/`: SpecForge's offline layout `rows_0-K/data_{i}.ckpt` (input_ids,
  loss_mask, hidden_state = post-norm final, aux_hidden_state at SpecForge's default ids
  [1, N//2-1, N-4] output-of-layer), each file read back with SpecForge's `load_feature_file`;
  d2t/t2d from SpecForge's `process_token_dict_to_mappings` (checked by its
  `validate_vocab_mapping_consistency`).
- `drafter-speculators/`: built by speculators' `Eagle3DraftModel.from_training_args` (the
  draft decoder config read by speculators' `load_draft_transformer_layer_config`; speculators
  0.9.0's eagle3 defaults norm_before_residual / norm_before_fc / norm_output = True), trained by
  its own forward + loss on batches from its `ArrowDataset`, `CollateFn` and `shift_batch`, saved
  by its `save_pretrained` (bf16).
- `drafter-specforge-eagle31/`: an EAGLE-3.1 drafter (trained by speculators' code with only
  `norm_output` = feed norm(h) back) in SpecForge's layout and `norm_output: true`, saved by
  SpecForge's `save_pretrained`: what a SpecForge export after SpecForge PR #879 looks like.
- `drafter-specforge/`: SpecForge's `LlamaForCausalLMEagle3` (`AutoDraftModel.from_config`)
  trained by its `OnlineEagle3Model` on the SpecForge-format data (teacher from SpecForge's
  `TargetHead`), saved by its `save_pretrained` without the embedding, exactly as its
  `export_to_sglang` filters it.

What is not the libraries' code, and why: the hidden states are captured from an HF forward of
the saved target (speculators gets them from vLLM's `extract_hidden_states`, SpecForge from an
SGLang server; neither runs a DeepSeek-V3 target on this CPU), the optimizer loops are a few
lines here (their trainers are distributed/GPU launchers), and SpecForge's loss is computed by its
own torch reference `_compute_loss` instead of its Triton kernel (CUDA only; named
`FakeCudaLogSoftmaxLoss`, as in tests/test_drafter_vs_specforge.py).

Deterministic: fixed seeds, one thread, `torch.use_deterministic_algorithms`; MANIFEST.json
records the hashes. Needs speculators 0.9.0, specforge 0.2.0 and `httpx` (speculators' data
pipeline imports it; `python3 -m venv --system-site-packages ~/.cache/hstrace/venv-second-world &&
~/.cache/hstrace/venv-second-world/bin/pip install httpx`). Budget: under 2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
import types
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent / "tiny-world"))  # after this world's own modules
from world_kernels import cpu_kernels  # noqa: E402

SEED = 20261201
VOCAB, DRAFT_VOCAB, N_LAYERS, HIDDEN = 320, 128, 7, 96
N_SAMPLES, N_HELDOUT, SEQ_LEN = 20, 4, 40
N_EMBED_SAMPLES = 4
TARGET_STEPS, TARGET_BATCH = 300, 16
SPEC_STEPS, SF_STEPS, DRAFT_LR = 240, 240, 3e-3
ARTIFACTS = (
    "target",
    "training-speculators",
    "training-speculators-embed",
    "training-specforge",
    "drafter-speculators",
    "drafter-specforge",
    "drafter-specforge-eagle31",
)
# The first ids are specials; the language uses N_WORDS of the rest.
N_SPECIAL, N_WORDS, N_GROUPS, P_RULE = 4, 40, 3, 0.9


# --- the language: prompt of random words (loss mask 0), then a second-order rule ----------


def language(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    words = (torch.randperm(VOCAB - N_SPECIAL, generator=g)[:N_WORDS] + N_SPECIAL).sort().values
    group = torch.zeros(VOCAB, dtype=torch.int64)
    group[words] = torch.randint(0, N_GROUPS, (N_WORDS,), generator=g)
    rule = torch.zeros(N_GROUPS, VOCAB, dtype=torch.int64)
    rule[:, words] = words[torch.randint(0, N_WORDS, (N_GROUPS, N_WORDS), generator=g)]
    return words, group, rule


def sample(lang, n: int, length: int, g):
    import torch

    words, group, rule = lang
    ids = torch.empty(n, length, dtype=torch.int64)
    mask = torch.zeros(n, length, dtype=torch.int64)
    ids[:, 0] = 2  # <s>
    ids[:, 1:] = words[torch.randint(0, N_WORDS, (n, length - 1), generator=g)]
    plen = torch.randint(6, 12, (n,), generator=g)
    follow = torch.rand(n, length, generator=g) < P_RULE
    for t in range(3, length):
        by_rule = rule[group[ids[:, t - 2]], ids[:, t - 1]]
        response = t > plen
        ids[:, t] = torch.where(response & follow[:, t], by_rule, ids[:, t])
        mask[:, t] = response.to(torch.int64)
    return ids, mask


# --- target -------------------------------------------------------------------------------


def target_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=192,
        moe_intermediate_size=48,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
    )


def train_target(lang, seed: int):
    import torch
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(target_config())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    loss = None
    for _ in range(TARGET_STEPS):
        ids, _ = sample(lang, TARGET_BATCH, SEQ_LEN, g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval(), float(loss)


# --- capture (an HF forward of the saved target stands in for vLLM/SGLang datagen) ----------


def capture(model, ids):
    """HF hidden_states [N+1, T, H] (index N post-norm) and the pre-norm final stream [T, H]."""
    import torch

    pre = []
    hook = model.model.norm.register_forward_pre_hook(lambda _m, a: pre.append(a[0]))
    try:
        with torch.no_grad():
            out = model(input_ids=ids[None], output_hidden_states=True)
    finally:
        hook.remove()
    return torch.stack([h[0] for h in out.hidden_states]), pre[0][0]


def before_layer(hs, prenorm, k: int):
    """vLLM/speculators id k: the stream entering layer k (HF hs[k]); id N: pre-norm final."""
    return prenorm if k == hs.shape[0] - 1 else hs[k]


# --- speculators --------------------------------------------------------------------------


def write_speculators(d: Path, ids, mask, caps, layer_ids: list[int]) -> dict:
    import numpy as np
    import torch
    from datasets import Dataset
    from safetensors.torch import load_file, save_file
    from speculators.data_generation.offline import check_hidden_states
    from speculators.data_generation.preprocessing import build_speculator_training_dataset
    from speculators.train.vocab_mapping import (
        build_vocab_mappings_from_distribution,
        save_token_frequency_distribution,
    )

    rows = Dataset.from_dict({"input_ids": ids.tolist(), "loss_mask": mask.tolist()})
    ds = build_speculator_training_dataset(rows, processor=None, max_length=SEQ_LEN, num_proc=1)
    ds.save_to_disk(str(d))
    (d / "hidden_states").mkdir(parents=True, exist_ok=True)
    for i, (hs, prenorm) in enumerate(caps):
        stacked = torch.stack([before_layer(hs, prenorm, k) for k in layer_ids], dim=1)
        f = d / "hidden_states" / f"hs_{i}.safetensors"
        save_file(
            {"token_ids": ids[i].clone(), "hidden_states": stacked.to(torch.bfloat16).contiguous()},
            str(f),
        )
        check_hidden_states(load_file(str(f)), ds[i]["input_ids"].tolist())
    freq = Path(tempfile.mkdtemp()) / "token_freq.pt"
    save_token_frequency_distribution(ds, freq)
    d2t, t2d = build_vocab_mappings_from_distribution(
        torch.load(freq, weights_only=True), DRAFT_VOCAB, VOCAB
    )
    np.save(d / "d2t.npy", d2t.numpy())
    np.save(d / "t2d.npy", t2d.numpy())
    return {"d2t": d2t, "t2d": t2d, "layer_ids": layer_ids}


DRAFT_LAYER = {  # the draft decoder, as a `--draft-config` file gives it to speculators
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": 192,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 48,
    "num_hidden_layers": 1,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


# speculators 0.9.0's eagle3 training defaults (train/config/schema.py): all three True
SPEC_DEFAULT_FLAGS = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}
# EAGLE-3.1 as a SpecForge export after PR #879 means it: only the fed-back state is normed
EAGLE31_FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "norm_output": True}


def train_speculators(
    out: Path, target_dir: Path, data: Path, vocab: dict, seed: int, flags: dict
) -> dict:
    import torch
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import load_draft_transformer_layer_config
    from speculators.train.data import ArrowDataset, CollateFn

    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(DRAFT_LAYER))
    layer_cfg = load_draft_transformer_layer_config(str(tmp / "config.json"), str(target_dir))
    torch.manual_seed(seed)
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer_cfg,
        t2d=vocab["t2d"],
        d2t=vocab["d2t"],
        # speculators writes this path into config.json: relative keeps the world portable
        verifier_name_or_path=os.path.relpath(target_dir),
        draft_vocab_size=DRAFT_VOCAB,
        **flags,
        ttt_steps=3,
        draft_attn_impl="eager",
    ).float()
    train = ArrowDataset(
        max_len=SEQ_LEN * 4,
        datapath=str(data),
        on_missing="raise",
        hidden_states_dtype=torch.float32,
    )
    collate = CollateFn(
        SEQ_LEN * 4, HIDDEN, num_target_layers=3, dtype=torch.float32, preprocess=shift_batch
    )
    n_train = N_SAMPLES - N_HELDOUT
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=DRAFT_LR)
    g = torch.Generator().manual_seed(seed)
    metrics = {}
    # speculators' default eagle3 loss (kl_div); its eager implementation (fused needs Triton)
    loss_config = resolve_loss_config("kl_div", "eager")
    for _ in range(SPEC_STEPS):
        pick = torch.randperm(n_train, generator=g)[:4].tolist()
        batch = collate([train[i] for i in pick])
        _, loss, metrics = model(
            hidden_states=batch["hidden_states"],
            input_ids=batch["input_ids"],
            document_ids=batch["document_ids"],
            loss_mask=batch["loss_mask"],
            position_ids=batch["position_ids"],
            verifier_last_hidden_states=batch["verifier_last_hidden_states"],
            ttt_steps=3,
            loss_config=loss_config,
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(out))
    # save_pretrained also copies speculators' own config.py (its auto_map class source); the
    # checkpoint is config.json + model.safetensors, and speculators' source is not ours to commit
    (out / "config.py").unlink(missing_ok=True)
    # speculators' own metrics of the last batch: full_acc_k = correct at steps 0..k
    return {
        k.removesuffix("_sum"): round(float(v) / max(float(metrics[k[:-4] + "_total"]), 1.0), 4)
        for k, v in metrics.items()
        if k.endswith("_sum") and "acc" in k
    }


# --- SpecForge ----------------------------------------------------------------------------


def _specforge_online():
    """SpecForge's OnlineEagle3Model; its loss module needs Triton only for the CUDA kernel:
    a stand-in `triton` exists while `specforge.core.loss` imports (FakeCudaTriton), and the
    loss is computed by SpecForge's torch `_compute_loss` (FakeCudaLogSoftmaxLoss)."""
    if "specforge.core.loss" not in sys.modules:
        triton = types.ModuleType("triton")
        lang = types.ModuleType("triton.language")
        triton.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
        triton.next_power_of_2 = lambda n: 1 << (int(n) - 1).bit_length()
        lang.constexpr = int
        triton.language = lang
        saved = {k: sys.modules.get(k) for k in ("triton", "triton.language")}
        sys.modules.update({"triton": triton, "triton.language": lang})
        try:
            importlib.import_module("specforge.core.loss")
        finally:
            for k, v in saved.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v
    mod = importlib.import_module("specforge.algorithms.eagle3.model")
    loss_mod = sys.modules["specforge.core.loss"]

    class FakeCudaLogSoftmaxLoss:
        @staticmethod
        def apply(logits, target_p, position_mask):
            return loss_mod._compute_loss(logits, target_p, position_mask)

    mod.LogSoftmaxLoss = FakeCudaLogSoftmaxLoss
    return mod


SPECFORGE_IDS = [1, N_LAYERS // 2 - 1, N_LAYERS - 4]  # output of layer k: HF hs[k + 1]


def write_specforge(d: Path, ids, mask, caps) -> dict:
    import torch
    from specforge.core.compact_teacher import validate_vocab_mapping_consistency
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.runtime.data_plane.feature_store import load_feature_file

    group = d / f"rows_0-{len(caps)}"
    group.mkdir(parents=True, exist_ok=True)
    for i, (hs, _prenorm) in enumerate(caps):
        aux = torch.cat([hs[k + 1] for k in SPECFORGE_IDS], dim=-1)
        f = group / f"data_{i}.ckpt"
        torch.save(
            {
                "input_ids": ids[i].clone(),
                "loss_mask": mask[i].clone(),
                "hidden_state": hs[-1][None].to(torch.bfloat16).clone(),  # HF hs[N]: post-norm
                "aux_hidden_state": aux[None].to(torch.bfloat16).clone(),
            },
            f,
        )
        back = load_feature_file(str(f))  # SpecForge's reader (our own file)
        assert torch.equal(back["input_ids"], ids[i])
    counts: Counter = Counter()
    for i in range(N_SAMPLES - N_HELDOUT):
        counts.update(ids[i][mask[i].bool()].tolist())
    d2t, t2d = process_token_dict_to_mappings(counts, DRAFT_VOCAB, VOCAB)
    validate_vocab_mapping_consistency(t2d, d2t)
    torch.save({"d2t": d2t, "t2d": t2d}, d / "vocab_mapping.pt")
    return {"d2t": d2t, "t2d": t2d}


def train_specforge(out: Path, target_dir: Path, data: Path, vocab: dict, seed: int) -> dict:
    import torch
    from specforge.modeling.auto import AutoDraftModel
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from transformers import LlamaConfig

    online_mod = _specforge_online()
    cfg = LlamaConfig(
        **{k: v for k, v in DRAFT_LAYER.items() if k != "model_type"},
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=DRAFT_VOCAB,
        target_hidden_size=HIDDEN,
        eagle_config={"eagle_aux_hidden_state_layer_ids": SPECFORGE_IDS},
    )
    torch.manual_seed(seed)
    draft = AutoDraftModel.from_config(cfg, attention_backend="sdpa").float()
    draft.load_embedding(str(target_dir))
    draft.freeze_embedding()
    with torch.no_grad():
        draft.d2t.copy_(vocab["d2t"])
        draft.t2d.copy_(vocab["t2d"])
    head = TargetHead.from_pretrained(str(target_dir)).float()
    files = sorted(data.glob("rows_*/data_*.ckpt"), key=lambda p: int(p.stem.split("_")[1]))
    feats = [load_feature_file(str(f)) for f in files[: N_SAMPLES - N_HELDOUT]]
    online = online_mod.OnlineEagle3Model(draft, length=3, attention_backend="sdpa")
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=DRAFT_LR)
    g = torch.Generator().manual_seed(seed)
    acces = []
    for _ in range(SF_STEPS):
        pick = torch.randperm(len(feats), generator=g)[:4].tolist()
        ids = torch.stack([feats[i]["input_ids"] for i in pick])
        mask = torch.stack([feats[i]["loss_mask"] for i in pick])
        hidden = torch.cat([feats[i]["hidden_state"] for i in pick]).float()
        aux = torch.cat([feats[i]["aux_hidden_state"] for i in pick]).float()
        with torch.no_grad():
            target = head(hidden)
        ids, target, mask = head.preprocess(ids, target, mask)
        with torch.compiler.set_stance("force_eager"):
            plosses, _, acces, *_ = online(
                input_ids=ids,
                attention_mask=torch.ones_like(ids, dtype=torch.bool),
                target=target,
                loss_mask=mask.float(),
                hidden_states=aux,
            )
        sum(plosses).backward()
        opt.step()
        opt.zero_grad()
    draft = draft.to(torch.bfloat16)
    state = {k: v for k, v in draft.state_dict().items() if "embed" not in k.lower()}
    draft.save_pretrained(str(out), state_dict=state)  # as export_to_sglang writes it
    return {"train_acc": [float(a) for a in acces]}


def export_eagle31_as_specforge(spec_dir: Path, out: Path) -> None:
    """What a SpecForge export after PR #879 looks like for an EAGLE-3.1 drafter: SpecForge's
    `LlamaForCausalLMEagle3` (its config: `norm_output: true`, `eagle_config` ids) holding the
    weights speculators' code trained feeding norm(h) back, saved by its `save_pretrained`
    without the embedding. SpecForge 0.2.0 itself reads `norm_output: true` the old way (norm
    before lm_head only); that ambiguity is what `hstrace check` has to resolve."""
    import torch
    from safetensors.torch import load_file
    from specforge.modeling.auto import AutoDraftModel
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        **{k: v for k, v in DRAFT_LAYER.items() if k != "model_type"},
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=DRAFT_VOCAB,
        target_hidden_size=HIDDEN,
        norm_output=True,
        eagle_config={"eagle_aux_hidden_state_layer_ids": SPECFORGE_IDS},
    )
    draft = AutoDraftModel.from_config(cfg, attention_backend="sdpa")
    sd = {
        k.replace("layers.0.", "midlayer.", 1): v
        for k, v in load_file(str(spec_dir / "model.safetensors")).items()
        if not k.startswith(("verifier_", "embed_tokens"))
    }
    missing, unexpected = draft.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) == {"embed_tokens.weight"}, (missing, unexpected)
    draft = draft.to(torch.bfloat16)
    state = {k: v for k, v in draft.state_dict().items() if "embed" not in k.lower()}
    draft.save_pretrained(str(out), state_dict=state)


def heldout_metrics(out: Path) -> dict:
    """Each drafter on the held-out samples, by hstrace (`hstrace check`'s evaluation: loaded by
    its dialect detection, teacher from the target's head, conventions as `hstrace check
    --json` states them)."""
    from hstrace.drafter import load_drafter
    from hstrace.evaluation import resolve_norm_output, training_findings
    from hstrace.metrics import TargetHead
    from hstrace.target_io import load_target_embedding
    from hstrace.training import open_training

    class Heldout:
        def __init__(self, td):
            self.td, self.format = td, td.format

        def __len__(self):
            return N_HELDOUT

        def __getitem__(self, i):
            return self.td[N_SAMPLES - N_HELDOUT + i]

    head = TargetHead.from_pretrained(out / "target")
    emb = load_target_embedding(out / "target")
    res = {}
    for name, data in (
        ("drafter-speculators", "training-speculators"),
        ("drafter-specforge", "training-specforge"),
        ("drafter-specforge-eagle31", "training-specforge"),
    ):
        model, report = load_drafter(out / name, target_embed=emb)
        td = Heldout(open_training(out / data))
        entry = {}
        if "norm_output" in report.config and report.dialect == "specforge":
            r = resolve_norm_output(model, open_training(out / data), True, head)
            entry["norm_output_reading"] = r["reading"]
            model.cfg.feed_normed = r["reading"] == "after-specforge-pr-879"
        _, info = training_findings(model, td, report.dialect, head=head, max_samples=N_HELDOUT)
        entry |= {
            "data": data,
            "acc0_target": round(info["acc0_target"]["value"], 4),
            "per_position_full": [round(v, 4) for v in info["per_position"]["full"]],
            "sim_accept_len_with_bonus": round(info["accept_len"]["value"], 4),
            "rows": info["rows"],
        }
        res[name] = entry
    return res


# --- build --------------------------------------------------------------------------------


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
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import DeepseekV3ForCausalLM

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    t0, c0 = time.time(), time.process_time()
    for name in ARTIFACTS:
        shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)

    lang = language(SEED)
    model, target_loss = train_target(lang, SEED + 1)
    model.to(torch.bfloat16).save_pretrained(out / "target", max_shard_size="1MB")
    target = DeepseekV3ForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()

    ids, mask = sample(lang, N_SAMPLES, SEQ_LEN, torch.Generator().manual_seed(SEED + 2))
    caps = [capture(target, ids[i]) for i in range(N_SAMPLES)]

    from speculators.models.utils import resolve_target_layer_ids

    spec_ids = resolve_target_layer_ids(None, str(out / "target")) + [N_LAYERS]
    spec_vocab = write_speculators(out / "training-speculators", ids, mask, caps, spec_ids)
    embed_ids = [0, 3, 4, N_LAYERS]  # the seed incident's layer set, scaled to 7 layers
    write_speculators(
        out / "training-speculators-embed",
        ids[:N_EMBED_SAMPLES],
        mask[:N_EMBED_SAMPLES],
        caps[:N_EMBED_SAMPLES],
        embed_ids,
    )
    sf_vocab = write_specforge(out / "training-specforge", ids, mask, caps)

    spec_metrics = train_speculators(
        out / "drafter-speculators",
        out / "target",
        out / "training-speculators",
        spec_vocab,
        SEED + 3,
        SPEC_DEFAULT_FLAGS,
    )
    tmp31 = Path(tempfile.mkdtemp()) / "eagle31-speculators"
    e31_metrics = train_speculators(
        tmp31, out / "target", out / "training-speculators", spec_vocab, SEED + 5, EAGLE31_FLAGS
    )
    export_eagle31_as_specforge(tmp31, out / "drafter-specforge-eagle31")
    sf_metrics = train_specforge(
        out / "drafter-specforge", out / "target", out / "training-specforge", sf_vocab, SEED + 4
    )
    manifest = {
        "builder": "traces/second-world/build.py",
        "torch_version": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_kernels": cpu_kernels(),  # the finer features MKL / oneDNN pick kernels by
        "libraries": {
            m: importlib.metadata.version(m) for m in ("speculators", "specforge", "transformers")
        },
        "seeds": {
            "drafter_eagle31": SEED + 5,
            "language": SEED,
            "target": SEED + 1,
            "samples": SEED + 2,
            "drafter_speculators": SEED + 3,
            "drafter_specforge": SEED + 4,
        },
        "sizes": {
            "target": "DeepseekV3ForCausalLM: MLA (q_lora 48, kv_lora 32, qk 32+16 rope, v 32), "
            "MoE 4 routed + 1 shared, top-2, layer 0 dense",
            "target_layers": N_LAYERS,
            "hidden": HIDDEN,
            "vocab": VOCAB,
            "draft_vocab": DRAFT_VOCAB,
            "draft_layer": DRAFT_LAYER,
            "samples": N_SAMPLES,
            "heldout": f"samples {N_SAMPLES - N_HELDOUT}..{N_SAMPLES - 1}",
            "seq_len": SEQ_LEN,
        },
        "target_final_train_loss": round(target_loss, 4),
        "layers": {
            "training-speculators": f"ids {spec_ids} (before layer k; the last = pre-norm final)",
            "training-speculators-embed": f"ids {embed_ids}: slot 0 is the token embedding",
            "training-specforge": f"ids {SPECFORGE_IDS} (output of layer k = HF hs[k+1]); "
            "hidden_state = HF hs[N] (post-norm)",
            "physical_hf_indices": [k + 1 for k in SPECFORGE_IDS],
        },
        "drafter-speculators": {"final_train_metrics": spec_metrics},
        "drafter-specforge": {"final_train_acc": sf_metrics["train_acc"]},
        "drafter-specforge-eagle31": {
            "trained_by": "speculators (norm_output=True only: EAGLE-3.1, feeds norm(h) back)",
            "saved_by": "SpecForge LlamaForCausalLMEagle3.save_pretrained, norm_output: true",
            "final_train_metrics": e31_metrics,
        },
        "heldout": heldout_metrics(out),
        "heldout_conventions": "hstrace check's: acc0_target = draft argmax mapped by d2t vs the "
        "target's full-vocab argmax at t+1 (teacher rebuilt from the stored final state), rows "
        "with loss_mask[t+1]; per_position_full = teacher-forced, correct at steps 0..k; "
        "sim_accept_len = 1 + sum(full), bonus counted; samples 16..19",
        "build_seconds": {
            "wall": round(time.time() - t0, 1),
            "cpu": round(time.process_time() - c0, 1),
        },
        "files": file_hashes(out),
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps({k: manifest[k] for k in ("target_final_train_loss", "build_seconds")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
