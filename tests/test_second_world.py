"""The second world (traces/second-world/, issue 11 item 8): a DeepSeek-V3 target (HF
`DeepseekV3ForCausalLM`, MLA + MoE) with training data and drafters made by speculators' and
SpecForge's own code, and faults injected outside hstrace's reference engine:

- hstrace's dialect detection and data readers on the libraries' own artifacts (clean: the
  only fault is the flag speculators 0.9.0's defaults wrote and SGLang never reads);
- data written by speculators' code with the seed incident's layer set (slot 0 = embedding);
- traces written through the public trace writer by a third-party producer serving
  speculators' own drafter: clean in bf16 (MoE routing in bf16) and with shifted capture layers.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.check import codes
from helpers.cli import run_main
from helpers.second_world import producer
from helpers.worlds import differing_files, same_kernels, unstamped

ROOT = Path(__file__).resolve().parents[1]
WORLD = ROOT / "traces" / "second-world"
SERVED = [16, 17, 18, 19]  # held-out samples, sent as prompts


def run_check(*args: str) -> tuple[int, dict | str, str]:
    """`hstrace check ARGS` in-process through main(): (exit code, the --json document or the
    text, stderr)."""
    out = run_main("check", *args)
    doc = json.loads(out.stdout) if "--json" in args and out.returncode != 2 else out.stdout
    return out.returncode, doc, out.stderr


def _finding(doc: dict, code: str) -> dict:
    found = [f for f in doc["findings"] if f["code"] == code]
    assert found, (code, codes(doc))
    return found[0]


def test_world_is_what_its_manifest_says():
    man = json.loads((WORLD / "MANIFEST.json").read_text())
    for rel, digest in man["files"].items():
        assert hashlib.sha256((WORLD / rel).read_bytes()).hexdigest() == digest, rel
    size = sum(p.stat().st_size for p in WORLD.rglob("*") if p.is_file())
    assert size < 4_500_000, size
    target = json.loads((WORLD / "target" / "config.json").read_text())
    assert target["architectures"] == ["DeepseekV3ForCausalLM"]
    assert target["num_hidden_layers"] == 7 and target["hidden_size"] == 96
    assert target["vocab_size"] == 320 and target["n_routed_experts"] == 4
    assert target["qk_nope_head_dim"] + target["qk_rope_head_dim"] >= 32  # MLA head dim 48
    assert target["v_head_dim"] >= 32 and target["kv_lora_rank"] == 32
    draft = json.loads((WORLD / "drafter-speculators" / "config.json").read_text())
    assert draft["transformer_layer_config"]["head_dim"] == 48
    assert draft["speculators_version"] == "0.9.0"
    assert man["libraries"]["speculators"] == "0.9.0" and man["libraries"]["specforge"] == "0.2.0"
    # speculators' source (save_pretrained copies its config.py for auto_map) is not committed
    assert not (WORLD / "drafter-speculators" / "config.py").exists()


def _check(drafter: str, data: str, *extra: str) -> tuple[int, dict]:
    rc, doc, _ = run_check(
        str(WORLD / f"drafter-{drafter}"),
        "--json",
        "--against",
        str(WORLD / f"training-{data}"),
        "--sglang-version",
        "0.5.23",
        *extra,
    )
    return rc, doc


def test_the_libraries_artifacts_load_and_agree():
    target = ("--target", str(WORLD / "target"))
    got = {}
    for drafter in ("speculators", "specforge"):
        for data in ("speculators", "specforge"):
            rc, doc = _check(drafter, data, *target)
            train = doc["metrics"]["training"]
            assert doc["dialect"] == drafter and train["format"] == data
            assert doc["load_report"]["unmapped"] == []
            for name in ("acc0_teacher", "acc0_target"):
                assert train[name]["value"] >= 0.9, (drafter, data, name, train[name])
            got[drafter, data] = train["per_position"]["full"]
            if drafter == "speculators":
                # speculators 0.9.0's eagle3 training defaults wrote norm_before_residual=True,
                # which SGLang never reads: the one fault, named with its source
                assert rc == 1 and codes(doc) == ["norm-flag-mismatch"]
                ev = doc["findings"][0]["evidence"]
                on_training = ev.pop("on_training")
                assert ev == {"norm_before_residual": True, "source": "config:norm_before_residual"}
                # the fix is checked on the training tensors: True fits them better (lower loss)
                assert on_training["flag"] == "norm_before_residual"
                assert on_training["value_that_fits_training"] is True
                fixed = on_training["with the fix (norm_before_residual=True)"]
                served = on_training["as the engine reads it (norm_before_residual=False)"]
                assert fixed["loss"] < served["loss"] and fixed["rows"] == served["rows"] > 0
                # its top-level ids [2, 3, 4] are SGLang's defaults for N = 7: not flagged
                assert "aux-layers-default" not in codes(doc)
            else:  # exported by SpecForge's save_pretrained: nothing to report
                assert rc == 0 and doc["findings"] == []
    # the same physical layers (HF 2, 3, 4) stored by both libraries' layouts: same numbers
    for drafter in ("speculators", "specforge"):
        a, b = got[drafter, "speculators"], got[drafter, "specforge"]
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 0.01, (drafter, a, b)


def test_speculators_layer_set_with_an_embedding_slot():
    """Data written by speculators' own code with ids [0, 3, 4] + 7: [:-1] is the aux, so fc
    would train on the embedding in slot 0, which the drafter's config ([2, 3, 4]) never asks
    the engine for. Found without the target, from the drafter's own saved embedding."""
    rc, doc = _check("speculators", "speculators-embed")
    f = _finding(doc, "slot-layout")
    assert rc == 1 and f["severity"] == "fault"
    ev = f["evidence"]
    assert ev["embedding_slots"] == [0] and ev["config_hf_indices"] == [2, 3, 4]
    assert ev["stored_layout"] == ["embed", "layer?", "layer?", "last (teacher)"]
    assert ev["embedding_source"] == "the drafter checkpoint's embed_tokens"
    assert ev["slot_rel_errors"]["0"] < 1e-2 < ev["slot_rel_errors"]["1"]
    # a SpecForge drafter carries no embedding and no target is given: slot 0 is still found,
    # as the one slot that is the same row wherever a token repeats
    rc, doc = _check("specforge", "speculators-embed")
    ev = _finding(doc, "slot-layout")["evidence"]
    assert rc == 1 and ev["embedding_slots"] == [0] and ev["embedding_source"].startswith("none")
    assert ev["slot_rel_errors"]["0"] == 0.0 and min(ev["slot_rel_errors"][k] for k in "12") > 0.1
    assert ev["config_layer_ids"] == [1, 2, 3] and ev["config_hf_indices"] == [2, 3, 4]
    # the correctly captured data has no embedding slot
    rc, doc = _check("speculators", "speculators")
    slots = doc["metrics"]["training"]["embedding_slot_test"]["slots"]
    assert [s["is_embedding"] for s in slots] == [False, False, False, False]


