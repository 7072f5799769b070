"""A third-party trace producer, written the way someone adding an engine would write one: with
only the public writer (`hstrace.trace.create_trace`, `TraceWriter`) and docs/trace-format.md;
no part of hstrace's reference engine.

It "serves" the second world on CPU: the DeepSeek-V3 target (HF `DeepseekV3ForCausalLM`, in the
dtype given, bf16 by default as engines run it: MoE routing then runs in bf16 too) captures the
aux states at the HF `hidden_states` indices given, and the drafter is **speculators' own**
`Eagle3DraftModel` (built from the checkpoint's config.json, weights loaded as stored) whose
step-0 logits over the prompt rows are the draft the engine would extend. Per request it writes
`requests`, one `target` prefill step (mode 0) with `aux_hidden` exactly as the drafter got it,
and one `draft_extend` step (top-k of the draft logits). Prefill only: no decode rounds, so the
trace has no `verify` or `draft_step` table (a legal trace; replay says what it could not check).

Faults are injected here, in the producer, never in hstrace: `layers` other than the ones the
drafter was trained on is an engine that captured the wrong layers; `d2t_as_table=True` is an
engine that reads the checkpoint's d2t offsets as a direct draft -> target table.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TOPK = 8


def speculators_drafter(drafter_dir: Path):
    """speculators' `Eagle3DraftModel` from a speculators checkpoint dir (eager attention)."""
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    raw = json.loads((drafter_dir / "config.json").read_text())
    raw.pop("dtype", None)
    raw.pop("torch_dtype", None)
    raw.pop("auto_map", None)
    config = Eagle3SpeculatorConfig(**raw)
    config.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel(config)
    missing, unexpected = model.load_state_dict(
        load_file(str(drafter_dir / "model.safetensors")), strict=False
    )
    if unexpected or set(missing) - {"verifier_norm.weight", "verifier_lm_head.weight"}:
        raise RuntimeError(f"speculators drafter: missing {missing}, unexpected {unexpected}")
    return model.float().eval()


@torch.no_grad()
def _capture(target, ids: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """HF hidden_states at `layers` (index N = the pre-norm final stream, as vLLM's id N),
    concatenated in layer order: [T, K*H]."""
    pre: list[torch.Tensor] = []
    hook = target.model.norm.register_forward_pre_hook(lambda _m, a: pre.append(a[0]))
    try:
        out = target(input_ids=ids[None], output_hidden_states=True)
    finally:
        hook.remove()
    n = len(out.hidden_states) - 1
    slots = [pre[0][0] if k == n else out.hidden_states[k][0] for k in sorted(layers)]
    return torch.cat(slots, dim=-1)


@torch.no_grad()
def _draft_logits(drafter, ids: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """Step-0 draft logits [T, Vd] for aux row t with token t+1 (the last row gets the token the
    target predicts, unknown here: it is dropped)."""
    captured: list[torch.Tensor] = []
    hook = drafter.lm_head.register_forward_hook(lambda _m, _i, o: captured.append(o))
    T = ids.shape[0] - 1
    try:
        drafter(
            hidden_states=aux[None, :T].float(),
            input_ids=ids[None, 1:],
            document_ids=torch.zeros(1, T, dtype=torch.long),
            ttt_steps=1,
        )
    finally:
        hook.remove()
    return captured[0][0].float()


def record(
    out: Path,
    target_dir: Path,
    drafter_dir: Path,
    prompts: list[list[int]],
    layers: list[int],
    dtype: torch.dtype = torch.bfloat16,
    engine: str = "third-party-cpu",
    d2t_as_table: bool = False,
) -> Path:
    from transformers import DeepseekV3ForCausalLM

    from hstrace.trace import TraceWriter, create_trace, request_key

    target = DeepseekV3ForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    drafter = speculators_drafter(drafter_dir)
    d2t = drafter.d2t.clone()
    draft_config = json.loads((drafter_dir / "config.json").read_text())
    static = {
        "engine_version": "0.1",
        "target": {
            "path": str(target_dir),
            "num_layers": target.config.num_hidden_layers,
            "hidden_size": target.config.hidden_size,
            "vocab_size": target.config.vocab_size,
            "dtype": str(dtype).removeprefix("torch."),
        },
        "drafter": {"path": str(drafter_dir), "dialect": "speculators"},
        "draft_config": draft_config,
        "aux_layer_ids": draft_config.get("eagle_aux_hidden_state_layer_ids"),
        "capture": {
            "layers_to_capture": sorted(layers),
            "capture_order": sorted(layers),
            "num_captures": len(layers),
            "convention": "hf_hidden_states_index",
        },
        "spec": {"num_steps": 1, "topk": 1, "num_draft_tokens": 2},
    }
    create_trace(
        out, engine={"name": engine, "version": "0.1"}, command_line=["producer.py"], static=static
    )
    H = target.config.hidden_size
    with TraceWriter(out, rank=0, process=False) as w:
        for i, prompt in enumerate(prompts):
            rid = f"third-party-{i}"
            key = request_key(rid)
            ids = torch.tensor(prompt, dtype=torch.long)
            rid_bytes = torch.tensor(list(rid.encode()), dtype=torch.uint8)
            w.write(
                "requests",
                req={"req_key": [key], "n_prompt": [len(prompt)], "rid_len": [len(rid_bytes)]},
                tok={"prompt_ids": ids},
                rid={"bytes": rid_bytes},
            )
            aux = _capture(target, ids, layers).to(torch.bfloat16)
            pos = torch.arange(len(prompt))
            w.write(
                "target",
                step={"mode": 0},
                req={"req_key": [key], "n_tok": [len(prompt)]},
                tok={"input_ids": ids, "positions": pos, "aux_hidden": aux},
                column_attrs={
                    "tok/aux_hidden": {
                        "layer_ids": sorted(layers),
                        "layer_id_convention": "hf_hidden_states_index",
                        "slot_width": H,
                    }
                },
            )
            logits = _draft_logits(drafter, ids, aux)
            T = logits.shape[0]
            top = logits.topk(TOPK, dim=-1)
            lse = torch.logsumexp(logits, dim=-1)
            w.write(
                "draft_extend",
                req={"req_key": [key], "n_tok": [T]},
                tok={
                    "input_ids": ids[1 : T + 1],
                    "positions": pos[:T],
                    "hidden_in": aux[:T],
                    "topk_draft_ids": top.indices,
                    "topk_target_ids": (
                        d2t[top.indices] if d2t_as_table else top.indices + d2t[top.indices]
                    ),
                    "topk_logprobs": top.values - lse[:, None],
                    "lse": lse,
                },
            )
    return out
