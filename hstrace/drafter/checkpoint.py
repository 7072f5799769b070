"""Load and save drafter checkpoints in the speculators, SpecForge and EAGLE dialects.

`load_drafter` never guesses silently: its `LoadReport` says which dialect it detected, what each
checkpoint key became (or that nothing took it), which parameters were never loaded, and where
every flag came from. That report is what `hstrace check` audits.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hstrace.drafter.config import DrafterConfig
from hstrace.drafter.dialects import (
    DIALECTS,
    Flags,
    config_from_flat,
    config_from_speculators,
    detect_dialect,
    flat_config,
    speculators_config,
)
from hstrace.drafter.model import Eagle3Drafter
from hstrace.errors import CheckpointError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# Old or engine-side spellings -> our (speculators) parameter names.
_RENAMES = [
    (re.compile(r"^model\."), ""),
    (re.compile(r"^midlayer\."), "layers.0."),
    (re.compile(r"^aux_norm_low\."), "fc_norm.0."),
    (re.compile(r"^aux_norm_mid\."), "fc_norm.1."),
    (re.compile(r"^aux_norm_high\."), "fc_norm.2."),
]


@dataclass
class LoadReport:
    path: str
    dialect: str
    dialect_source: str  # "detected" or "given"
    config: dict[str, Any]  # the raw config.json
    weight_file: str
    key_map: dict[
        str, str | None
    ]  # checkpoint key -> parameter/buffer name, None = nothing takes it
    key_dtypes: dict[str, str]
    key_shapes: dict[str, list[int]]
    loaded: list[str]  # parameters/buffers that received a checkpoint tensor
    missing: list[str]  # parameters/buffers that kept their initial value
    flags: Flags  # name -> (value, source)
    # Config vs weights disagreements resolved from the weights (e.g. fc width).
    notes: list[str] = field(default_factory=list)

    @property
    def unmapped(self) -> list[str]:
        return [k for k, v in self.key_map.items() if v is None]

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "dialect": self.dialect,
            "dialect_source": self.dialect_source,
            "weight_file": self.weight_file,
            "key_map": self.key_map,
            "unmapped": self.unmapped,
            "loaded": self.loaded,
            "missing": self.missing,
            "flags": {k: {"value": v, "source": s} for k, (v, s) in self.flags.items()},
            "notes": self.notes,
        }


def _find(path: Path) -> tuple[Path, Path]:
    if path.is_file():
        path = path.parent
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return path, path / name
    raise CheckpointError(f"{path}: no model.safetensors or pytorch_model.bin")


CONFIG_MAX_BYTES = 16 << 20


def read_config(ckpt_dir: Path) -> dict[str, Any]:
    cfg_path = ckpt_dir / "config.json"
    if cfg_path.exists() and not cfg_path.is_file():  # a FIFO would block, a device never end
        raise CheckpointError(f"{cfg_path}: not a regular file; refusing to read it")
    if cfg_path.is_file() and cfg_path.stat().st_size > CONFIG_MAX_BYTES:
        raise CheckpointError(f"{cfg_path}: larger than {CONFIG_MAX_BYTES} bytes; not a config")
    try:
        raw = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{cfg_path}: missing config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise CheckpointError(
            f"{cfg_path}: JSON nested too deeply to be a config; refusing to read it"
        ) from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path}: config is not a JSON object")
    return raw


def read_tensors(weight_file: Path) -> dict[str, torch.Tensor]:
    try:
        if weight_file.suffix == ".bin":
            with warnings.catch_warnings():  # torch's pickle-protocol notes: we say what failed
                warnings.simplefilter("ignore")
                sd = torch.load(
                    weight_file, map_location="cpu", weights_only=True
                )  # never unpickle code
        else:
            sd = load_file(str(weight_file))
    except (SafetensorError, OSError, RuntimeError, EOFError, ValueError) as exc:
        msg = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{weight_file}: cannot read tensors ({msg})") from None
    except Exception as exc:  # pickle errors from a non-weights file
        raise CheckpointError(
            f"{weight_file}: cannot read tensors ({type(exc).__name__})"
        ) from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{weight_file}: not a flat name -> tensor state dict")
    check_finite(sd, weight_file)
    return sd


def check_finite(sd: dict[str, torch.Tensor], weight_file: Path) -> None:
    """No NaN or infinity in a floating-point tensor: a drafter holding one computes NaN
    logits, which compare as disagreement everywhere (one vectorised pass per tensor)."""
    for key, t in sd.items():
        if t.is_floating_point() and t.numel() and not _all_finite(t):
            bad = ~torch.isfinite(t.reshape(-1))
            i = int(torch.argmax(bad.to(torch.uint8)))
            value = float(t.reshape(-1)[i])
            raise CheckpointError(
                f"{weight_file}: tensor {key} holds {value} at flat index {i} "
                f"({int(bad.sum())} non-finite values; corrupt weights)"
            )


def _all_finite(t: torch.Tensor) -> bool:
    """Min and max in one pass: NaN propagates through both, and an infinity is one of them."""
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_d2t(sd: dict[str, torch.Tensor], vocab_size: int, weight_file: Path) -> None:
    """A `d2t` value must name a target id under one reading at least: as an offset
    (i + d2t[i]) or as a direct table (d2t[i]) in [0, vocab_size). One that fits neither is
    corrupt, not a misread map (`d2t-direct-table` is about values that fit as a table)."""
    key = next((k for k in sd if canonical_name(k) == "d2t"), None)
    if key is None:
        return
    d2t = sd[key]
    if d2t.is_floating_point() or d2t.dtype == torch.bool or d2t.dim() != 1:
        raise CheckpointError(
            f"{weight_file}: {key} is {str(d2t.dtype).removeprefix('torch.')} "
            f"{list(d2t.shape)}, not a 1-d integer map (corrupt)"
        )
    if not d2t.numel():
        return
    d = d2t.to(torch.int64)
    bad = (d >= vocab_size) | (d + torch.arange(d.numel()) < 0)
    if bool(bad.any()):
        i = int(torch.argmax(bad.to(torch.uint8)))
        raise CheckpointError(
            f"{weight_file}: {key}[{i}] = {int(d[i])} maps draft id {i} outside the target "
            f"vocabulary of {vocab_size} ids, read as an offset or as a table (corrupt)"
        )


def canonical_name(key: str) -> str:
    for pat, rep in _RENAMES:
        key = pat.sub(rep, key)
    return key


def _fit_aux_width(
    cfg: DrafterConfig, sd: dict[str, torch.Tensor], notes: list[str], where: str
) -> None:
    """The fc weight is the truth about n*Ht; a config that disagrees is reported, not trusted."""
    fc = next((v for k, v in sd.items() if canonical_name(k) == "fc.weight"), None)
    if fc is None or fc.dim() != 2:
        return
    width = fc.shape[1]
    if width == cfg.num_aux * cfg.aux_width:
        return
    if width % cfg.aux_width == 0:
        notes.append(
            f"fc.weight takes {width} = {width // cfg.aux_width} x {cfg.aux_width} inputs but the config implies "
            f"{cfg.num_aux} aux slots ({cfg.num_aux * cfg.aux_width})"
        )
        cfg.num_aux = width // cfg.aux_width
    elif width % cfg.num_aux == 0:
        notes.append(
            f"fc.weight takes {width} inputs; config target_hidden_size {cfg.aux_width} x {cfg.num_aux} slots disagrees"
        )
        cfg.target_hidden_size = width // cfg.num_aux
    else:
        raise CheckpointError(
            f"{where}: fc.weight {list(fc.shape)} does not fit {cfg.num_aux} aux slots of width {cfg.aux_width}"
        )


# Where the loader's flags say a value came from when the weights, not the config, decided it.
INPUT_NORM_SOURCE = "checkpoint:input_norm.weight (config.json has no norm_before_fc)"


def _fit_input_norm(cfg: DrafterConfig, sd: dict[str, torch.Tensor], flags: Flags) -> None:
    """`input_norm.weight` is the truth about `norm_before_fc` when the config is silent: a
    drafter holds that tensor only if it was built, hence trained, with the norm over the aux
    concat. The reference runs the drafter as its weights say; the engines read the absent key
    as False and skip the tensor without a word (vLLM 0.32 `Eagle3LlamaForCausalLM.load_weights`
    maps `input_norm.` to None), which the rules and the replay judge."""
    source = flags.get("norm_before_fc", (None, "default:"))[1]
    if cfg.norm_before_fc or cfg.fc_norm or not source.startswith("default:"):
        return
    weight = next((v for k, v in sd.items() if canonical_name(k) == "input_norm.weight"), None)
    if weight is None or tuple(weight.shape) != (cfg.num_aux * cfg.aux_width,):
        return
    cfg.norm_before_fc = True
    flags["norm_before_fc"] = (True, INPUT_NORM_SOURCE)  # (the flag's source says it)


# Parameters the checkpoint does not hold (the embedding of a SpecForge/EAGLE drafter, which
# comes from the target) are allocated from the config alone: at most this many times the
# checkpoint's own bytes, plus a floor (a real embedding is 1-3x a drafter's weights).
MISSING_MAX_RATIO = 8
MISSING_FLOOR_BYTES = 1 << 30


# Integer sizes of DrafterConfig that must be positive (head_dim / target_hidden_size: or None).
_POSITIVE_FIELDS = (
    "hidden_size",
    "vocab_size",
    "draft_vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "num_hidden_layers",
    "num_aux",
    "head_dim",
    "target_hidden_size",
)
# EAGLE-3 drafters have one decoder layer (a few in variants); this only stops a config that
# would build a million of them before any shape is compared.
MAX_LAYERS = 64


def _sizes(cfg: DrafterConfig) -> str:
    return (
        f"hidden_size {cfg.hidden_size}, vocab_size {cfg.vocab_size}, draft_vocab_size "
        f"{cfg.draft_vocab_size}, intermediate_size {cfg.intermediate_size}"
    )


def _check_sizes(
    cfg: DrafterConfig, sd: dict[str, torch.Tensor], where: str, weight_file: Path
) -> None:
    """Compare what the config would allocate with the checkpoint's tensors BEFORE allocating
    anything (a config claiming hidden 65536 / vocab 2^24 asks for terabytes)."""
    for name in _POSITIVE_FIELDS:
        value = getattr(cfg, name, None)
        if value is None and name in ("head_dim", "target_hidden_size"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CheckpointError(f"{where}: {name} {value!r} is not a positive whole number")
    if cfg.num_hidden_layers > MAX_LAYERS:
        raise CheckpointError(
            f"{where}: num_hidden_layers {cfg.num_hidden_layers}: an EAGLE-3 drafter has a few "
            f"layers (limit {MAX_LAYERS}); fix config.json (nothing was allocated)"
        )
    try:
        with torch.device("meta"):
            shapes = {
                k: (tuple(t.shape), t.dtype) for k, t in Eagle3Drafter(cfg).state_dict().items()
            }
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    held = 0
    for key, tensor in sd.items():
        name = canonical_name(key)
        if name not in shapes:
            continue
        held += tensor.numel() * tensor.element_size()
        if tuple(tensor.shape) != shapes[name][0]:
            raise CheckpointError(
                f"{weight_file}: {key} has shape {list(tensor.shape)}, but the config "
                f"({_sizes(cfg)}) implies {list(shapes[name][0])}; nothing was allocated"
            )
    names = {canonical_name(k) for k in sd}
    missing = sum(
        math.prod(shape) * (torch.empty(0, dtype=dt).element_size() if dt != torch.bool else 1)
        for n, (shape, dt) in shapes.items()
        if n not in names
    )
    limit = MISSING_MAX_RATIO * held + MISSING_FLOOR_BYTES
    if missing > limit:
        raise CheckpointError(
            f"{where}: the config ({_sizes(cfg)}) needs {missing} bytes for parameters "
            f"{weight_file.name} does not hold, more than {limit} ({MISSING_MAX_RATIO}x its "
            "tensors + 1 GiB); fix config.json (nothing was allocated)"
        )


def load_drafter(
    path: str | Path,
    dialect: str | None = None,
    dtype: torch.dtype = torch.float32,
    target_embed: torch.Tensor | None = None,
) -> tuple[Eagle3Drafter, LoadReport]:
    """Load a drafter checkpoint directory (or a file inside one). `target_embed` [V, H] supplies
    the embedding for dialects that do not save it (SpecForge, EAGLE)."""
    ckpt_dir, weight_file = _find(Path(path))
    raw = read_config(ckpt_dir)
    sd = read_tensors(weight_file)
    detected = detect_dialect(raw, weight_file.name)
    if dialect is None and detected is None:
        raise CheckpointError(
            f"{ckpt_dir}: config.json is not an EAGLE-3 drafter config (no speculators_model_type, Eagle3 architecture or draft_vocab_size)"
        )
    if dialect is not None and dialect not in DIALECTS:
        raise CheckpointError(f"unknown dialect {dialect!r} (one of {', '.join(DIALECTS)})")
    chosen = dialect or detected
    assert chosen is not None
    where = str(ckpt_dir / "config.json")
    try:
        if chosen == "speculators":
            cfg, flags = config_from_speculators(raw, where)
        else:
            cfg, flags = config_from_flat(raw, where, chosen)
    except ValueError as exc:  # DrafterConfig's own consistency checks
        raise CheckpointError(f"{where}: {exc}") from None
    check_d2t(sd, cfg.vocab_size, weight_file)
    notes: list[str] = []
    _fit_aux_width(cfg, sd, notes, where)
    _fit_input_norm(cfg, sd, flags)
    _check_sizes(cfg, sd, where, weight_file)
    try:
        model = Eagle3Drafter(cfg)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None

    own = model.state_dict()
    key_map: dict[str, str | None] = {}
    to_load: dict[str, torch.Tensor] = {}
    for key, tensor in sd.items():
        name = canonical_name(key)
        if name not in own:
            key_map[key] = None
            continue
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise CheckpointError(
                f"{weight_file}: {key} has shape {list(tensor.shape)}, the config implies {list(own[name].shape)}"
            )
        key_map[key] = name
        to_load[name] = (
            tensor.to(own[name].dtype)
            if own[name].dtype in (torch.long, torch.bool)
            else tensor.to(dtype)
        )
    if target_embed is not None and "embed_tokens.weight" not in to_load:
        if tuple(target_embed.shape) != tuple(own["embed_tokens.weight"].shape):
            raise CheckpointError(
                f"target embedding {list(target_embed.shape)} != {list(own['embed_tokens.weight'].shape)}"
            )
        to_load["embed_tokens.weight"] = target_embed.to(dtype)
    model.load_state_dict(to_load, strict=False)
    model.to(dtype)
    report = LoadReport(
        path=str(ckpt_dir),
        dialect=chosen,
        dialect_source="given" if dialect else "detected",
        config=raw,
        weight_file=weight_file.name,
        key_map=key_map,
        key_dtypes={k: str(v.dtype).removeprefix("torch.") for k, v in sd.items()},
        key_shapes={k: list(v.shape) for k, v in sd.items()},
        loaded=sorted(to_load),
        missing=sorted(set(own) - set(to_load)),
        flags=flags,
        notes=notes,
    )
    return model, report


def save_drafter(
    model: Eagle3Drafter,
    path: str | Path,
    dialect: str = "speculators",
    dtype: torch.dtype | None = None,
    include_embed: bool | None = None,
) -> Path:
    """Write config.json + weights the way the library does: speculators `layers.0.*` with the
    embedding and (if Vd < V) d2t/t2d; SpecForge `midlayer.*` + d2t/t2d, no embedding; EAGLE
    `pytorch_model.bin`. `dtype` casts float tensors (the libraries save bf16)."""
    if dialect not in DIALECTS:
        raise CheckpointError(f"unknown dialect {dialect!r} (one of {', '.join(DIALECTS)})")
    cfg = model.cfg
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    dt = dtype or next(model.parameters()).dtype
    dtype_name = str(dt).removeprefix("torch.")
    config = (
        speculators_config(cfg, dtype_name)
        if dialect == "speculators"
        else flat_config(cfg, dtype_name, dialect)
    )
    keep_embed = include_embed if include_embed is not None else dialect == "speculators"
    sd: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name == "embed_tokens.weight" and not keep_embed:
            continue
        if (
            name in ("d2t", "t2d")
            and dialect == "speculators"
            and cfg.draft_vocab_size == cfg.vocab_size
        ):
            continue  # speculators writes no vocab map for a full-vocab drafter
        if dialect != "speculators":
            name = (
                name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name
            )
        sd[name] = (t.to(dt) if t.is_floating_point() else t).detach().contiguous().cpu()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if dialect == "eagle":
        torch.save(sd, out / "pytorch_model.bin")
    else:
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
