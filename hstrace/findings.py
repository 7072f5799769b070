"""One language for `hstrace check`, `hstrace replay` and `hstrace diff`: findings with stable codes.

A finding names what diverges, where in the dataflow, the evidence (numbers), and a concrete fix.
Codes are stable API: scripts match on them, `docs/findings.md` documents each one. Add a code
here and to the doc in the same change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Dataflow order: a report leads with the earliest stage that diverges.
STAGES: tuple[str, ...] = (
    "config",
    "weights",
    "vocab-map",
    "target-capture",
    "draft-input",
    "draft-logits",
    "acceptance",
)

# code -> (stage, one-line meaning). Keep in sync with docs/findings.md.
CODES: dict[str, tuple[str, str]] = {
    "acceptance-simulated": (
        "config",
        "a simulated/synthetic acceptance switch is on in the engine: every accept number is fake",
    ),
    "spec-params-adjusted": (
        "config",
        "the engine silently changed speculative settings (e.g. num_draft_tokens)",
    ),
    "norm-flag-mismatch": (
        "config",
        "a norm flag the drafter was trained with is ignored or read differently by the engine",
    ),
    "attention-window": (
        "config",
        "training and serving use different attention windows for the drafter",
    ),
    "rope-mismatch": ("config", "the drafter's RoPE settings differ between training and serving"),
    "weights-dropped": (
        "weights",
        "checkpoint tensors were not loaded (key prefix or name the engine does not map)",
    ),
    "embed-head-source": (
        "weights",
        "embeddings or lm_head come from another source than in training",
    ),
    "d2t-direct-table": (
        "vocab-map",
        "d2t holds offsets but is read as a direct draft->target table (or vice versa)",
    ),
    "vocab-map-missing": (
        "vocab-map",
        "the draft vocab is smaller than the target's but no d2t mapping is applied",
    ),
    "vocab-map-inconsistent": (
        "vocab-map",
        "t2d and d2t describe different draft vocabularies (training and serving use different ones)",
    ),
    "aux-layers-default": (
        "target-capture",
        "the engine captured its default aux layers, not the ones the drafter was trained on",
    ),
    "aux-layer-shift": (
        "target-capture",
        "captured aux layers are shifted by a layer (index convention off by one)",
    ),
    "aux-order": ("target-capture", "aux slots are concatenated in another order than in training"),
    "slot-layout": (
        "target-capture",
        "a slot is missing or extra (e.g. the embedding slot), or the stored layout differs",
    ),
    "hidden-corrupt": (
        "target-capture",
        "aux hidden states are zeros, constant, or belong to another request",
    ),
    "target-drift": (
        "target-capture",
        "the target's hidden states differ from training beyond precision noise",
    ),
    "batch-coupling": (
        "target-capture",
        "a request's aux rows or draft inputs belong to another request of the same batch",
    ),
    "fc-skipped": ("draft-input", "the drafter's fc projection was skipped (a width check passed)"),
    "token-shift": (
        "draft-input",
        "draft input tokens or positions are shifted relative to training",
    ),
    "chunk-boundary-token": (
        "draft-input",
        "at chunked-prefill seams the drafter got the target's prediction, not the next prompt token",
    ),
    "draft-kv-stale": (
        "draft-logits",
        "after a prefix-cache hit the drafter attends over stale, zero or foreign KV",
    ),
    "teacher-norm": (
        "acceptance",
        "the training teacher used another final norm than the target applies",
    ),
    "metric-overstates": (
        "acceptance",
        "the training metric overstates what greedy serving can accept",
    ),
    "no-wiring-fault": ("acceptance", "serving and training agree; the drafter itself is weak"),
}

SEVERITIES = ("fault", "warning", "info")
# Codes that lead a report whatever else is found: they make every other number meaningless.
LEADING: tuple[str, ...] = ("acceptance-simulated",)


@dataclass
class Finding:
    code: str
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    fix: str = ""
    severity: str = "fault"
    # Engine versions the finding applies to, when it depends on them (e.g. "sglang<0.5.17").
    applies_to: str | None = None

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(
                f"unknown finding code {self.code!r}; add it to hstrace.findings.CODES"
            )
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}")

    @property
    def stage(self) -> str:
        return CODES[self.code][0]

    def to_json(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "stage": self.stage,
            **{k: v for k, v in asdict(self).items() if k != "code"},
        }


def in_dataflow_order(findings: list[Finding]) -> list[Finding]:
    """`LEADING` codes first, then faults before warnings before info, each in dataflow order;
    stable otherwise."""
    return sorted(
        findings,
        key=lambda f: (
            f.code not in LEADING,
            SEVERITIES.index(f.severity),
            STAGES.index(f.stage),
        ),
    )