def test_eagle31_drafter_in_specforge_layout_is_read_after_pr_879():
    """An EAGLE-3.1 drafter (speculators' code trained it feeding norm(h) back) saved by
    SpecForge's save_pretrained with `norm_output: true`, as a SpecForge export after PR #879
    writes it. Without data hstrace asks; with the training tensors it names the reading, and
    the accuracy it reports is the drafter's under that reading."""
    ck = str(WORLD / "drafter-specforge-eagle31")
    rc, doc, _ = run_check(ck, "--json")
    f = _finding(doc, "norm-flag-mismatch")
    assert rc == 0 and f["severity"] == "warning" and f["evidence"]["reading"] == "unknown"
    target = ("--target", str(WORLD / "target"))
    rc, doc = _check("specforge-eagle31", "specforge", *target, "--all-versions")
    res = doc["metrics"]["norm_output_resolution"]
    assert res["reading"] == "after-specforge-pr-879"
    assert res["only_right_after_pr_879"] > 10 * max(res["only_right_before_pr_879"], 1)
    assert (
        res["accuracy"]["after-specforge-pr-879"]
        >= 0.9
        > res["accuracy"]["before-specforge-pr-879"]
    )
    assert [(f["code"], f["applies_to"]) for f in doc["findings"]] == [
        ("norm-flag-mismatch", "sglang<0.5.23")
    ]
    assert "EAGLE-3.1" in doc["findings"][0]["summary"]
    full = doc["metrics"]["training"]["per_position"]["full"]
    assert full[1] >= 0.9, full  # scored as trained (feed norm(h)), not as SpecForge 0.2.0 reads it
    # judged for SGLang 0.5.23 (reads norm_output as feed norm(h)): served as trained
    rc, doc = _check("specforge-eagle31", "specforge", *target)
    assert rc == 0 and doc["findings"] == []


