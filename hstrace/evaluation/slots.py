"""Stored training slots vs the drafter: count and width, the physical layers where the data
names them, and a slot that IS the token embedding (the seed incident), decided from the
numbers: against the target's embedding, else the drafter's own saved one, else by the slot
being a function of the token id alone. Nothing here guesses."""

from __future__ import annotations

from typing import Any

import torch

from hstrace.drafter.dialects import DIALECT_CONVENTION
from hstrace.drafter.model import Eagle3Drafter
from hstrace.findings import Finding, finding
from hstrace.training.conventions import hf_index


def slot_findings(model: Eagle3Drafter, dialect: str, first: Any) -> list[Finding]:
    """Stored slots vs what the drafter's fc takes: count and width, then (where the data names
    them) the physical layers, compared as HF hidden_states indices."""
    cfg = model.cfg
    n_slots, width = int(first.aux.shape[1]), int(first.aux.shape[2])
    evidence = {
        "stored_slots": n_slots,
        "stored_width": width,
        "fc_slots": cfg.num_aux,
        "fc_width": cfg.aux_width,
        "stored_layer_ids": first.slot_layer_ids,
        "config_layer_ids": cfg.aux_layer_ids,
        "provenance": first.provenance,
    }
    if (n_slots, width) != (cfg.num_aux, cfg.aux_width):
        return [
            finding(
                "slot-layout",
                f"training data stores {n_slots} aux slots of width {width}; the drafter's fc "
                f"takes {cfg.num_aux} of width {cfg.aux_width}",
                evidence,
                variant="stored-count",
            )
        ]
    stored, conv = first.slot_layer_ids, first.provenance.get("layer_id_convention")
    if stored is None or cfg.aux_layer_ids is None or conv is None:
        return []
    data_hf = [hf_index(i, conv) for i in stored]
    drafter_hf = [hf_index(i, DIALECT_CONVENTION[dialect]) for i in cfg.aux_layer_ids]
    if data_hf == drafter_hf:
        return []
    return [
        finding(
            "slot-layout",
            f"training data stores HF hidden_states {data_hf}, the drafter's config names "
            f"{drafter_hf}: one of them is not what the drafter was trained or will be served on",
            {**evidence, "stored_hf_indices": data_hf, "config_hf_indices": drafter_hf},
            variant="stored-layers",
            severity="warning",
        )
    ]


# A stored slot "is" the token embedding when it equals embed_tokens[input_ids] up to bf16
# rounding (relative error <= 2^-8 per element, so <= ~4e-3 over a row); the stream after one
# decoder layer is further away by orders of magnitude (it adds attention and MLP outputs).
EMBED_SLOT_REL_TOL = 1e-2


def embedding_slots(sample: Any, embedding: torch.Tensor) -> list[dict[str, Any]]:
    """For each stored aux slot (and the final state), its relative distance to
    `embedding[input_ids]`: ||slot - emb|| / ||emb|| over all rows. Slots of another width than
    the embedding are not compared."""
    ids = sample.input_ids.long()
    if int(ids.max()) >= embedding.shape[0]:
        return []
    emb = embedding[ids].float()
    slots = [(j, sample.aux[:, j]) for j in range(sample.aux.shape[1])]
    if sample.last is not None:
        slots.append(("last", sample.last))
    out = []
    for j, x in slots:
        if x.shape[-1] != emb.shape[-1]:
            continue
        rel = float((x.float() - emb).norm() / emb.norm().clamp_min(1e-12))
        out.append({"slot": j, "rel_error": rel, "is_embedding": rel <= EMBED_SLOT_REL_TOL})
    return out


# Without any embedding: a slot that is a function of the token id alone (the same row wherever
# a token repeats, at any position and context) can only be the embedding; every decoder layer
# mixes in the context through attention. Needs a few tokens that repeat to say anything.
MIN_REPEATED_TOKENS = 4


