"""Named fakes for the few imports that SGLang 0.5.23 makes unconditionally and that cannot run
on a CPU-only machine with the minimal install. Used only by tests (and by the CPU recording
test through `tests/sglang_fakes_site/sitecustomize.py`), never by hstrace itself.

- `FakeTorchvisionFinder`: the released torchvision next to torch 2.13.0+cpu fails at import
  (`operator torchvision::nms does not exist`); SGLang imports it only for multimodal configs.
- `FakeVllmCustomOps`: `RotaryEmbedding.__init__` imports `vllm._custom_ops` when CUDA is
  absent; only its presence matters for building and loading models (a forward would fail).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from unittest.mock import MagicMock


class _FakeModule(types.ModuleType):
    def __getattr__(self, name: str):  # any attribute: a MagicMock (enough for import-time use)
        if name.startswith("__"):
            raise AttributeError(name)
        value = MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class FakeTorchvisionFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    PREFIXES = ("torchvision",)

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.PREFIXES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _FakeModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+hstrace-fake"
        return module

    def exec_module(self, module):
        return None


class FakeVllmCustomOps(FakeTorchvisionFinder):
    PREFIXES = ("vllm",)


def install() -> None:
    for finder_cls in (FakeTorchvisionFinder, FakeVllmCustomOps):
        if not any(isinstance(f, finder_cls) and type(f) is finder_cls for f in sys.meta_path):
            sys.meta_path.insert(0, finder_cls())