@pytest.mark.parametrize("name", ["drafter-specforge", "drafter-specforge-eagle31"])
def test_specforge_exports_load_as_specforge_runs_them(monkeypatch, name):
    """SpecForge's own export, loaded by hstrace's dialect detection, gives SpecForge 0.2.0's
    own logits (its `LlamaForCausalLMEagle3` warm-started from the same dir, run by its
    `OnlineEagle3Model`) on a real training sample, at every TTT step. For the EAGLE-3.1 export
    (`norm_output: true`) this pins which reading SpecForge 0.2.0 is: the one before PR #879
    (feed h back); the after-#879 reading agrees at step 0 and differs at steps >= 1."""
    import torch

    sf = pytest.importorskip("helpers.specforge", reason="specforge 0.2.0 not importable")
    monkeypatch.setattr(sf.sf_model, "LogSoftmaxLoss", sf.FakeCudaLogSoftmaxLoss)
    from hstrace.drafter import load_drafter
    from hstrace.drafter.norm_output import POST_879, PRE_879, norm_output_flags
    from hstrace.metrics import TargetHead
    from hstrace.target_io import load_target_embedding
    from hstrace.training import open_training

    ck, target_dir = WORLD / name, WORLD / "target"
    theirs_model = sf.specforge_model(ck, target_dir)
    s = open_training(WORLD / "training-specforge")[SERVED[0]]
    T, steps = s.num_tokens - 1, 3
    ids = s.input_ids[1:]  # row t: token t+1
    aux = s.aux_concat[:T].float()
    teacher = TargetHead.from_pretrained(target_dir).teacher_logits(s.last, s.last_norm)
    theirs, _ = sf.run_specforge(
        theirs_model, aux, ids, teacher[1:].float(), s.loss_mask[1:].bool(), steps
    )
    ours, report = load_drafter(ck, target_embed=load_target_embedding(target_dir))
    assert report.dialect == "specforge" and report.unmapped == []
    readings = [PRE_879, POST_879] if "norm_output" in report.config else [PRE_879]
    diffs = {}
    for reading in readings:
        for flag, value in norm_output_flags(True, reading).items():
            setattr(ours.cfg, flag, value)
        with torch.no_grad():
            mine = ours.ttt(ids, aux, steps=steps)
        diffs[reading] = [
            float((theirs[k][: T - k] - mine[k].logits[: T - k]).abs().max()) for k in range(steps)
        ]
    assert max(diffs[PRE_879]) <= 1e-4, diffs  # SpecForge 0.2.0 = before PR #879
    if POST_879 in diffs:
        assert diffs[POST_879][0] <= 1e-4 and min(diffs[POST_879][1:]) > 1e-2, diffs


# --- traces written by a third-party producer ---------------------------------------------------


@pytest.fixture(scope="module")
def served_prompts():
    pytest.importorskip(
        "speculators.models.eagle3", reason="the producer serves speculators' model"
    )
    from hstrace.training import open_training

    td = open_training(WORLD / "training-speculators")
    return [td[i].input_ids.tolist() for i in SERVED]


def _replay(trace: Path) -> dict:
    from hstrace import replay_trace

    return replay_trace(trace, WORLD / "training-speculators").to_json()


def test_third_party_trace_clean_in_bf16(tmp_path, served_prompts):
    """The target served in bf16 (MLA and the MoE router in bf16), the drafter speculators'
    own model: serving and training agree, and replay must say so (no target-drift)."""
    import torch

    trace = producer().record(
        tmp_path / "clean.zarr",
        WORLD / "target",
        WORLD / "drafter-speculators",
        served_prompts,
        layers=[2, 3, 4],
        dtype=torch.bfloat16,
    )
    doc = _replay(trace)
    assert doc["verdict"]["code"] == "no-wiring-fault", doc["findings"]
    assert [f["code"] for f in doc["findings"]] == ["no-wiring-fault"]
    fp = doc["fingerprints"]
    assert fp["serving_layers"]["layer"] == [2, 3, 4] == fp["training_layers"]["layer"]
    assert min(fp["serving_layers"]["cos"]) >= 0.999
    assert doc["coverage"]["aligned_requests"] == doc["coverage"]["exact"] == len(SERVED)
    # hstrace's reference drafter reproduces speculators' own Eagle3DraftModel (all three
    # speculators 0.9.0 norm flags on) on the recorded inputs
    m = doc["metrics"]["engine_vs_reference"]
    assert m["top1_agreement"] == 1.0 and m["max_logprob_diff"] <= 1e-3, m


def test_third_party_trace_with_shifted_capture(tmp_path, served_prompts):
    """The producer's engine captures HF [3, 4, 5] for a drafter trained on [2, 3, 4]."""
    trace = producer().record(
        tmp_path / "shift.zarr",
        WORLD / "target",
        WORLD / "drafter-speculators",
        served_prompts,
        layers=[3, 4, 5],
    )
    doc = _replay(trace)
    v = doc["verdict"]
    assert v["code"] == "aux-layer-shift", doc["findings"]
    f = _finding(doc, "aux-layer-shift")
    ev = f["evidence"]
    assert ev["serving_layers"] == [3, 4, 5] and ev["training_layers"] == [2, 3, 4]
    assert ev["shift"] == 1 and min(ev["serving_layer_cos"]) >= 0.999
    assert "[1, 2, 3]" in f["fix"] and "[2, 3, 4]" in f["fix"]


