"""A third-party trace producer, written the way someone adding an engine would write one: with
only the public writer (`hstrace.trace.create_trace`, `TraceWriter`) and docs/trace-format.md;
no part of hstrace's reference engine.

It "serves" the second world on CPU: the DeepSeek-V3 target (HF `DeepseekV3ForCausalLM`, in the
dtype given, bf16 by default as engines run it: MoE routing then runs in bf16 too) captures the
aux states at the HF `hidden_states` indices given, and the drafter is **speculators' own**
`Eagle3DraftModel` (built from the checkpoint's config.json, weights loaded as stored) whose
step-0 logits over the prompt rows are the draft the engine would extend. Per request it writes
`requests`, one `target` prefill step (mode 0) with `aux_hidden` exactly as the drafter got it,
and one `draft_extend` step (top-k of the draft logits); with `max_new` > 0 also greedy decode
rounds (topk 1): the chain run by speculators' own forward (`draft_step` rows), the target's
verify rows and the `verify` outcome. With `max_new` = 0 the trace has no `verify` or
`draft_step` table (a legal trace; replay says what it could not check).

Faults are injected here, in the producer, never in hstrace: `layers` other than the ones the
drafter was trained on is an engine that captured the wrong layers; `d2t_as_table=True` is an
engine that reads the checkpoint's d2t offsets as a direct draft -> target table;
`drop_norm_output=True` is an engine that ignores the drafter's `norm_output` (feeds h back, not
norm(h); speculators' model run with the flag off, which only changes steps >= 1).
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


@torch.no_grad()
def _chain(drafter, seq: torch.Tensor, aux: torch.Tensor, steps: int, to_target):
    """The greedy chain from the last committed aux row, run by speculators' own forward.
    Its TTT steps feed the *stored* next tokens; a chain needs the drafts instead, so the
    sequence gets the drafts appended as its tail (with zero aux rows, which the last real row
    never attends to: step 0 is causal, steps >= 1 see only their own row) and the forward is
    rerun with one more step per draft. Returns the step-0 logits over every committed row
    [P, Vd], the drafts [K] (draft vocab), their logits [K, Vd] and the state fed into each step
    k >= 1 at the chain's row [K-1, H] (captured where speculators computes it: the output of
    `norm` when `norm_output`, else of the last decoder layer)."""
    P = aux.shape[0]
    drafts: list[int] = []
    logits_k: list[torch.Tensor] = []
    fed: list[torch.Tensor] = []
    step0 = None
    for k in range(steps):
        tail = torch.tensor([int(t) for t in to_target(torch.tensor(drafts, dtype=torch.long))])
        ids = torch.cat([seq[1 : P + 1], tail.long()])
        hidden = torch.cat([aux.float(), aux.new_zeros(len(drafts), aux.shape[1]).float()])
        lm: list[torch.Tensor] = []
        state: list[torch.Tensor] = []
        h1 = drafter.lm_head.register_forward_hook(lambda _m, _i, o, lm=lm: lm.append(o[0]))
        src = drafter.norm if drafter.config.norm_output else drafter.layers[-1]
        h2 = src.register_forward_hook(
            lambda _m, _i, o, st=state: st.append((o[0] if isinstance(o, tuple) else o)[0])
        )
        try:
            drafter(
                hidden_states=hidden[None],
                input_ids=ids[None],
                document_ids=torch.zeros(1, ids.shape[0], dtype=torch.long),
                ttt_steps=k + 1,
            )
        finally:
            h1.remove()
            h2.remove()
        if step0 is None:
            step0 = lm[0][:P].float()
        logits_k.append(lm[k][P - 1].float())
        drafts.append(int(lm[k][P - 1].argmax()))
        if k:
            fed.append(state[k - 1][P - 1].float())
    H = drafter.config.transformer_layer_config.hidden_size
    fed_in = torch.stack(fed) if fed else torch.empty(0, H)
    return step0, torch.tensor(drafts), torch.stack(logits_k), fed_in


def _topk(logits: torch.Tensor, to_target) -> dict[str, torch.Tensor]:
    top = logits.topk(TOPK, dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    return {
        "topk_draft_ids": top.indices,
        "topk_target_ids": to_target(top.indices),
        "topk_logprobs": top.values - lse[:, None],
        "lse": lse,
    }


def record(
    out: Path,
    target_dir: Path,
    drafter_dir: Path,
    prompts: list[list[int]],
    layers: list[int],
    dtype: torch.dtype = torch.bfloat16,
    engine: str = "third-party-cpu",
    d2t_as_table: bool = False,
    max_new: int = 0,
    steps: int = 3,
    drop_norm_output: bool = False,
) -> Path:
    """`max_new` = 0: prefill only (requests, target, draft_extend). Otherwise greedy EAGLE-3
    decode rounds of `steps` drafts (topk 1) until `max_new` tokens: each round a draft_extend
    over the newly committed rows, the chain's draft_step rows (k >= 1), the target's verify
    rows (mode 1: the last committed token and the drafts) and the verify outcome."""
    from transformers import DeepseekV3ForCausalLM

    from hstrace.trace import TraceWriter, create_trace, request_key

    target = DeepseekV3ForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    drafter = speculators_drafter(drafter_dir)
    if drop_norm_output:  # an engine without norm_output plumbing feeds the pre-norm state back
        drafter.config.norm_output = False
    d2t = drafter.d2t.clone()

    def to_target(draft_ids: torch.Tensor) -> torch.Tensor:
        return d2t[draft_ids] if d2t_as_table else draft_ids + d2t[draft_ids]

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
        "spec": {"num_steps": steps, "topk": 1, "num_draft_tokens": steps + 1},
    }
    create_trace(
        out, engine={"name": engine, "version": "0.1"}, command_line=["producer.py"], static=static
    )
    H = target.config.hidden_size
    attrs = {
        "tok/aux_hidden": {
            "layer_ids": sorted(layers),
            "layer_id_convention": "hf_hidden_states_index",
            "slot_width": H,
        }
    }

    def write_target(w, key: int, mode: int, ids, rows, aux) -> None:
        w.write(
            "target",
            step={"mode": mode},
            req={"req_key": [key], "n_tok": [len(rows)]},
            tok={"input_ids": ids[rows], "positions": rows, "aux_hidden": aux[rows]},
            column_attrs=attrs,
        )

    def write_extend(w, key: int, seq, aux, step0, start: int) -> None:
        rows = torch.arange(start, aux.shape[0])
        w.write(
            "draft_extend",
            req={"req_key": [key], "n_tok": [len(rows)]},
            tok={
                "input_ids": seq[rows + 1],
                "positions": rows,
                "hidden_in": aux[rows],
                **_topk(step0[rows], to_target),
            },
        )

    with TraceWriter(out, rank=0, process=False) as w:
        for i, prompt in enumerate(prompts):
            rid = f"third-party-{i}"
            key = request_key(rid)
            seq = torch.tensor(prompt, dtype=torch.long)
            rid_bytes = torch.tensor(list(rid.encode()), dtype=torch.uint8)
            w.write(
                "requests",
                req={"req_key": [key], "n_prompt": [len(prompt)], "rid_len": [len(rid_bytes)]},
                tok={"prompt_ids": seq},
                rid={"bytes": rid_bytes},
            )
            aux = _capture(target, seq, layers).to(torch.bfloat16)
            write_target(w, key, 0, seq, torch.arange(len(prompt)), aux)
            if not max_new:
                T = len(prompt) - 1
                write_extend(w, key, seq, aux[:T], _draft_logits(drafter, seq, aux), 0)
                continue
            with torch.no_grad():
                nxt = target(input_ids=seq[None]).logits[0, -1].argmax()
            seq = torch.cat([seq, nxt[None]])
            new, extend_from = 1, 0
            while new < max_new:
                step0, drafts, chain_logits, fed_in = _chain(drafter, seq, aux, steps, to_target)
                write_extend(w, key, seq, aux, step0, extend_from)
                for k in range(1, steps):
                    w.write(
                        "draft_step",
                        step={"step_index": k},
                        req={"req_key": [key], "n_tok": [1]},
                        tok={
                            "input_ids": to_target(drafts[k - 1 : k]),
                            "positions": torch.tensor([len(seq) - 2 + k]),
                            "hidden_in": fed_in[k - 1 : k].to(torch.bfloat16),
                            **_topk(chain_logits[k : k + 1], to_target),
                        },
                    )
                proposed = to_target(drafts)
                verify_ids = torch.cat([seq, proposed])
                aux_v = _capture(target, verify_ids, layers).to(torch.bfloat16)
                with torch.no_grad():
                    argmax = target(input_ids=verify_ids[None]).logits[0].argmax(-1)
                p0 = len(seq) - 1
                write_target(w, key, 1, verify_ids, torch.arange(p0, len(verify_ids)), aux_v)
                accept = 0
                while accept < steps and int(argmax[p0 + accept]) == int(proposed[accept]):
                    accept += 1
                bonus = int(argmax[p0 + accept])
                w.write(
                    "verify",
                    req={
                        "req_key": [key],
                        "accept_len": [accept],
                        "bonus_id": [bonus],
                        "n_proposed": [steps],
                        "n_accepted": [accept],
                    },
                    proposed={"ids": proposed},
                    accepted={"ids": proposed[:accept]},
                )
                seq = torch.cat([seq, proposed[:accept], torch.tensor([bonus])])
                aux = torch.cat([aux, aux_v[p0 : p0 + 1 + accept]])
                extend_from = p0
                new += accept + 1
    return out