def token_function_slots(sample: Any) -> list[dict[str, Any]]:
    """For each stored aux slot (and the final state), the largest relative spread between rows
    of the same token id, ||x_i - x_j|| / ||x_i||; `is_embedding` when it is within bf16
    rounding for at least `MIN_REPEATED_TOKENS` repeated tokens. [] when too few tokens repeat."""
    ids = sample.input_ids.long()
    groups = [torch.nonzero(ids == t).flatten() for t in torch.unique(ids)]
    groups = [g for g in groups if g.numel() >= 2]
    if len(groups) < MIN_REPEATED_TOKENS:
        return []
    slots = [(j, sample.aux[:, j]) for j in range(sample.aux.shape[1])]
    if sample.last is not None:
        slots.append(("last", sample.last))
    out = []
    for j, x in slots:
        x = x.float()
        spread = 0.0
        for g in groups:
            rows = x[g]
            ref = rows[0]
            rel = (rows - ref).norm(dim=-1).max() / ref.norm().clamp_min(1e-12)
            spread = max(spread, float(rel))
        out.append(
            {
                "slot": j,
                "rel_error": spread,
                "is_embedding": spread <= EMBED_SLOT_REL_TOL,
                "repeated_tokens": len(groups),
            }
        )
    return out


def embedding_slot_findings(
    model: Eagle3Drafter,
    dialect: str,
    first: Any,
    embedding: torch.Tensor | None,
    embedding_source: str | None,
) -> tuple[list[Finding], dict[str, Any]]:
    """B12 / the seed incident ([embed, L3, L31, L59] stored, [2, 30, 58] served): a training
    slot that IS the token embedding (HF hidden_states[0]) while the drafter's config asks the
    engine for decoder layers only. Decided from the numbers: against the target's embedding,
    else the drafter's own saved one (speculators saves the target's), else by the slot being a
    function of the token id alone (`token_function_slots`)."""
    if embedding is None:
        tested = token_function_slots(first)
        embedding_source = (
            "none (the checkpoint has none, no --target): a slot that is the same row wherever "
            "a token repeats is a function of the token alone, the embedding"
        )
        if not tested:
            return [], {
                "embedding_slot_test": "not run: no embedding (pass --target) and too few "
                "repeated tokens to test without one"
            }
    else:
        tested = embedding_slots(first, embedding)
    info = {
        "embedding_slot_test": {
            "embedding_source": embedding_source,
            "slots": tested,
            "rows": first.num_tokens,
            "tolerance": EMBED_SLOT_REL_TOL,
        }
    }
    aux_embed = [t["slot"] for t in tested if t["is_embedding"] and t["slot"] != "last"]
    if not aux_embed:
        return [], info
    ids = model.cfg.aux_layer_ids
    conv = DIALECT_CONVENTION[dialect]
    config_hf = [hf_index(int(i), conv) for i in ids] if ids is not None else None
    if config_hf is not None and all(j < len(config_hf) and config_hf[j] == 0 for j in aux_embed):
        return [], info  # the config asks for the embedding where the data stores it
    n_slots = int(first.aux.shape[1])
    stored = ["embed" if j in aux_embed else "layer?" for j in range(n_slots)]
    if first.last is not None:
        stored.append("last (teacher)")
    served = (
        f"HF hidden_states {config_hf} (ids {ids}, {conv} convention)"
        if config_hf is not None
        else "the engine's default layers (no ids in the config), none of them the embedding"
    )
    return [
        finding(
            "slot-layout",
            f"training aux slot(s) {aux_embed} of {n_slots} are the token embedding "
            f"(embed_tokens[input_ids] up to bf16, HF hidden_states[0]), but the drafter's config "
            f"asks the engine for {served}: fc was trained on an embedding slot that serving "
            "never delivers",
            {
                "embedding_slots": aux_embed,
                "stored_layout": stored,
                "slot_rel_errors": {str(t["slot"]): t["rel_error"] for t in tested},
                "embedding_source": embedding_source,
                "rows": first.num_tokens,
                "tolerance": EMBED_SLOT_REL_TOL,
                "config_layer_ids": ids,
                "config_convention": conv,
                "config_hf_indices": config_hf,
                "data_format": first.provenance.get("format"),
                "data_last": first.provenance.get("last"),
            },
            variant="stored-embedding",
        )
    ], info
