"""Loading untrusted training files: torch pickles only with `weights_only=True`, every failure
turned into a one-line `TrainingDataError` that names the file."""

from __future__ import annotations

import gzip
import io
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from hstrace.errors import TrainingDataError


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def load_torch(path: Path) -> Any:
    """`torch.load` of a `.pt`/`.ckpt` or a gzip-compressed `.ckpt.gz`, weights only."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                buf = io.BytesIO(f.read())
            return torch.load(buf, map_location="cpu", weights_only=True)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError as exc:
        raise TrainingDataError(f"{path}: missing training file") from exc
    except Exception as exc:  # corrupt zip, truncated gzip, disallowed pickle global, ...
        raise TrainingDataError(f"{path}: cannot load ({_first_line(exc)})") from exc


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device="cpu")
    except FileNotFoundError as exc:
        raise TrainingDataError(f"{path}: missing training file") from exc
    except (SafetensorError, OSError, ValueError) as exc:
        raise TrainingDataError(f"{path}: cannot load ({_first_line(exc)})") from exc


def require_dict(obj: Any, path: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise TrainingDataError(f"{path}: expected a dict of tensors, found {type(obj).__name__}")
    missing = [k for k in keys if k not in obj]
    if missing:
        raise TrainingDataError(
            f"{path}: missing keys {missing}; found keys {sorted(map(str, obj))}"
        )
    return obj


def require_tensor(obj: Any, path: Path, key: str, ndim: int) -> torch.Tensor:
    if not isinstance(obj, torch.Tensor) or obj.ndim != ndim:
        found = (
            f"a tensor of shape {list(obj.shape)}"
            if isinstance(obj, torch.Tensor)
            else type(obj).__name__
        )
        raise TrainingDataError(f"{path}: {key!r} should be a {ndim}-d tensor, found {found}")
    return obj
