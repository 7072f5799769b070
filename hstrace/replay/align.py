"""Stage align (entries `align`, then `Alignment.build`): serving requests next to training
samples, and the slot views both sides are compared on.

Three parts, in the order a replay uses them: the pure matching by token ids (`align`), the
ids-redacted bundle's hashes turned back into ids (`recover_ids`, before matching), and the
`Alignment` every piece of evidence is computed from.

Pair serving requests with training samples by their token ids (pure; no I/O).
A request with no training twin (real traffic: the user's own prompts) gets a reference twin
when the target model is at hand (`reference_twins`): the target run on the served tokens, its
states taken at the layers the drafter config names, as training would have fed the drafter.

A serving request is aligned with the training sample that shares the longest common prefix of
token ids with it. `exact`: the two sequences are identical. `prefix`: they share at least
`min_tokens` leading tokens (typically the prompt; a served generation then drifts from the
dataset's response). Only the common prefix is compared afterwards.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hstrace.redaction import RedactedIdsError, hash_token_ids
from hstrace.replay.read import ServingData, ServingRequest

# -- align -------------------------------------------------------------------------------------
# Fewer shared leading tokens than this is a coincidence, not the same text.
DEFAULT_MIN_TOKENS = 8


@dataclass(frozen=True)
class Match:
    serving: int  # index into the serving sequences
    training: int  # index into the training sequences
    kind: str  # "exact" | "prefix" | "target" (a reference twin, `reference_twins`)
    length: int  # tokens in the common prefix: the ones compared


@dataclass(frozen=True)
class Coverage:
    serving_requests: int
    aligned_requests: int
    exact: int
    prefix: int
    serving_tokens: int
    aligned_tokens: int
    training_samples: int
    training_samples_matched: int
    # Requests with no training twin judged against a reference twin (`reference_twins`).
    target_twins: int = 0
    target_twin_tokens: int = 0

    @property
    def token_fraction(self) -> float:
        return self.aligned_tokens / self.serving_tokens if self.serving_tokens else 0.0

    def to_json(self) -> dict[str, int | float]:
        return {
            "serving_requests": self.serving_requests,
            "aligned_requests": self.aligned_requests,
            "exact": self.exact,
            "prefix": self.prefix,
            "serving_tokens": self.serving_tokens,
            "aligned_tokens": self.aligned_tokens,
            "aligned_token_fraction": round(self.token_fraction, 6),
            "training_samples": self.training_samples,
            "training_samples_matched": self.training_samples_matched,
            "target_twins": self.target_twins,
            "target_twin_tokens": self.target_twin_tokens,
        }


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def align(
    serving: Sequence[np.ndarray],
    training: Sequence[np.ndarray],
    min_tokens: int = DEFAULT_MIN_TOKENS,
) -> tuple[list[Match], Coverage]:
    """Best training sample for every serving sequence (longest common prefix, ties to the
    lower index). Candidates come from an index on the first `min_tokens` ids, so the cost is
    linear in the data, not quadratic."""
    index: dict[bytes, list[int]] = defaultdict(list)
    training = [np.asarray(t, dtype=np.int64).reshape(-1) for t in training]
    for j, ids in enumerate(training):
        if len(ids) >= min_tokens:
            index[ids[:min_tokens].tobytes()].append(j)

    matches: list[Match] = []
    serving_tokens = 0
    for i, raw in enumerate(serving):
        ids = np.asarray(raw, dtype=np.int64).reshape(-1)
        serving_tokens += len(ids)
        if len(ids) < min_tokens:
            continue
        best: tuple[int, int] | None = None
        for j in index.get(ids[:min_tokens].tobytes(), ()):
            n = common_prefix(ids, training[j])
            if best is None or n > best[1]:
                best = (j, n)
        if best is None:
            continue
        j, n = best
        exact = n == len(ids) == len(training[j])
        matches.append(Match(serving=i, training=j, kind="exact" if exact else "prefix", length=n))

    coverage = Coverage(
        serving_requests=len(serving),
        aligned_requests=len(matches),
        exact=sum(m.kind == "exact" for m in matches),
        prefix=sum(m.kind == "prefix" for m in matches),
        serving_tokens=serving_tokens,
        aligned_tokens=sum(m.length for m in matches),
        training_samples=len(training),
        training_samples_matched=len({m.training for m in matches}),
    )
    return matches, coverage


# -- reference twins ---------------------------------------------------------------------------
# A served request whose tokens match no training sample still has a "training side": what the
# drafter's training would have fed it on these tokens. Training stores, for a sequence x_0..x_T,
# the target's residual stream h_l(t) at the aux layers l (ascending: every library concatenates
# in layer order) in the target's dtype, and pairs row t with token x_{t+1}. The reference twin
# is exactly that, computed: the reference target (`hstrace.reference.target`) run on the served
# tokens (prompt + committed output, as recorded), h_l(t) taken at the layers the drafter config
# names (in its dialect's id convention), stored as bf16. The pairing and the embedding rows are
# the drafter's own, as for any training sample. Every later stage reads it as a sample.

TWIN_FORMAT = "target-forward"
# The dtype training libraries store the hidden states in (the target's bf16), so a twin is
# compared with serving as a training dump would be.
TWIN_DTYPE = torch.bfloat16


def drafter_aux_layers(cfg: Any, dialect: str | None, num_layers: int) -> tuple[list[int], str]:
    """The HF `hidden_states` indices (0 = embeddings, N = the final stream before the final
    norm) the drafter was trained on, as its config names them, ascending; and where from."""
    from hstrace.drafter.dialects import DIALECT_CONVENTION
    from hstrace.training.conventions import BEFORE_LAYER, default_hf_indices, hf_index

    ids = list(getattr(cfg, "aux_layer_ids", None) or [])
    if ids:
        conv = DIALECT_CONVENTION.get(str(dialect or ""), BEFORE_LAYER)
        layers = sorted(hf_index(int(i), conv) for i in ids)
        return layers, f"the drafter config's ids {ids} ({conv})"
    return default_hf_indices(num_layers), "the libraries' default layers (the config names none)"


def twin_gap(r: ServingRequest) -> str | None:
    """Why a request with recorded aux rows cannot get a reference twin (None: it can)."""
    if r.position_base:
        return (
            "recorded without its first tokens (armed mid-request): the target forward needs "
            "the whole sequence"
        )
    if len(r.tokens) < 3:
        return "fewer than 3 tokens"
    return None


def prompt_length(r: ServingRequest) -> int:
    """Where the request's prompt ends: the end of its last prefill block (0: not recorded)."""
    return max((end for _start, end in r.prefill_chunks), default=0)


