"""Training data dumped from HF forward passes of the saved target, in the three on-disk layouts
hstrace reads (training-formats.md §3.5, §4.3). Every format gets the same samples; each stores
the layers its own datagen captures by default for N = 8:

| dir                          | aux slots (HF hs index)      | last                         |
| training-speculators/        | 2, 4, 5  (ids 2,4,5 before)  | pre-norm final (id 8)        |
| training-speculators-legacy/ | 3, 5, 6  (ids 2,4,5 output)  | pre-norm final (id 7 output) |
| training-specforge/          | 2, 4, 5  (ids 1,3,4 output)  | post-norm final (HF hs[8])   |
"""

from __future__ import annotations

import gzip  # noqa: F401  (SpecForge --compress writes .ckpt.gz; the tiny world stores plain)
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

SPEC_IDS = [2, 4, 5, 8]  # vLLM convention, final slot N
LEGACY_IDS = [2, 4, 5, 7]  # output-of-layer convention, [2, N//2, N-3, N-1]
SPECFORGE_IDS = [1, 3, 4]  # output-of-layer convention, [1, N//2-1, N-4]


@torch.no_grad()
def capture(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF hidden states [N+1, T, H] (index N is post-norm) and the pre-norm final stream [T, H]."""
    pre: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_pre_hook(lambda _m, a: pre.append(a[0]))
    try:
        out = model(input_ids=ids[None], output_hidden_states=True)
    finally:
        hook.remove()
    return {
        "hs": torch.stack([h[0] for h in out.hidden_states]),
        "prenorm": pre[0][0],
        "logits": out.logits[0],
    }


def vocab_mapping(ids: torch.Tensor, mask: torch.Tensor, vocab: int, draft_vocab: int):
    """SpecForge/speculators rule: the top-Vd loss-masked tokens (padded with ids 0..), sorted."""
    counts = torch.bincount(ids[mask.bool()], minlength=vocab)
    used = [int(t) for t in torch.argsort(-counts, stable=True)[:draft_vocab] if counts[t] > 0]
    pad = (t for t in range(vocab) if t not in set(used))
    while len(used) < draft_vocab:
        used.append(next(pad))
    used_t = torch.tensor(sorted(used), dtype=torch.int64)
    d2t = used_t - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used_t] = True
    return d2t, t2d


def write_all(out: Path, model, ids: torch.Tensor, mask: torch.Tensor, d2t, t2d) -> None:
    caps = [capture(model, ids[i]) for i in range(ids.shape[0])]
    bf = torch.bfloat16
    write_speculators(out / "training-speculators", ids, mask, caps, d2t, t2d, bf)
    write_legacy(out / "training-speculators-legacy", ids, mask, caps, bf)
    write_specforge(out / "training-specforge", ids, mask, caps, d2t, t2d, bf)


def _spec_slot(c, layer_id: int) -> torch.Tensor:
    # before-layer id k = HF hs[k]; id N is the pre-norm final stream (HF hs[N] is post-norm)
    return c["prenorm"] if layer_id == c["hs"].shape[0] - 1 else c["hs"][layer_id]


def write_speculators(d: Path, ids, mask, caps, d2t, t2d, dt) -> None:
    (d / "hidden_states").mkdir(parents=True, exist_ok=True)
    for i, c in enumerate(caps):
        hs = torch.stack([_spec_slot(c, k) for k in SPEC_IDS], dim=1).to(dt).contiguous()
        save_file(
            {"token_ids": ids[i].clone(), "hidden_states": hs},
            str(d / "hidden_states" / f"hs_{i}.safetensors"),
        )
    write_hf_dataset(d, ids, mask)
    np.save(d / "d2t.npy", d2t.numpy())
    np.save(d / "t2d.npy", t2d.numpy())


def write_hf_dataset(d: Path, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """The layout `datasets.Dataset.save_to_disk` writes: one Arrow IPC stream + two json files."""
    import pyarrow as pa

    table = pa.table(
        {
            "input_ids": pa.array(ids.tolist(), type=pa.list_(pa.int64())),
            "loss_mask": pa.array(mask.tolist(), type=pa.list_(pa.int64())),
            "seq_len": pa.array([ids.shape[1]] * ids.shape[0], type=pa.int64()),
        }
    )
    name = "data-00000-of-00001.arrow"
    with pa.OSFile(str(d / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    features = {
        "input_ids": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
        "loss_mask": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
        "seq_len": {"dtype": "int64", "_type": "Value"},
    }
    (d / "dataset_info.json").write_text(
        json.dumps(
            {
                "citation": "",
                "description": "",
                "features": features,
                "homepage": "",
                "license": "",
            },
            indent=2,
            sort_keys=True,
        )
    )
    state = {
        "_data_files": [{"filename": name}],
        "_fingerprint": "hstrace-tiny-world",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": "torch",
        "_output_all_columns": False,
        "_split": None,
    }
    (d / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))


def write_legacy(d: Path, ids, mask, caps, dt) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for i, c in enumerate(caps):
        # output of 0-based layer k = HF hs[k+1]; output of the last layer = pre-norm final
        slots = [_spec_slot(c, k + 1).to(dt).clone() for k in LEGACY_IDS]
        torch.save(
            {"input_ids": ids[i].clone(), "hidden_states": slots, "loss_mask": mask[i].clone()},
            d / f"data_{i}.pt",
        )
    cfg = {"hidden_states": {"layer_ids": LEGACY_IDS}, "format": {"version": "v1"}}
    (d / "data_config.json").write_text(json.dumps(cfg, indent=2))


def write_specforge(d: Path, ids, mask, caps, d2t, t2d, dt) -> None:
    group = d / f"rows_0-{len(caps)}"
    group.mkdir(parents=True, exist_ok=True)
    for i, c in enumerate(caps):
        aux = torch.cat([c["hs"][k + 1] for k in SPECFORGE_IDS], dim=-1)
        torch.save(
            {
                "input_ids": ids[i].clone(),
                "loss_mask": mask[i].clone(),
                "aux_hidden_state": aux[None].to(dt).contiguous(),
                "hidden_state": c["hs"][-1][None].to(dt).contiguous(),  # HF hs[N]: post-norm
            },
            group / f"data_{i}.ckpt",
        )
    (d / "vocab_mapping").mkdir(exist_ok=True)
    torch.save({"d2t": d2t.clone(), "t2d": t2d.clone()}, d / "vocab_mapping" / "vocab_mapping.pt")
