"""`DrafterConfig`: every knob of an EAGLE-3 drafter, named for what it does.

The libraries spell some of these differently (and one of them, `norm_output`, means two things);
`hstrace.drafter.checkpoint` translates each dialect's config into this one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class DrafterConfig:
    # --- sizes -------------------------------------------------------------------------------
    hidden_size: int  # H: the drafter's width
    vocab_size: int  # V: the target's vocabulary (embeddings, t2d)
    draft_vocab_size: int  # Vd: rows of lm_head; Vd < V needs a d2t mapping
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int | None = None  # default H // num_attention_heads
    target_hidden_size: int | None = None  # Ht: width of one aux slot; default H
    num_aux: int = 3  # n: aux slots concatenated into fc's input [n*Ht]
    num_hidden_layers: int = 1  # layer 0 is the EAGLE-3 "midlayer"; more = plain decoder layers
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False  # q/k/v/o biases (Llama `attention_bias`)

    # --- positions and attention ---------------------------------------------------------------
    rope_theta: float = 10000.0
    # HF-style rope scaling dict ({"rope_type": "llama3"|"linear", ...}) or None.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    # Keys further back than this many positions are masked (speculators' default 2048 since
    # v0.7.0); None = full causal attention (SGLang, SpecForge, EAGLE).
    sliding_window: int | None = None
    # Per-layer "sliding_attention" | "full_attention"; None with a window = every layer slides.
    layer_types: list[str] | None = None

    # --- the flags the libraries disagree on -----------------------------------------------
    # speculators `norm_before_fc`: one RMSNorm over the whole [n*Ht] aux concat before fc
    # (weight `input_norm.weight`).
    norm_before_fc: bool = False
    # speculators/SpecForge `fc_norm`: one RMSNorm per aux slot before fc (`fc_norm.{j}.weight`).
    fc_norm: bool = False
    # speculators `norm_before_residual`: layer 0's residual is hidden_norm(h) instead of h.
    norm_before_residual: bool = False
    # speculators/vLLM `norm_output`: the state fed back to the next step is norm(h), not h.
    feed_normed: bool = False
    # SpecForge `norm_output` (default True): apply `norm` before lm_head. False = lm_head(h).
    logits_use_norm: bool = True
    # speculators draft_arch qwen3: per-head RMSNorm on q and k before RoPE.
    qk_norm: bool = False

    # --- serving faults (never read from a checkpoint; set by the reference engine's fault
    # table and replay's what-if search, so a fault is a config, not a patched method) ---------
    # The engine handed the drafter one H-wide state and skipped fc (a target serving EAGLE, not
    # EAGLE3: the aux concat never built); `combine` passes that state through.
    skip_fc: bool = False

    # --- provenance (not used by the math; carried for checks and round trips) -------------
    aux_layer_ids: list[int] | None = None  # as written in the checkpoint, in its convention
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are mutually exclusive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def aux_width(self) -> int:
        """Width of one aux slot (Ht)."""
        return self.target_hidden_size or self.hidden_size

    def window_of_layer(self, layer: int) -> int | None:
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        kind = self.layer_types[layer] if layer < len(self.layer_types) else "full_attention"
        return self.sliding_window if kind == "sliding_attention" else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
