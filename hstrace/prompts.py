"""Prompts for `hstrace record`: a JSONL file, or training samples' token ids sent as-is.

Library code (the CLI, the engines' tests and the bundle pipeline use it), so it lives below the
command layer: nothing imports a command module.
"""

from __future__ import annotations

import json
from pathlib import Path

from hstrace.engines.base import Prompt
from hstrace.errors import HstraceError, TrainingDataError


def load_prompts_jsonl(path: Path) -> list[Prompt]:
    """One JSON object per line with `input_ids` (list of ints) or `text` (or `prompt`)."""
    prompts: list[Prompt] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise HstraceError(f"cannot read prompts file {path}: {exc.strerror}") from exc
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise HstraceError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
        source_id = str(obj.get("id", f"{path.name}:{lineno}")) if isinstance(obj, dict) else None
        if isinstance(obj, dict) and isinstance(obj.get("input_ids"), list):
            ids = obj["input_ids"]
            if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise HstraceError(
                    f"{path}:{lineno}: input_ids must be non-empty non-negative ints"
                )
            prompts.append(Prompt(input_ids=tuple(ids), source_id=source_id))
        elif isinstance(obj, dict) and isinstance(obj.get("text", obj.get("prompt")), str):
            prompts.append(Prompt(text=obj.get("text", obj.get("prompt")), source_id=source_id))
        else:
            raise HstraceError(f"{path}:{lineno}: expected an object with input_ids or text")
    if not prompts:
        raise HstraceError(f"prompts file {path} holds no prompts")
    return prompts


def load_prompts_from_training(directory: Path, samples: int) -> list[Prompt]:
    """The first `samples` training samples' token ids, sent as-is (no chat template, no
    tokenizer), so the serving trace lines up token for token with the training dump."""
    try:
        from hstrace.training import open_training
    except ImportError as exc:  # the training readers are another room's module
        raise TrainingDataError(
            "--prompts-from needs hstrace.training, missing in this build"
        ) from exc
    data = open_training(directory)
    prompts: list[Prompt] = []
    for index, sample in enumerate(data):
        if index >= samples:
            break
        ids = sample["input_ids"] if isinstance(sample, dict) else sample.input_ids
        flat = [int(t) for t in (ids.reshape(-1).tolist() if hasattr(ids, "reshape") else ids)]
        prompts.append(Prompt(input_ids=tuple(flat), source_id=f"{directory.name}:{index}"))
    if not prompts:
        raise TrainingDataError(f"training directory {directory} holds no samples")
    return prompts
