"""SpecForge's `norm_output`, whose meaning changed in SpecForge PR #879 (merged 2026-09-15).

The installed specforge 0.2.0 (`LlamaForCausalLMEagle3.compute_logits`; the backbone output is
what the next step gets) is "before": the flag only chooses lm_head(norm(h)) vs lm_head(h), the
fed-back state is always h. After #879 the logits always use norm(h) and the flag chooses the
fed-back state (true = EAGLE-3.1, norm(h); false = EAGLE-3, h), as SGLang (default False) and
vLLM read it. A checkpoint's config.json carries no SpecForge version, so the reading is a
question: `hstrace.evaluation.norm_output.resolve_norm_output` answers it from the training
tensors, or says it cannot. This module is the drafter math each reading means.
"""

from __future__ import annotations

PRE_879, POST_879 = "before-specforge-pr-879", "after-specforge-pr-879"
NORM_OUTPUT_READINGS = (PRE_879, POST_879)


def norm_output_flags(value: bool, reading: str) -> dict[str, bool]:
    """The drafter math a SpecForge `norm_output: value` means under each reading."""
    if reading == PRE_879:
        return {"logits_use_norm": bool(value), "feed_normed": False}
    return {"logits_use_norm": True, "feed_normed": bool(value)}


def norm_output_meaning(value: bool, reading: str) -> str:
    f = norm_output_flags(value, reading)
    logits = "lm_head(norm(h))" if f["logits_use_norm"] else "lm_head(h) (no final norm)"
    fed = "norm(h) (EAGLE-3.1)" if f["feed_normed"] else "h (EAGLE-3)"
    return f"logits {logits}, next step gets {fed}"
