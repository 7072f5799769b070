"""Prompts for `hstrace record`: a JSONL file, or training samples' token ids sent as-is.

Library code (the CLI, the engines' tests and the bundle pipeline use it), so it lives below the
command layer: nothing imports a command module.
"""

from __future__ import annotations

import json
from pathlib import Path

from hstrace.engines.base import SAMPLING_PARAMS, Prompt, SamplingValue, sampling_value
from hstrace.errors import HstraceError, TrainingDataError


def load_prompts_jsonl(path: Path) -> list[Prompt]:
    """One JSON object per line (blank lines skipped), exactly one of:
    `prompt` / `text` (str), `prompt_token_ids` / `input_ids` (non-empty list of non-negative
    ints, sent as-is), `messages` (non-empty list of `{"role": str, "content": str}`: the chat
    API); optional `sampling` (an object of `SAMPLING_PARAMS`) and `id`. A bad line raises
    `HstraceError` naming the file, the line and what is wrong (`record` exits 2)."""
    prompts: list[Prompt] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise HstraceError(f"cannot read prompts file {path}: {why}") from exc
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise HstraceError(f"{where}: not valid JSON ({exc.msg})") from exc
        if not isinstance(obj, dict):
            raise HstraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        prompts.append(_prompt_of(obj, where, str(obj.get("id", f"{path.name}:{lineno}"))))
    if not prompts:
        raise HstraceError(f"prompts file {path} holds no prompts")
    return prompts


_INPUTS = ("prompt", "text", "prompt_token_ids", "input_ids", "messages")


def _prompt_of(obj: dict, where: str, source_id: str) -> Prompt:
    given = [k for k in _INPUTS if k in obj]
    if len(given) != 1:
        said = f"got {', '.join(given)}" if given else "got none"
        raise HstraceError(
            f"{where}: expected exactly one of prompt, prompt_token_ids or messages ({said})"
        )
    key, value = given[0], obj[given[0]]
    sampling = _sampling_of(obj.get("sampling"), where)
    if key in ("prompt", "text"):
        if not isinstance(value, str):
            raise HstraceError(f"{where}: {key} must be a string")
        return Prompt(text=value, source_id=source_id, sampling=sampling)
    if key in ("prompt_token_ids", "input_ids"):
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
        ):
            raise HstraceError(f"{where}: {key} must be a non-empty list of non-negative ints")
        return Prompt(input_ids=tuple(value), source_id=source_id, sampling=sampling)
    if not isinstance(value, list) or not value:
        raise HstraceError(f"{where}: messages must be a non-empty list of {{role, content}}")
    turns = []
    for j, m in enumerate(value):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise HstraceError(
                f"{where}: messages[{j}] must be an object with string role and content"
            )
        turns.append((m["role"], m["content"]))
    return Prompt(messages=tuple(turns), source_id=source_id, sampling=sampling)


def _sampling_of(value: object, where: str) -> tuple[tuple[str, SamplingValue], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise HstraceError(f"{where}: sampling must be an object")
    out = []
    for k, v in value.items():
        if k not in SAMPLING_PARAMS:
            raise HstraceError(
                f"{where}: unknown sampling parameter {k!r} (known: {', '.join(SAMPLING_PARAMS)})"
            )
        try:
            out.append((k, sampling_value(k, v)))
        except ValueError as exc:
            raise HstraceError(f"{where}: sampling.{k} {exc}") from None
    return tuple(out)


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