def _build_python() -> str | None:
    """A Python that can run the build: speculators' data pipeline imports httpx and loguru,
    which the test environment does not install (scripts/test.sh); the build venv of the
    docstring of traces/second-world/build.py has them."""
    probe = "import httpx, loguru, speculators, specforge"
    venv = Path.home() / ".cache" / "hstrace" / "venv-second-world" / "bin" / "python"
    for py in (sys.executable, str(venv)):
        if (
            Path(py).exists()
            and subprocess.run([py, "-c", probe], capture_output=True).returncode == 0
        ):
            return py
    return None


@pytest.mark.slow
def test_rebuild_reproduces_the_world(tmp_path):
    """Same torch and CPU kernels: bit-identical files (drafter-speculators/config.json holds
    the verifier path relative to where the build ran, so it is compared without it). Other
    kernels: the same files and held-out figures within a small margin."""
    py = _build_python()
    if py is None:
        pytest.skip("no Python with httpx + loguru + speculators + specforge (see build.py)")
    res = subprocess.run(
        [py, str(WORLD / "build.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rebuilt = json.loads((tmp_path / "MANIFEST.json").read_text())
    committed = json.loads((WORLD / "MANIFEST.json").read_text())
    assert rebuilt["sizes"] == committed["sizes"]
    assert rebuilt["files"].keys() == committed["files"].keys()
    cfg = "drafter-speculators/config.json"

    def without_path(root: Path) -> dict:
        c = json.loads((root / cfg).read_text())
        c["speculators_config"]["verifier"].pop("name_or_path")
        return unstamped(c)

    assert without_path(tmp_path) == without_path(WORLD)
    if same_kernels(rebuilt, committed):  # HF configs compared without their transformers stamp
        r, c = ({k: v for k, v in m["files"].items() if k != cfg} for m in (rebuilt, committed))
        assert differing_files(tmp_path, WORLD, r, c) == []
        assert rebuilt["heldout"] == committed["heldout"]
        return
    for name, ref in committed["heldout"].items():
        got = rebuilt["heldout"][name]
        assert abs(got["acc0_target"] - ref["acc0_target"]) < 0.05, name
        assert abs(got["sim_accept_len_with_bonus"] - ref["sim_accept_len_with_bonus"]) < 0.3, name


def test_third_party_trace_reading_d2t_as_a_table(tmp_path, served_prompts):
    """The producer's engine maps draft ids through d2t as if it were a table (target = d2t[i])
    instead of offsets (i + d2t[i])."""
    trace = producer().record(
        tmp_path / "d2t.zarr",
        WORLD / "target",
        WORLD / "drafter-speculators",
        served_prompts,
        layers=[2, 3, 4],
        d2t_as_table=True,
    )
    doc = _replay(trace)
    assert doc["verdict"]["code"] == "d2t-direct-table", doc["findings"]
    ev = _finding(doc, "d2t-direct-table")["evidence"]
    by = ev["agreement_by_reading"]
    assert by["direct table"] == 1.0 and by["offsets"] < 0.5, by


def test_third_party_decode_trace_with_speculators_chain(tmp_path, served_prompts):
    """Greedy decode rounds (3 drafts, topk 1) whose chain is run by speculators' own forward
    (norm_output=True: it feeds norm(h) back), served next to the bf16 target: replay reruns
    every recorded draft step with hstrace's reference and finds nothing to report."""
    from hstrace.trace import open_trace

    trace = producer().record(
        tmp_path / "decode.zarr",
        WORLD / "target",
        WORLD / "drafter-speculators",
        [p[:24] for p in served_prompts],
        layers=[2, 3, 4],
        max_new=10,
    )
    doc = _replay(trace)
    assert [f["code"] for f in doc["findings"]] == ["no-wiring-fault"], doc["findings"]
    assert doc["skipped"] == {}  # every check ran: draft steps, verify, acceptance
    steps = doc["metrics"]["engine_vs_reference"]["by_draft_step"]
    assert [s["draft_step"] for s in steps] == [1, 2]
    assert all(s["top1_agreement"] == 1.0 and s["max_logit_diff"] <= 1e-3 for s in steps), steps
    with open_trace(trace) as tr:
        accept = tr.rank(0).table("verify").column("req", "accept_len")
    assert doc["metrics"]["mean_accept_len"] == pytest.approx(float(accept.mean()))