def reference_twins(
    requests: Sequence[tuple[int, ServingRequest]],
    target: Any,  # hstrace.reference.target.ReferenceTarget
    layers: list[int],
    first_index: int,
    tick: Any = None,
) -> list[tuple[int, Any, Match]]:
    """(serving index, its twin `TrainingSample`, the match) for each request: the target's
    states h_l(t) at `layers` on the request's own tokens. The twin's `index` counts on from
    `first_index` (after the training samples)."""
    from hstrace.errors import HstraceError
    from hstrace.training import BEFORE_LAYER, TrainingSample

    top = int(target.num_layers)
    if not layers or max(layers) > top or min(layers) < 0:
        # bad input (the drafter was trained on another, deeper model), not a bug in hstrace
        raise HstraceError(
            f"--target {getattr(target, 'path', '?')} has {top} layers (states 0..{top}), "
            f"but the drafter names aux layers {layers}: wrong target?"
        )
    out = []
    for k, (i, r) in enumerate(requests):
        ids = torch.as_tensor(np.asarray(r.tokens)).long()
        states = target.forward(ids).layers  # [T, N+1, H]: h_l(t) for l = 0..N
        sample = TrainingSample(
            index=first_index + k,
            input_ids=ids,
            # the response's tokens, as a chat dataset's loss mask has them: what the engine
            # generated (after its last prefill block), where verified acceptance is measured
            loss_mask=torch.arange(len(ids)) >= prompt_length(r),
            aux=states[:, layers].to(TWIN_DTYPE).contiguous(),
            last=None,  # no stored teacher: the teacher test is the training data's
            last_norm=None,
            slot_layer_ids=list(layers),
            provenance={
                "format": TWIN_FORMAT,
                "layer_id_convention": BEFORE_LAYER,  # HF indices: "after k layers"
                "request": r.name,
            },
        )
        out.append((i, sample, Match(i, first_index + k, "target", len(ids))))
        if tick is not None:
            tick("target forward", len(ids))
    return out


