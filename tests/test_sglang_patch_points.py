"""Every patch point of the installed SGLang's row exists with the expected signature."""

from __future__ import annotations

import pytest
from helpers.engines import signature_mismatches

from hstrace.engines.sglang.versions import CAPTURE_TARGETS, SUPPORT
from hstrace.errors import EngineError


def test_unsupported_versions_are_refused_with_the_range() -> None:
    for bad in ("0.5.12", "0.5.24", "0.4.6"):
        with pytest.raises(EngineError, match="0.5.13-0.5.23"):
            SUPPORT.check_supported_version(bad)
    assert SUPPORT.check_supported_version("0.5.23") == (0, 5, 23)


@pytest.mark.sglang
def test_every_patch_point_exists_with_its_signature() -> None:
    pytest.importorskip("sglang", reason="needs sglang==0.5.23 (scripts/sglang-venv.sh)")
    from helpers import sglang_fakes

    sglang_fakes.install()
    import sglang

    points = SUPPORT.patch_points_for(SUPPORT.check_supported_version(sglang.__version__))
    capture = [p for p in points if p.qualname.endswith(".set_eagle3_layers_to_capture")]
    assert len(points) == 8 + len(capture) and len(capture) == len(CAPTURE_TARGETS) == 28
    # the capture rows are checked from the sources (test below): some target modules need
    # CUDA-only or optional packages to import on this CPU machine
    assert signature_mismatches([p for p in points if p not in capture]) == []


_SGLANG_INNER_CAPTURE = {  # take the resolved `layers_to_capture`, called by a listed target
    "qwen2_moe:Qwen2MoeModel",
    "qwen3_5:Qwen3_5ForCausalLM",
    "qwen3_next:Qwen3NextModel",
}


@pytest.mark.sglang
def test_capture_audit_covers_every_target_sglang_defines() -> None:
    """Every class of the installed SGLang's models that defines
    `set_eagle3_layers_to_capture(self, layer_ids)` (read from its sources) has a capture row,
    with that signature, and no row names a class that does not define it."""
    import ast
    import importlib.util
    from pathlib import Path

    pytest.importorskip("sglang", reason="needs sglang==0.5.23 (scripts/sglang-venv.sh)")
    spec = importlib.util.find_spec("sglang.srt.models")
    defined: dict[str, tuple[str, ...]] = {}
    for source in sorted(Path(spec.submodule_search_locations[0]).glob("*.py")):
        for cls in ast.parse(source.read_text()).body:
            if not isinstance(cls, ast.ClassDef):
                continue
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "set_eagle3_layers_to_capture":
                    defined[f"{source.stem}:{cls.name}"] = tuple(a.arg for a in fn.args.args)
    takes_ids = {k for k, params in defined.items() if params == ("self", "layer_ids")}
    assert set(defined) - takes_ids == _SGLANG_INNER_CAPTURE, defined
    assert {target for target, _ in CAPTURE_TARGETS} == takes_ids
    assert {"llama:LlamaForCausalLM", "qwen3:Qwen3ForCausalLM"} <= takes_ids
    rows = {
        p.target.removeprefix("sglang.srt.models.").removesuffix(".set_eagle3_layers_to_capture")
        for p in SUPPORT.patch_points_for((0, 5, 23))
        if p.qualname.endswith(".set_eagle3_layers_to_capture")
    }
    assert rows == takes_ids


def test_capture_audit_reads_each_holder_and_keeps_the_inner_record(tmp_path) -> None:
    """Without SGLang: the one capture wrapper on targets that keep `layers_to_capture` on
    their decoder (`self.model`) or behind a language model they forward to; the forwarding
    class records the same layers under its own name and never overwrites them with []."""
    import types

    from hstrace.hooks import sglang_patches

    from hstrace.trace import TraceWriter, create_trace, open_trace

    out = tmp_path / "t.zarr"
    create_trace(out, engine={"name": "sglang", "version": "0.5.23"}, command_line=[], static={})
    rec = sglang_patches.Recorder({"out": str(out), "streams": []}, (0, 5, 23))
    rec.writer_factory = lambda rank: TraceWriter(out, rank=rank, process=False)
    sglang_patches.REC, saved = rec, sglang_patches.REC
    try:

        class Qwen3ForCausalLM:  # stand-in: resolves ids + 1 onto its decoder
            def __init__(self):
                self.model = types.SimpleNamespace(layers_to_capture=[])

            def set_eagle3_layers_to_capture(self, layer_ids=None):
                self.model.layers_to_capture = [i + 1 for i in layer_ids]

        class Gemma3ForConditionalGeneration:  # stand-in: forwards to its language model
            def __init__(self):
                self.language_model = Qwen3ForCausalLM()

            def set_eagle3_layers_to_capture(self, layer_ids=None):
                self.language_model.set_eagle3_layers_to_capture(layer_ids)

        wrap = sglang_patches.WRAPPERS["Qwen3ForCausalLM.set_eagle3_layers_to_capture"]
        Qwen3ForCausalLM.set_eagle3_layers_to_capture = wrap(
            Qwen3ForCausalLM.set_eagle3_layers_to_capture
        )
        outer = sglang_patches.WRAPPERS[
            "Gemma3ForConditionalGeneration.set_eagle3_layers_to_capture"
        ]
        Gemma3ForConditionalGeneration.set_eagle3_layers_to_capture = outer(
            Gemma3ForConditionalGeneration.set_eagle3_layers_to_capture
        )
        Gemma3ForConditionalGeneration().set_eagle3_layers_to_capture([0, 3, 5])
        rec.close()
    finally:
        sglang_patches.REC = saved
    capture = open_trace(out).meta["static"]["capture"]
    assert capture["target_class"] == "Gemma3ForConditionalGeneration"
    assert capture["layers_to_capture"] == [1, 4, 6] and capture["num_captures"] == 3
    assert capture["layer_ids_passed"] == [0, 3, 5] and rec.capture_layers == [1, 4, 6]


def test_a_point_that_cannot_be_patched_never_breaks_the_import(capsys) -> None:
    """Runs without SGLang: a module missing the patched class (drift inside a supported range)
    must leave the module importable and say so, not raise into SGLang's import."""
    import types

    from hstrace.hooks import sglang_patches

    point = SUPPORT.patch_points_for((0, 5, 23))[0]
    empty = types.ModuleType(point.module)
    sglang_patches.apply(point, empty)  # must not raise
    assert f"cannot patch {point.qualname}" in capsys.readouterr().err


@pytest.mark.sglang
def test_the_sglang_venv_carries_what_hstrace_reads() -> None:
    """scripts/sglang-venv.sh: without pyarrow, speculators' loss masks are assumed all ones
    there and accuracies differ from every other environment."""
    pytest.importorskip("sglang", reason="needs sglang==0.5.23 (scripts/sglang-venv.sh)")
    from hstrace.training.arrow_table import have_pyarrow

    assert have_pyarrow()
