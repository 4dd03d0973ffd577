"""The shape of a model's attention KV, or why it has none that Prompt Cache can reuse.

The one gate for "is this architecture supported": every path that sizes KV for a model (the KV
buffers, :func:`pc_rag.model.spec.inspect_model`) asks :func:`kv_shape`, so a model is refused
by name, with the reason, before any forward pass runs.
"""

from __future__ import annotations

from typing import Any

from ..errors import PromptCacheError

# The layer types whose state is per-position keys and values; anything else in a config's
# ``layer_types`` (linear attention, convolutions, state-space layers) carries a running state.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


def kv_shape(model: Any) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder-only model whose every layer is attention with
    keys and values of one size; any other model raises :class:`PromptCacheError` saying why."""
    config = model.config.get_text_config(decoder=True)
    name = getattr(config, "model_type", None) or type(model).__name__
    heads = getattr(config, "num_attention_heads", None)
    if not heads:  # a state-space model (Mamba, RWKV): no attention KV to cache
        raise PromptCacheError(f"{name} has no attention heads (num_attention_heads): Prompt Cache reuses "
                               "attention KV; this model is not supported")
    _refuse_recurrent_layers(config, name)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    _refuse_latent_attention(config, name, head_dim)
    return config.num_hidden_layers, kv_heads, head_dim


def _refuse_recurrent_layers(config: Any, name: str) -> None:
    """Layers that are not attention (linear attention, convolutions, state-space layers: Qwen3-Next,
    LFM2, Jamba) carry a state that sums up everything before it: a module's state cannot be
    reused behind other text, so there is no module KV to cache."""
    others = sorted({t for t in getattr(config, "layer_types", None) or () if t not in ATTENTION_LAYER_TYPES})
    if others:
        raise PromptCacheError(
            f"{name} has layers of type {', '.join(map(repr, others))}: their state depends on all the text "
            "before it, so a module's cached state cannot be reused elsewhere; Prompt Cache needs attention "
            "layers only, and this model is not supported"
        )


def _refuse_latent_attention(config: Any, name: str, head_dim: int) -> None:
    """Multi-head latent attention (DeepSeek V2/V3, Kimi K2) caches keys and values of different
    sizes, part of each key rotary: pc-rag's buffers and key rotation assume one head size."""
    if not getattr(config, "kv_lora_rank", None) and getattr(config, "v_head_dim", head_dim) == head_dim:
        return
    rotary = getattr(config, "qk_rope_head_dim", 0) or 0
    keys = (getattr(config, "qk_nope_head_dim", 0) or 0) + rotary or head_dim
    values = getattr(config, "v_head_dim", None) or head_dim
    raise PromptCacheError(
        f"{name} uses multi-head latent attention (keys of {keys} dims, {rotary} of them rotary; values of "
        f"{values}): pc-rag's KV buffers and key rotation assume attention heads of head_dim ({head_dim}) "
        "for both; this model is not supported"
    )