def with_twins(coverage: Coverage, twins: Sequence[tuple[int, Any, Match]]) -> Coverage:
    """`coverage` with the requests judged against a reference twin counted."""
    import dataclasses

    return dataclasses.replace(
        coverage,
        target_twins=len(twins),
        target_twin_tokens=sum(m.length for _, _, m in twins),
    )


# -- sides -------------------------------------------------------------------------------------
# The serving/training alignment every piece of evidence is computed from: which serving
# request lines up with which training sample, how the serving capture is shaped (raw aux rows
# or, for a `--redact hidden` bundle, per-slot sketches: chosen once, here), and the slot views
# of both sides on the aligned tokens.


@dataclass(frozen=True)
class AlignedPair:
    serving: ServingRequest
    sample: Any  # hstrace.training.TrainingSample
    n: int  # aligned positions 0..n-1 (the tokens agree on all of them)
    # Positions start..n-1 have a serving capture (start > 0: a prefix-cache hit, the cached
    # span has none); slot comparisons use these rows only.
    start: int = 0


@dataclass(frozen=True)
class Alignment:
    serving: ServingData
    samples: list[Any]
    matches: list[Match]
    coverage: Coverage
    aligned: list[AlignedPair]
    # "training" (a dump), "trace" (a second trace as the samples) or "target" (no training
    # side: every sample is a reference twin)
    training_kind: str
    # Serving hidden states were redacted; per-slot sketches stand in for them (both sides
    # are then compared as sketches).
    sketched: bool
    sketch_slot_width: int | None  # the slot width the serving sketches were projected from
    serving_width: int | None  # width of the recorded capture (sketched: before redaction)
    slot_width: int | None  # the drafter's aux width, else the training slots' width
    fc_in: int | None  # the drafter's fc input width (num_aux * aux_width)
    # The dtype the target was served in, as the recorded aux rows carry it (a producer
    # writes them as served, docs/trace-format.md); bf16 when nothing says (a bundle's
    # sketches, no aux rows): what engines serve in.
    serving_dtype: torch.dtype

    @classmethod
    def build(
        cls,
        serving: ServingData,
        samples: list[Any],
        matches: list[Match],
        coverage: Coverage,
        cfg: Any,
        training_kind: str = "training",
    ) -> Alignment:
        aligned = []
        for m in matches:
            req, sample = serving.requests[m.serving], samples[m.training]
            n = min(m.length, req.aux_end, int(sample.aux.shape[0]))
            if n > req.aux_start:
                aligned.append(AlignedPair(req, sample, n, start=req.aux_start))
        reqs = serving.requests
        sketched = (
            bool(reqs) and not any(r.has_aux for r in reqs) and any(r.has_sketch for r in reqs)
        )
        w = serving.sketch_attrs.get("slot_width")
        sketch_slot_width = int(w) if w else None
        if cfg is not None:
            slot_width: int | None = int(cfg.aux_width)
        elif samples:
            slot_width = int(samples[0].aux.shape[-1])
        else:
            slot_width = None
        return cls(
            serving=serving,
            samples=samples,
            matches=matches,
            coverage=coverage,
            aligned=aligned,
            training_kind=training_kind,
            sketched=sketched,
            sketch_slot_width=sketch_slot_width,
            serving_width=_serving_width(serving, sketched, sketch_slot_width),
            slot_width=slot_width,
            fc_in=int(cfg.num_aux * cfg.aux_width) if cfg is not None else None,
            serving_dtype=_serving_dtype(serving, sketched),
        )

    def serving_slots_of(self, r: ServingRequest, n: int | None = None) -> torch.Tensor:
        """[m, K, Ht] serving slots of one request up to sequence index n (its captured rows:
        from r.aux_start on), or [m, K, D] sketches when redacted."""
        stop = None if n is None else max(0, n - r.aux_start)
        if self.sketched:
            x = r.sketch_head(stop)
            return x.reshape(len(x), -1, int(self.serving.sketch_attrs.get("sketch_dim", 32)))
        x = r.aux_head(stop).float()
        return x.reshape(len(x), -1, self.slot_width)

    def training_slots_of(self, a: AlignedPair) -> torch.Tensor:
        """[m, Kt, Ht] training slots on the aligned, captured tokens, sketched like serving if
        needed."""
        t = a.sample.aux[a.start : a.n].float()
        return self.sketch(t) if self.sketched else t

    def sketch(self, slots: torch.Tensor) -> torch.Tensor:
        """[N, K, W] -> [N, K, D]: the same seeded projection `hstrace bundle` applied."""
        from hstrace.redaction import sketch_slots

        return sketch_slots(slots).reshape(slots.shape[0], slots.shape[1], -1)


