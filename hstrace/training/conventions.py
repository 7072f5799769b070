"""Layer-id conventions, so a stored id can be turned into a physical layer.

A physical layer is named by its HF `output_hidden_states` index h: the residual stream after h
decoder layers (h = 0 is the embeddings; HF's index N is post-final-norm, so the pre-norm final
stream has no HF index of its own and is called "final" here).
"""

from __future__ import annotations

# "id k" = the stream entering layer k (= after k layers). vLLM, speculators >= v0.5, EAGLE.
BEFORE_LAYER = "before_layer"
# "id k" = the output of 0-based layer k (= after k+1 layers). SpecForge/SGLang explicit ids,
# speculators v0.2-v0.4 custom worker.
OUTPUT_OF_LAYER = "output_of_layer"

CONVENTIONS = (BEFORE_LAYER, OUTPUT_OF_LAYER)


def hf_index(layer_id: int, convention: str) -> int:
    """The HF hidden_states index (layers run before the capture) that `layer_id` names."""
    if convention == BEFORE_LAYER:
        return layer_id
    if convention == OUTPUT_OF_LAYER:
        return layer_id + 1
    raise ValueError(f"unknown layer-id convention {convention!r}; known: {CONVENTIONS}")


def default_hf_indices(num_layers: int) -> list[int]:
    """The physical aux layers every library captures by default: HF hs[2], hs[N//2], hs[N-3]."""
    return [2, num_layers // 2, num_layers - 3]
