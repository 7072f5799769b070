"""The engine interface, written down once: what hstrace knows about one serving engine.

Each engine is one package, `hstrace/engines/<name>/`, whose `__init__.py` holds `SPEC`, an
`EngineSpec`; the registry (`hstrace.engines.registry.ENGINES`) lists them by name. Everything
outside the package asks the spec, never a string literal: the CLI (which engines exist, how a
server command is recognised, which version to judge for), the bootstrap (the versions and the
hooks module), the rules (where the engine reads the aux-id key, whether it loads a layout as it
is), diagnose (which flag turns the prefix cache off, how to write the aux ids for it).

An engine with hooks also has a taps module conforming to `EngineTaps` (pure row building from
the engine's own objects) and a patches module under `hstrace/hooks/` (`<name>_patches`: its
`WRAPPERS` and `install`). `tests/conformance/test_engines.py` holds one subclass per engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from hstrace.engines.rows import TableWrite
from hstrace.engines.support import EngineSupport


@runtime_checkable
class EngineTaps(Protocol):
    """The pure row builders every engine with hooks has (`hstrace.engines.<name>.taps`). Their
    arguments are the engine's own objects (an SGLang batch, a vLLM step), so only the names and
    what they return are common: `requests_rows` -> one `requests` row per new request (or None),
    `verify_rows` -> the `verify` rows of one verify step, `draft_topk` -> the draft top-k
    columns mapped to target ids the way that engine maps them."""

    def requests_rows(self, *args: Any, **kwargs: Any) -> TableWrite | None: ...

    def verify_rows(self, *args: Any, **kwargs: Any) -> TableWrite | list[TableWrite]: ...

    def draft_topk(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...


class EngineSpec(ABC):
    """One engine. Class attributes are data; methods are the engine's own reading of a drafter
    config. `aux_layer_source` returns at least the keys documented there."""

    name: ClassVar[str]  # registry key, `--engine` value, the trace's `engine.name`
    label: ClassVar[str]  # the engine's name in messages
    adapter: ClassVar[str]  # "module:Class" of its `Engine` (the launcher side), loaded lazily
    # Versions and patch table (`EngineSupport`); None for an engine without hooks (reference).
    support: ClassVar[EngineSupport | None] = None
    taps: ClassVar[str | None] = None  # module of its `EngineTaps`
    patches: ClassVar[str | None] = None  # hooks module: `WRAPPERS`, `install(version, cfg)`
    # `hstrace check` judges drafters for it (a serving engine, not the reference)
    judged: ClassVar[bool] = True
    # The command-line flag(s) that turn its prefix cache off (None: it has none).
    prefix_cache_off: ClassVar[str | None] = None
    prefix_cache_off_note: ClassVar[str] = ""  # what else to leave off with it, in parentheses
    # Where in the draft config.json it reads the aux layer ids, first hit wins.
    aux_ids_keys: ClassVar[tuple[str, ...]] = ()
    # The server flags (prefixes) that turn speculative decoding on, each with its value
    # (`record --parity` runs the same command without them).
    speculation_flags: ClassVar[tuple[str, ...]] = ()

    # ---- versions -------------------------------------------------------------------------

    def installed_version(self) -> str | None:
        """The engine's version in this Python, or None."""
        return self.support.installed_version() if self.support is not None else None

    @property
    def default_version(self) -> str | None:
        """The release judged for when none is installed: the newest the patch table covers."""
        if self.support is None:
            return None
        return ".".join(map(str, self.support.max_supported))

    def judged_version(self) -> str | None:
        return self.installed_version() or self.default_version

    # ---- the launcher ---------------------------------------------------------------------

    def serves(self, argv: Sequence[str]) -> bool:
        """Whether a server command line runs this engine (`hstrace record` without --engine)."""
        return False

    def without_speculation(self, argv: Sequence[str]) -> list[str]:
        """The server command with speculative decoding off: every `speculation_flags` flag
        dropped with its value (`--flag value` or `--flag=value`). Raises ValueError when the
        command has none (it does not speculate)."""
        out: list[str] = []
        dropped = False
        skip_value = False
        for word in argv:
            if skip_value:
                skip_value = False
                if not word.startswith("--"):
                    continue
            if word.startswith(self.speculation_flags):
                dropped = True
                skip_value = "=" not in word
                continue
            out.append(word)
        if not dropped:
            flags = ", ".join(
                f + ("..." if f.endswith("-") else "") for f in self.speculation_flags
            )
            raise ValueError(f"the server command has no speculative-decoding flag ({flags})")
        return out

    # ---- how it reads a drafter -------------------------------------------------------------

    def cannot_load(self, dialect: str, config: Mapping[str, Any]) -> str | None:
        """Why it cannot load a checkpoint of this dialect as it is (None: it can)."""
        return None

    @abstractmethod
    def aux_layer_source(
        self, draft_config: Mapping[str, Any], n_layers: int | None = None
    ) -> dict[str, Any]:
        """Where it reads the aux layer ids in `draft_config`. At least: `source` (the key read,
        or why none), `read` (the ids it reads, in its own convention, or None: its default),
        `top_level_ids`, `configured`."""

    @abstractmethod
    def aux_ids_fix(self, hf_ids: Sequence[int]) -> str:
        """What to write in the draft config.json so that it captures HF hidden_states `hf_ids`."""

    @abstractmethod
    def spec_settings(self, raw: Mapping[str, Any], effective: Mapping[str, Any]) -> dict[str, Any]:
        """num_steps / topk / num_draft_tokens as asked (`raw`) and as served (`effective`):
        `{"raw", "effective", "adjusted"}` (adjusted: name -> {"user", "effective"})."""

    def spec_facts(self, settings: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Audit facts on `spec_settings`'s answer ("spec-adjusted" where the engine changes the
        settings it was given; `hstrace.findings.from_fact` names the code); none by default."""
        return []
