"""The decoder stack under a causal LM's head (and under a multimodal wrapper): what pc-rag runs
for KV (no logits over the vocabulary for every token) and where the rotary embedding lives; and
the causal LM a text-only pass runs."""

from __future__ import annotations

from typing import Any


def decoder_of(model: Any) -> Any:
    """The text decoder stack of ``model``: transformers' ``get_decoder()``, followed down while it
    names another module, and ``.model`` where it names none.

    ``model.base_model`` is not it everywhere: an image-and-text model (Gemma 3 as
    ``Gemma3ForConditionalGeneration``, what ``AutoModelForCausalLM`` loads for its checkpoints)
    holds the text stack and its rotary embedding one level further down, and Llama 4's causal
    LM names a prefix ("language_model") it does not have, so ``base_model`` is the whole LM,
    whose forward pass computes logits for every token and whose RoPE goes unfound."""
    current = model
    for _ in range(4):  # wrapper -> language model -> stack at most
        inner = current.get_decoder() if hasattr(current, "get_decoder") else current
        if inner is current:
            inner = getattr(current, "model", current)
        if inner is current or not hasattr(inner, "forward"):
            break
        current = inner
    return current


def language_model_of(model: Any) -> Any:
    """What a text-only forward pass of ``model`` runs: a multimodal wrapper's ``language_model``
    when that is a whole causal LM under the wrapper's own head (Llama 4's
    ``Llama4ForConditionalGeneration``, whose own forward fails without images in transformers
    5.x: it reads ``image_outputs`` from the language model's output), else ``model`` itself.

    The two are one computation for text: without pixel values the wrapper only embeds the ids
    and hands them to its language model."""
    inner = getattr(model, "language_model", None)
    if inner is None or inner is model or not hasattr(inner, "get_output_embeddings"):
        return model
    head = inner.get_output_embeddings()
    return inner if head is not None and head is model.get_output_embeddings() else model
