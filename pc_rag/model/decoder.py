"""The decoder stack under a causal LM's head: what pc-rag runs for KV (no logits over the
vocabulary for every token) and where the rotary embedding lives."""

from __future__ import annotations

from typing import Any


def decoder_of(model: Any) -> Any:
    """``model``'s base model; for a causal LM whose ``base_model_prefix`` names no attribute
    (Llama 4's text model: "language_model", its stack at ``.model``), the stack at ``.model``.

    ``model.base_model`` falls back to the whole LM there, whose forward pass computes logits for
    every token (a vocabulary-wide tensor per encoded token) and whose ``rotary_emb`` is not found."""
    base = getattr(model, "base_model", model)
    if base is model:
        inner = getattr(model, "model", None)
        if inner is not None and hasattr(inner, "forward") and hasattr(inner, "layers"):
            return inner
    return base
