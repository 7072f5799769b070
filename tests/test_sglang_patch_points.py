"""Every patch point of the installed SGLang's row exists with the expected signature."""

from __future__ import annotations

import pytest
from helpers.engines import signature_mismatches

from hstrace.engines.sglang.versions import check_supported_version, patch_points_for
from hstrace.errors import EngineError


def test_unsupported_versions_are_refused_with_the_range() -> None:
    for bad in ("0.5.12", "0.5.24", "0.4.6"):
        with pytest.raises(EngineError, match="0.5.13-0.5.23"):
            check_supported_version(bad)
    assert check_supported_version("0.5.23") == (0, 5, 23)


@pytest.mark.sglang
def test_every_patch_point_exists_with_its_signature() -> None:
    pytest.importorskip("sglang", reason="needs sglang==0.5.23 (scripts/sglang-venv.sh)")
    from helpers import sglang_fakes

    sglang_fakes.install()
    import sglang

    points = patch_points_for(check_supported_version(sglang.__version__))
    assert len(points) == 8
    assert signature_mismatches(points) == []


def test_a_point_that_cannot_be_patched_never_breaks_the_import(capsys) -> None:
    """Runs without SGLang: a module missing the patched class (drift inside a supported range)
    must leave the module importable and say so, not raise into SGLang's import."""
    import types

    from hstrace.hooks import sglang_patches

    point = patch_points_for((0, 5, 23))[0]
    empty = types.ModuleType(point.module)
    sglang_patches.apply(point, empty)  # must not raise
    assert f"cannot patch {point.qualname}" in capsys.readouterr().err
