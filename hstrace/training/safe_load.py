"""Loading untrusted training files: torch pickles only with `weights_only=True`, every failure
turned into a one-line `TrainingDataError` that names the file.

A gzip member is inflated in blocks up to a cap (a 1.5 MB `.ckpt.gz` can claim 1.5 GiB), and
torch's own warnings (e.g. "Detected pickle protocol 4" for a raw pickle) are kept off the
user's terminal: the one line we print says what was wrong.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import stat
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from hstrace.errors import TrainingDataError


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


# A gzip'd sample may inflate to this many times its size (bf16 hidden states compress
# ~1.1-1.5x; all-zero padding more), and never past the absolute limit.
GZIP_MAX_RATIO = 20
GZIP_MIN_LIMIT = 256 << 20
GZIP_MAX_BYTES = 16 << 30
_BLOCK = 4 << 20


def gunzip_capped(path: Path) -> bytes:
    """The inflated content of a gzip file, read in blocks; TrainingDataError past the cap."""
    packed = path.stat().st_size
    limit = min(GZIP_MAX_BYTES, max(GZIP_MIN_LIMIT, GZIP_MAX_RATIO * packed))
    out = io.BytesIO()
    with gzip.open(path, "rb") as f:
        while block := f.read(_BLOCK):
            out.write(block)
            if out.tell() > limit:
                raise TrainingDataError(
                    f"{path}: inflates past {limit} bytes from {packed} (limit "
                    f"{GZIP_MAX_RATIO}x, at least {GZIP_MIN_LIMIT >> 20} MiB); refusing a "
                    "possible gzip bomb"
                )
    return out.getvalue()


# JSON side files (state.json, data_config.json) are a few KiB.
TEXT_MAX_BYTES = 16 << 20


def require_regular(path: Path) -> None:
    """A training file must be a regular file: a FIFO would block the loader forever and a
    device (a link to /dev/zero) would never end."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise TrainingDataError(f"{path}: missing training file") from None
    except OSError as exc:
        raise TrainingDataError(f"{path}: cannot stat ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise TrainingDataError(
            f"{path}: not a regular file (a device, FIFO or socket); refusing to read it"
        )


def read_small_text(path: Path, max_bytes: int = TEXT_MAX_BYTES) -> str:
    """A small side file's text (JSON configs), refused past `max_bytes` or if not a file."""
    require_regular(path)
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise TrainingDataError(f"{path}: larger than {max_bytes} bytes; not a config file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TrainingDataError(f"{path}: not UTF-8 text ({exc.reason})") from None


def load_torch(path: Path) -> Any:
    """`torch.load` of a `.pt`/`.ckpt` or a gzip-compressed `.ckpt.gz`, weights only."""
    require_regular(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's pickle-protocol notes: we say what failed
            if path.name.endswith(".gz"):
                buf = io.BytesIO(gunzip_capped(path))
                return torch.load(buf, map_location="cpu", weights_only=True)
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except TrainingDataError:
        raise
    except FileNotFoundError as exc:
        raise TrainingDataError(f"{path}: missing training file") from exc
    except (gzip.BadGzipFile, zlib.error, EOFError) as exc:
        raise TrainingDataError(f"{path}: corrupt gzip ({_first_line(exc)})") from exc
    except MemoryError as exc:
        raise TrainingDataError(f"{path}: needs more memory than is available to load") from exc
    except pickle.UnpicklingError as exc:
        # torch's message opens with advice to retry with weights_only=False (never do that
        # with a stranger's file); the line that says what was refused is further down.
        why = next(
            (ln.strip() for ln in str(exc).splitlines() if "WeightsUnpickler error" in ln),
            "not a weights-only torch file",
        )
        raise TrainingDataError(f"{path}: pickle refused ({why[:200]})") from exc
    except Exception as exc:  # corrupt zip, truncated gzip, disallowed pickle global, ...
        raise TrainingDataError(f"{path}: cannot load ({_first_line(exc)})") from exc


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    require_regular(path)
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