def _serving_width(serving: ServingData, sketched: bool, slot_width: int | None) -> int | None:
    if sketched:
        from hstrace.redaction import SKETCH_DIM

        dim = int(serving.sketch_attrs.get("sketch_dim") or SKETCH_DIM)
        widths = {r.width("aux_sketch") // dim for r in serving.requests if r.has_sketch}
        return widths.pop() * slot_width if len(widths) == 1 and slot_width else None
    widths = {r.width("aux") for r in serving.requests if r.has_aux}
    return widths.pop() if len(widths) == 1 else None


def _serving_dtype(serving: ServingData, sketched: bool) -> torch.dtype:
    if not sketched:
        for r in serving.requests:
            if r.has_aux and r.dtype("aux").is_floating_point:
                return r.dtype("aux")
    return torch.bfloat16


# -- redaction ---------------------------------------------------------------------------------
# Replaying a redacted bundle (`hstrace bundle --redact ids|hidden`, see docs/bundles.md).
#
# `ids`: token ids are salted 63-bit hashes; the drafter cannot embed them. The hash is a pure
# function of (salt, domain, id) over a finite vocabulary, so whoever holds the salt recovers
# every id by hashing the whole vocabulary once and inverting the table; without the salt
# nothing can be replayed (not even alignment with training data, whose ids are in the clear),
# so that is one-line bad input that says what to pass.
#
# `hidden`: the hidden-state columns are gone; the per-slot sketches that replace them still
# fingerprint slots (see `hstrace.replay.slots.Slots`).
#
# What a bundle's redaction says and how its salt is found live in `hstrace.redaction`, shared
# with `hstrace bundle`; this module only turns hashes back into ids.


@dataclass
class IdRecovery:
    """hash -> id tables for the target and the draft vocabularies under one salt."""

    salt: bytes
    tables: dict[str, tuple[np.ndarray, np.ndarray]]  # domain -> (sorted hashes, their ids)

    @classmethod
    def build(cls, salt: bytes, vocab_size: int, draft_vocab_size: int) -> IdRecovery:
        tables = {}
        # -1 is included: engines pad unused top-k entries with it.
        for domain, size in (("target", vocab_size), ("draft", draft_vocab_size)):
            ids = np.arange(-1, size, dtype=np.int64)
            hashes = hash_token_ids(ids, salt, domain=domain)
            order = np.argsort(hashes)
            tables[domain] = (hashes[order], ids[order])
        return cls(salt, tables)

    def recover(self, x: Any, domain: str = "target") -> Any:
        """The clear ids of hashed `x` (numpy or torch, same type and shape back)."""
        if x is None:
            return None
        is_torch = isinstance(x, torch.Tensor)
        arr = (x.numpy() if is_torch else np.asarray(x)).astype(np.int64)
        hashes, ids = self.tables[domain]
        at = np.clip(np.searchsorted(hashes, arr), 0, len(hashes) - 1)
        found = hashes[at] == arr
        if not found.all():
            raise RedactedIdsError(
                f"{int((~found).sum())} hashed {domain} ids match no id of the drafter's "
                f"{domain} vocabulary ({len(ids) - 1} ids) under this salt: wrong drafter?"
            )
        out = ids[at]
        return torch.from_numpy(out) if is_torch else out


def recover_serving_ids(serving: Any, recovery: IdRecovery) -> None:
    """Replace the hashed ids of a `ServingData` in place by the clear ones."""
    for r in serving.requests:
        r.tokens = recovery.recover(r.tokens)
        d = r.draft
        if d is not None:
            d.input_ids = recovery.recover(d.input_ids)
            d.topk_target_ids = recovery.recover(d.topk_target_ids)
            d.topk_draft_ids = recovery.recover(d.topk_draft_ids, domain="draft")
        for c in getattr(r, "chains", []):
            c.input_ids = recovery.recover(c.input_ids)
            c.topk_draft_ids = recovery.recover(c.topk_draft_ids, domain="draft")
