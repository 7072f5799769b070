"""The reference engine: the EAGLE-3 greedy chain on CPU, an HF target and the reference drafter.

It writes the same trace schema as the SGLang hooks, so `hstrace replay` reads either. With no
knobs set it is what a correctly wired engine does, which also tells users what acceptance a
drafter should get on their prompts. Each knob reproduces one engine behaviour seen in the
field (`ReferenceKnobs`); the tests use them to build traces with exactly one fault.

One round per request: the target verifies [last token, d1..dK] (greedy), the drafter extends
over the committed rows, then drafts K tokens from the last row. Forwards are recomputed over
the whole committed sequence each round (no KV cache): slower, and obviously correct.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hstrace._version import __version__
from hstrace.drafter.vocab import DIRECT_TABLE, NO_MAP, OFFSETS, map_draft_ids
from hstrace.engines.base import Engine, EngineConfig, Prompt, RecordOptions, RecordResult
from hstrace.errors import CheckpointError, EngineError, HstraceError, TraceError
from hstrace.reference.step0 import threads_for
from hstrace.trace.schema import MODE_PREFILL, MODE_VERIFY, request_key

TOPK = 8  # top-k recorded per draft row


@dataclass(frozen=True)
class ReferenceKnobs:
    """Engine behaviours to reproduce. Defaults = a correctly wired engine."""

    # Aux capture: HF hidden_states indices to capture (None: the drafter's configured ids,
    # read in `capture_convention`, or the default physical layers if it has none).
    capture_layers: tuple[int, ...] | None = None
    # How the engine reads the drafter's aux ids: "auto" (the dialect's own convention),
    # "before_layer" (vLLM) or "output_of_layer" (SGLang explicit ids, +1).
    capture_convention: str = "auto"
    default_layers: bool = False  # ignore configured ids, capture [2, N//2, N-3]
    aux_order: tuple[int, ...] | None = None  # concatenate the slots in this order
    corrupt: str | None = None  # "zeros" | "constant" | "other-request"
    target_noise: float = 0.0  # relative noise on captured states (a quantised target)
    skip_fc: bool = False  # deliver one H-wide state (the final one); the drafter skips fc
    # Drafter weights / flags as the engine loads them.
    drop_weights: str | None = None  # checkpoint key prefix the engine fails to load
    norm_flags: dict[str, bool] = field(default_factory=dict)
    rope_theta: float | None = None
    sliding_window: int | None = None
    # The token embedding: None = as engines do (the checkpoint's own if it saved one, else the
    # target's: SpecForge/EAGLE checkpoints carry none); True = always the target's (SGLang).
    embed_from_target: bool | None = None
    # Vocab mapping.
    d2t_as_table: bool = False
    no_vocab_map: bool = False
    # Draft inputs.
    token_shift: int = 0  # aux row t is fed with token t+1+shift
    position_shift: int = 0
    # Prefix caching (radix-cache like): a prompt whose leading tokens an earlier request
    # committed is prefilled only for its uncached suffix (target and draft-extend rows at
    # their true positions; `requests.n_cached` says how many were cached).
    prefix_cache: bool = False
    # The drafter's KV over a cache hit's cached span: None = rebuilt right; "zeros" = computed
    # from zero states (never restored, sglang PR #19897 / #16964, vllm#41838).
    draft_kv_stale: str | None = None
    # Chunked prefill: prompts are prefilled in chunks of this many tokens, one target step and
    # one draft-extend step per chunk (the seam row gets the next chunk's first prompt token).
    chunked_prefill_size: int | None = None
    # A simulated-acceptance switch (SGLang SGLANG_SIMULATE_ACC_LEN): every verify accepts
    # this many drafts whatever the target says; the static audit records the switch.
    simulate_accept_len: int | None = None
    # Speculative settings as the user gave them; adjusted like SGLang (topk=1 -> steps+1).
    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int | None = None

    @classmethod
    def names(cls) -> list[str]:
        return sorted(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ReferenceKnobs:
        names = cls.names()
        unknown = sorted(set(extra) - set(names))
        if unknown:
            raise EngineError(
                f"unknown reference-engine knob(s) {unknown}; known: {', '.join(names)}"
            )
        for key, value in extra.items():
            _check_knob_type(key, value)
        values = dict(extra)
        for key in ("capture_layers", "aux_order"):
            if values.get(key) is not None:
                values[key] = tuple(int(v) for v in values[key])
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        return {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()
        }


def _knob_kind(name: str) -> str:
    """The annotation of a knob, as written (this module uses postponed annotations)."""
    return str(next(f.type for f in dataclasses.fields(ReferenceKnobs) if f.name == name))


def _check_knob_type(name: str, value: Any) -> None:
    """A knob value of the wrong type would only fail deep inside the chain (or silently
    change nothing): refuse it up front, naming the knob and the type it takes."""
    kind = _knob_kind(name)
    if value is None and "None" in kind:
        return
    ok = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "tuple": isinstance(value, (list, tuple))
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value),
        "dict": isinstance(value, dict) and all(isinstance(v, bool) for v in value.values()),
    }[kind.split("[")[0].split(" ")[0]]
    if not ok:
        raise EngineError(f"reference-engine knob {name} takes {kind}, got {value!r}")


def parse_knob(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` from `hstrace record --knob`: VALUE is JSON (`true`, `3`, `[2, 4, 5]`,
    `{"feed_normed": true}`); a bare word is taken as a string for the string knobs
    (`corrupt=zeros`)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise EngineError(
            f"--knob {text!r}: expected KEY=VALUE; knobs: {', '.join(ReferenceKnobs.names())}"
        )
    if key not in ReferenceKnobs.names():
        raise EngineError(
            f"--knob {key}: unknown reference-engine knob; knobs: {', '.join(ReferenceKnobs.names())}"
        )
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        if not _knob_kind(key).startswith("str"):
            raise EngineError(f"--knob {key}={raw}: not a JSON value ({exc.msg})") from None
        value = raw
    _check_knob_type(key, value)
    return key, value


# Still read for scripts written before `hstrace record --knob` (a JSON object of knobs);
# `EngineConfig.extra` (which --knob fills) overrides it key by key.
KNOBS_ENV = "HSTRACE_REFERENCE_KNOBS"


def knobs_of(config: EngineConfig) -> ReferenceKnobs:
    raw = os.environ.get(KNOBS_ENV, "").strip()
    from_env: dict[str, Any] = {}
    if raw:
        try:
            from_env = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise EngineError(f"{KNOBS_ENV} is not valid JSON ({exc.msg})") from exc
        if not isinstance(from_env, dict):
            raise EngineError(f"{KNOBS_ENV} must be a JSON object of knobs")
    try:
        return ReferenceKnobs.from_extra({**from_env, **config.extra})
    except TypeError as exc:
        raise EngineError(f"bad reference-engine knob value: {exc}") from exc


class ReferenceEngine(Engine):
    name = "reference"

    def check_supported(self) -> str:
        try:
            import transformers  # noqa: F401
        except ImportError as exc:
            raise EngineError(
                "the reference engine needs transformers (pip install 'hstrace[reference]')"
            ) from exc
        for what, path in (("--target", self.config.target), ("--drafter", self.config.drafter)):
            if path is None:
                raise EngineError(f"the reference engine needs {what} DIR")
            if not Path(path).is_dir():
                raise EngineError(f"{what} {path}: not a directory")
        knobs_of(self.config)
        return __version__

    def record(self, prompts: Sequence[Prompt], out: Path, options: RecordOptions) -> RecordResult:
        from hstrace.trace import TraceWriter, create_trace

        knobs = knobs_of(self.config)
        chain = ReferenceChain(Path(self.config.target), Path(self.config.drafter), knobs)
        for p in prompts:
            if p.input_ids is None:
                raise HstraceError(
                    "the reference engine has no tokenizer: give prompts as input_ids"
                )
            if max(p.input_ids) >= chain.vocab_size:
                raise HstraceError(
                    f"prompt {p.source_id}: token id {max(p.input_ids)} >= target vocab {chain.vocab_size}"
                )
        create_trace(
            out,
            engine={"name": "reference", "version": __version__},
            command_line=["hstrace", "record", "--engine", "reference"],
            static=chain.static_audit(),
        )
        writer = TraceWriter(out, rank=0, process=False)
        metrics: list[dict[str, Any]] = []
        error: str | None = None
        try:
            with threads_for(chain.target.hidden_size):
                for i, prompt in enumerate(prompts):
                    rid = prompt.source_id or f"req-{i}"
                    metrics.append(
                        chain.run(
                            rid,
                            list(prompt.input_ids or ()),
                            options.max_new_tokens,
                            writer,
                            options,
                        )
                    )
        except TraceError as exc:  # the disk refused (full, read-only): the run failed
            error = str(exc)
        finally:
            try:
                writer.close()
            except TraceError as exc:
                error = error or str(exc)
        return RecordResult(
            out=out,
            engine="reference",
            engine_version=__version__,
            prompts_sent=len(prompts),
            prompts_completed=len(metrics),
            ok=error is None,
            error=error,
            request_metrics=metrics,
        )


class ReferenceChain:
    """The greedy EAGLE-3 chain with the knobs applied; writes one request at a time."""

    def __init__(self, target_dir: Path, drafter_dir: Path, knobs: ReferenceKnobs) -> None:
        from hstrace.drafter import load_drafter
        from hstrace.reference.target import ReferenceTarget
        from hstrace.training.conventions import default_hf_indices, hf_index

        self.knobs = knobs
        if knobs.draft_kv_stale not in (None, "zeros"):
            raise EngineError(
                f"reference-engine knob draft_kv_stale takes null or 'zeros', got {knobs.draft_kv_stale!r}"
            )
        self.target = ReferenceTarget(target_dir)
        self.target_dir, self.drafter_dir = target_dir, drafter_dir
        try:
            drafter, self.report = load_drafter(drafter_dir)
        except CheckpointError:
            raise
        self.trained = drafter.eval()
        self.vocab_size = int(self.target.model.config.vocab_size)
        n = self.target.num_layers
        self.num_steps = int(knobs.num_steps)
        cfg = drafter.cfg
        if knobs.capture_layers is not None:
            layers = list(knobs.capture_layers)
        elif knobs.default_layers or not cfg.aux_layer_ids:
            layers = default_hf_indices(n)
        else:
            convention = knobs.capture_convention
            if convention == "auto":
                convention = _dialect_convention(self.report)
            layers = [hf_index(i, convention) for i in cfg.aux_layer_ids]
        # Captures happen inside the decoder loop, so they come out in layer order.
        self.layers = sorted(layers)
        if knobs.aux_order is not None:
            self.layers = [self.layers[j] for j in knobs.aux_order]
        self.engine_drafter, self.weights_audit = self._engine_drafter(drafter)
        self.d2t = drafter.d2t.clone()
        # How this engine reads d2t (`hstrace.drafter.vocab`): offsets unless a knob misreads it.
        self.d2t_reading = (
            NO_MAP if knobs.no_vocab_map else DIRECT_TABLE if knobs.d2t_as_table else OFFSETS
        )
        self.prev_aux: torch.Tensor | None = None
        self.noise = torch.Generator().manual_seed(1234)
        self.cached: list[list[int]] = []  # committed sequences of earlier requests (the cache)

    # -- the drafter as the engine loaded it --------------------------------------------------
    def _engine_drafter(self, drafter: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, Any]]:
        from hstrace.drafter import Eagle3Drafter

        k = self.knobs
        changes: dict[str, Any] = dict(k.norm_flags)
        if k.rope_theta is not None:
            changes["rope_theta"] = float(k.rope_theta)
        if k.sliding_window is not None:
            changes["sliding_window"] = int(k.sliding_window)
        if k.skip_fc:  # the drafter's fault option: the one state delivered passes fc by
            changes["skip_fc"] = True
        cfg = dataclasses.replace(drafter.cfg, **changes)
        torch.manual_seed(0)  # parameters the engine never loads keep a fixed "init"
        model = Eagle3Drafter(cfg)
        state = drafter.state_dict()
        dropped = [n for n in state if k.drop_weights and n.startswith(k.drop_weights)]
        missing, _unexpected = model.load_state_dict(
            {n: v for n, v in state.items() if n not in dropped}, strict=False
        )
        from_target = k.embed_from_target
        if from_target is None:
            from_target = "embed_tokens.weight" in getattr(self.report, "missing", ())
        if from_target:
            model.embed_tokens.weight.data.copy_(self.target.embed.detach())
        params = [n for n, _ in model.named_parameters()]
        audit = {
            "checkpoint_keys": {n: {"shape": list(v.shape)} for n, v in state.items()},
            "parameters": {p: p not in missing for p in params},
            "dropped_keys": dropped,
            "unloaded_parameters": [p for p in params if p in missing],
            "shared_from_target": ["embed_tokens.weight"] if from_target else [],
        }
        return model.eval(), audit

    def static_audit(self) -> dict[str, Any]:
        from hstrace.engines.sglang.audit import aux_layer_source, fc_width, spec_settings

        k = self.knobs
        cfg = self.trained.cfg
        on_disk = _read_json(self.drafter_dir / "config.json")
        raw = {"num_steps": k.num_steps, "topk": k.topk, "num_draft_tokens": k.num_draft_tokens}
        effective = dict(raw)
        if k.topk == 1:
            effective["num_draft_tokens"] = k.num_steps + 1
        settings = spec_settings(raw, effective)
        hot = self._map(torch.arange(cfg.draft_vocab_size))
        delivered = 1 if k.skip_fc else len(self.layers)
        return {
            "engine_version": __version__,
            # Paths as the user gave them (relative paths keep a committed example portable).
            "target": {
                "path": str(self.target_dir),
                "num_layers": self.target.num_layers,
                "hidden_size": self.target.hidden_size,
                "vocab_size": self.vocab_size,
            },
            "drafter": {
                "path": str(self.drafter_dir),
                "dialect": getattr(self.report, "dialect", None),
            },
            "draft_config": on_disk,
            "aux_layer_ids": list(cfg.aux_layer_ids or []),
            "aux_layers": aux_layer_source(on_disk),
            "capture": {
                "layers_to_capture": sorted(self.layers),
                "capture_order": list(self.layers),
                "num_captures": delivered,
                "convention": "hf_hidden_states_index",
            },
            "fc_width": fc_width(cfg.num_aux * cfg.aux_width, self.target.hidden_size, delivered),
            "hot_token_id": {
                "size": int(hot.numel()),
                "head": hot[:16].tolist(),
                "is_identity": bool((hot == torch.arange(hot.numel())).all()),
            },
            "weights": self.weights_audit,
            "spec": {**effective, **settings},
            **(
                {
                    "acceptance_simulation": {
                        "enabled": True,
                        "settings": {
                            "SGLANG_SIMULATE_ACC_LEN": k.simulate_accept_len,
                            "SGLANG_SIMULATE_ACC_METHOD": "fixed",
                        },
                        "source": "reference engine knob simulate_accept_len",
                    }
                }
                if k.simulate_accept_len is not None
                else {}
            ),
            "prefix_cache": {"enabled": bool(k.prefix_cache)},
            **(
                {"chunked_prefill_size": int(k.chunked_prefill_size)}
                if k.chunked_prefill_size
                else {}
            ),
            # Provenance for people only: replay never reads it (it must find faults from data).
            "reference_knobs": k.to_json(),
        }

    # -- pieces --------------------------------------------------------------------------------
    def _map(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return map_draft_ids(draft_ids, self.d2t, self.d2t_reading, self.vocab_size)

    def _capture(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [T, K*H] as the drafter receives it, target greedy next ids [T])."""
        fwd = self.target.forward(ids)
        k = self.knobs
        if k.skip_fc:
            aux = fwd.layers[:, -1:]  # the one state an EAGLE (not EAGLE3) target returns
        else:
            aux = fwd.layers[:, self.layers].clone()
        if k.target_noise:
            scale = aux.pow(2).mean(-1, keepdim=True).sqrt() * k.target_noise
            aux = aux + scale * torch.randn(aux.shape, generator=self.noise)
        if k.corrupt == "zeros":
            aux = torch.zeros_like(aux)
        elif k.corrupt == "constant":
            aux = aux[:1].expand_as(aux).clone()
        elif k.corrupt == "other-request" and self.prev_aux is not None:
            n = min(len(aux), len(self.prev_aux))
            aux[:n] = self.prev_aux[:n]
        return aux.flatten(1).to(torch.bfloat16), fwd.logits.argmax(-1)

    def _draft_inputs(self, seq: torch.Tensor, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and positions fed with aux rows 0..upto-1 (token t+1 for row t)."""
        s = self.knobs.token_shift
        idx = (torch.arange(upto) + 1 + s).clamp(0, len(seq) - 1)
        return seq[idx], torch.arange(upto) + self.knobs.position_shift

    @torch.inference_mode()
    def _draft(
        self, seq: torch.Tensor, aux: torch.Tensor, cached: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step 0 over every committed row, then the chain from the last row. Returns step-0
        logits [T, Vd], the chain's draft ids [K], their logits [K, Vd], and the hidden state
        fed into each step k >= 1 at the chain's row [K-1, H] (what the engine feeds back).
        `cached`: rows of a prefix-cache hit's cached span (their KV came from the cache)."""
        T = aux.shape[0]
        ids, pos = self._draft_inputs(seq, T)
        aux = aux.float()
        if cached and self.knobs.draft_kv_stale == "zeros":
            aux = aux.clone()
            aux[:cached] = 0.0  # the cache never held the drafter's KV for this span
        out = self.engine_drafter(ids, aux, positions=pos)
        step0 = out.logits
        drafts, logits, fed = [int(step0[-1].argmax())], [step0[-1]], []
        for _ in range(1, self.num_steps):
            nxt = self._map(torch.tensor([drafts[-1]]))[0]
            ids_k = torch.full((T,), int(nxt), dtype=torch.long)
            fed.append(out.hidden[-1])
            out = self.engine_drafter.step(ids_k, out.hidden, out.cache)
            drafts.append(int(out.logits[-1].argmax()))
            logits.append(out.logits[-1])
        H = self.trained.cfg.hidden_size
        fed_in = torch.stack(fed) if fed else torch.empty(0, H)
        return step0, torch.tensor(drafts), torch.stack(logits), fed_in

    # -- one request ---------------------------------------------------------------------------
    def run(
        self, rid: str, prompt: list[int], max_new: int, w: Any, options: RecordOptions
    ) -> dict[str, Any]:
        key = request_key(rid)
        streams = options.streams
        seq = torch.tensor(prompt, dtype=torch.long)
        rid_bytes = torch.tensor(list(rid.encode("utf-8")), dtype=torch.uint8)
        n_cached = self._cached_prefix(prompt) if self.knobs.prefix_cache else 0
        if "requests" in streams:
            req_cols: dict[str, Any] = {
                "req_key": [key],
                "n_prompt": [len(prompt)],
                "rid_len": [len(rid_bytes)],
            }
            if self.knobs.prefix_cache:
                req_cols["n_cached"] = [n_cached]
            w.write("requests", req=req_cols, tok={"prompt_ids": seq}, rid={"bytes": rid_bytes})
        # Prefill: the target over the uncached prompt suffix (in chunks when chunked), then a
        # draft extend over the same rows. The forward is recomputed over the whole prompt:
        # the cached span's states are exactly what the cache was filled with.
        aux, nxt = self._capture(seq)
        chunks = self._chunks(n_cached, len(seq))
        if "target" in streams:
            for a, b in chunks:
                rows = torch.arange(a, b)
                self._write_target(w, key, MODE_PREFILL, seq[rows], rows, aux[rows])
        seq = torch.cat([seq, nxt[-1:]])
        committed_aux = aux  # aux rows of the committed positions, 0..len(seq)-2
        new_tokens, rounds, accepted_total = 1, 0, 0
        extend_from = n_cached
        while new_tokens < max_new:
            step0, drafts, chain_logits, fed_in = self._draft(seq, committed_aux, n_cached)
            if "draft_extend" in streams:
                spans = chunks if rounds == 0 else [(extend_from, committed_aux.shape[0])]
                for a, b in spans:
                    self._write_draft(w, "draft_extend", key, seq, committed_aux[:b], step0[:b], a)
            if "draft_step" in streams:
                self._write_chain(w, key, seq, drafts, chain_logits, fed_in)
            # Verify [last committed token, d1..dK] with the target, greedily.
            proposed = self._map(drafts)
            verify_ids = torch.cat([seq, proposed])
            aux_v, argmax_v = self._capture(verify_ids)
            p0 = len(seq) - 1
            rows = torch.arange(p0, len(verify_ids))
            if "target" in streams:
                self._write_target(w, key, MODE_VERIFY, verify_ids[rows], rows, aux_v[rows])
            accept = 0
            while accept < len(proposed) and int(argmax_v[p0 + accept]) == int(proposed[accept]):
                accept += 1
            if self.knobs.simulate_accept_len is not None:  # the switch overrides the target
                accept = min(len(proposed), max(0, int(self.knobs.simulate_accept_len)))
            bonus = int(argmax_v[p0 + accept])
            if "verify" in streams:
                w.write(
                    "verify",
                    req={
                        "req_key": [key],
                        "accept_len": [accept],
                        "bonus_id": [bonus],
                        "n_proposed": [len(proposed)],
                        "n_accepted": [accept],
                    },
                    proposed={"ids": proposed},
                    accepted={"ids": proposed[:accept]},
                )
            seq = torch.cat([seq, proposed[:accept], torch.tensor([bonus])])
            # The rows this round committed (the verified token and the accepted drafts) get
            # their aux now; the drafter extends over them at the next round.
            committed_aux = torch.cat([committed_aux, aux_v[p0 : p0 + 1 + accept]])
            extend_from = p0
            new_tokens += accept + 1
            rounds += 1
            accepted_total += accept
        if self.knobs.corrupt == "other-request":
            self.prev_aux = self.target.forward(seq).layers[:, self.layers].clone()
        # The committed sequence minus its last token (which has no KV yet) stays cached.
        self.cached.append(seq[:-1].tolist())
        return {
            "rid": rid,
            "completion_tokens": new_tokens,
            "verify_rounds": rounds,
            "accept_length_mean_excl_bonus": accepted_total / rounds if rounds else 0.0,
        }

    def _cached_prefix(self, prompt: list[int]) -> int:
        """Cached prompt positions, as SGLang's radix cache counts them for EAGLE (bigram
        keys: position i is reused only when tokens i and i+1 both match, because the draft
        KV at i was computed with token i+1), so a cache hit of c positions needs c+1 equal
        leading tokens. At least one prompt token is always prefilled, as engines do."""
        best = 0
        for other in self.cached:
            n = 0
            for a, b in zip(prompt, other, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n - 1)
        return max(0, min(best, len(prompt) - 1))

    def _chunks(self, start: int, stop: int) -> list[tuple[int, int]]:
        size = self.knobs.chunked_prefill_size
        if not size or size <= 0:
            return [(start, stop)]
        return [(a, min(a + size, stop)) for a in range(start, stop, size)]

    # -- writers -------------------------------------------------------------------------------
    def _write_target(self, w: Any, key: int, mode: int, ids, positions, aux) -> None:
        w.write(
            "target",
            step={"mode": mode},
            req={"req_key": [key], "n_tok": [len(ids)]},
            tok={"input_ids": ids, "positions": positions, "aux_hidden": aux},
            column_attrs={
                "tok/aux_hidden": {
                    "layer_ids": list(self.layers),
                    "layer_id_convention": "hf_hidden_states_index",
                    "slot_width": self.target.hidden_size,
                }
            },
        )

    def _topk(self, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = logits.float()
        top = logits.topk(min(TOPK, logits.shape[-1]), dim=-1)
        lse = torch.logsumexp(logits, dim=-1)
        return {
            "topk_draft_ids": top.indices,
            "topk_target_ids": self._map(top.indices),
            "topk_logprobs": top.values - lse[:, None],
            "lse": lse,
        }

    def _write_draft(self, w, table, key, seq, aux, step0, start) -> None:
        T = aux.shape[0]
        ids, pos = self._draft_inputs(seq, T)
        rows = slice(start, T)
        w.write(
            table,
            req={"req_key": [key], "n_tok": [T - start]},
            tok={
                "input_ids": ids[rows],
                "positions": pos[rows],
                "hidden_in": aux[rows],
                **self._topk(step0[rows]),
            },
        )

    def _write_chain(self, w, key, seq, drafts, chain_logits, fed_in) -> None:
        for k in range(1, len(drafts)):
            prev = self._map(drafts[k - 1 : k])
            w.write(
                "draft_step",
                step={"step_index": k},
                req={"req_key": [key], "n_tok": [1]},
                tok={
                    "input_ids": prev,
                    "positions": torch.tensor([len(seq) - 2 + k + self.knobs.position_shift]),
                    "hidden_in": fed_in[k - 1 : k].to(torch.bfloat16),
                    **self._topk(chain_logits[k : k + 1]),
                },
            )


def _dialect_convention(report: Any) -> str:
    from hstrace.drafter.dialects import DIALECT_CONVENTION
    from hstrace.training.conventions import BEFORE_LAYER

    return DIALECT_CONVENTION.get(str(getattr(report, "dialect", "")), BEFORE_LAYER)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
