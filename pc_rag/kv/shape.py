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
    # the decoder of an encoder-decoder family (BartForCausalLM) names its own sizes
    heads = getattr(config, "decoder_attention_heads", None) or getattr(config, "num_attention_heads", None)
    if not heads:  # a state-space model (Mamba, RWKV): no attention KV to cache
        raise PromptCacheError(f"{name} has no attention heads (num_attention_heads): Prompt Cache reuses "
                               "attention KV; this model is not supported")
    _refuse_recurrent_layers(config, name)
    head_dim = _global(config, "head_dim", name) or config.hidden_size // heads
    _refuse_latent_attention(config, name, head_dim)
    layers = getattr(config, "decoder_layers", None) or config.num_hidden_layers
    return layers, _kv_heads(config, heads), head_dim


def _kv_heads(config: Any, heads: int) -> int:
    """The KV heads a layer caches. Falcon names them otherwise: ``multi_query`` (the 7B layout)
    caches one; its new decoder architecture caches its keys repeated to every query head."""
    if getattr(config, "num_key_value_heads", None):
        return config.num_key_value_heads
    if hasattr(config, "multi_query") and hasattr(config, "new_decoder_architecture"):
        return heads if config.new_decoder_architecture else 1 if config.multi_query else getattr(config, "num_kv_heads", heads) or heads
    return heads


def _global(config: Any, attribute: str, name: str) -> Any:
    """``config.attribute``, refused when it differs from layer to layer (Gemma 4: global layers
    have larger heads): pc-rag's KV buffers hold one head size for every layer."""
    try:
        return getattr(config, attribute, None)
    except Exception as err:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError (a RuntimeError)
        sizes = sorted({getattr(layer, attribute, None) for layer in getattr(config, "per_layer_config", None) or ()} - {None})
        raise PromptCacheError(f"{name} has a {attribute} per layer ({', '.join(map(str, sizes)) or type(err).__name__}): "
                               "pc-rag's KV buffers hold one head size for every layer; this model is not supported yet") from None


def check_cached_shape(model: Any, decoder: Any, expected: tuple[int, int, int], cache_keyword: str = "past_key_values") -> None:
    """Prove, with one sentinel forward pass through transformers' own cache, that every layer
    caches keys and values of the shape pc-rag allocates (``expected``: layers, kv_heads,
    head_dim); a model whose config says otherwise than its layers do (Falcon's multi-query
    layout read as 4 heads was broadcast in prefill and failed at decode) is refused saying how.
    ``cache_keyword``: what the model's forward calls its cache."""
    layers, kv_heads, head_dim = expected
    name = getattr(model.config, "model_type", None) or type(model).__name__
    cache = _sentinel(model, decoder, name, cache_keyword, [0, 0, 0])
    cached = [(getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in cache.layers]
    silent = [i for i, (keys, _) in enumerate(cached) if keys is None or not keys.numel()]
    if not cached or len(silent) == len(cached):  # OpenAI GPT, XLNet: no past_key_values at all
        raise PromptCacheError(f"{name} keeps no attention KV in transformers' cache (its forward takes no past_key_values): "
                               "Prompt Cache reuses attention KV; this model is not supported")
    if silent:  # Gemma 3n: its last layers attend to an earlier layer's KV, recomputed in every pass
        raise PromptCacheError(f"{name}'s layers {', '.join(map(str, silent))} cache no KV of their own (they read another "
                               "layer's): pc-rag's buffers, position probe and shared-module attention expect every layer's; "
                               "this model is not supported yet")
    shapes = {tuple(k.shape[1::2]) for k, v in cached if k is not None and k.numel()} | \
             {tuple(v.shape[1::2]) for k, v in cached if v is not None and v.numel()}
    if len(cached) != layers or shapes != {(kv_heads, head_dim)}:
        found = ", ".join(f"{h} heads of {d}" for h, d in sorted(shapes)) or "none"
        raise PromptCacheError(f"{name} caches KV of {len(cached)} layers ({found}) where its config says {layers} layers of "
                               f"{kv_heads} heads of {head_dim}: pc-rag would allocate the wrong buffers; this model is not supported")
    _check_positions_honoured(model, decoder, name, cache_keyword, cache)
    _check_causal(model, decoder, name)


def _check_causal(model: Any, decoder: Any, name: str) -> None:
    """A token's state must not depend on the tokens after it: an encoder loaded as a causal LM
    without ``is_decoder=True`` (BERT, RoBERTa) attends both ways, and no cached prefix equals it."""
    import torch

    def states(ids: list[int], **extra: Any) -> Any:
        try:
            with torch.inference_mode():
                return decoder(input_ids=torch.tensor([ids], device=model.device), use_cache=False, **extra)[0][0].float()
        except Exception as err:  # noqa: BLE001 - the model's own forward, without a cache
            raise PromptCacheError(f"{name} failed a {len(ids)}-token forward pass without a cache ({type(err).__name__}: "
                                   f"{str(err)[:200]}); this model is not supported") from err

    tolerance = 1e-4 if model.dtype.itemsize >= 4 else 3e-2
    default = states([5, 9, 11])
    first, second = default[:2], states([5, 9, 42])[:2]
    if (first - second).abs().max().item() > tolerance * (first.abs().max().item() + 1e-6):
        raise PromptCacheError(f"{name} is not causal: its first tokens' states change with the tokens after them (an encoder "
                               "loaded as a causal LM; set is_decoder=True in its config if it has one); Prompt Cache reuses "
                               "the states of a prefix, which must not depend on what follows")
    # pc-rag numbers positions from 0; RoBERTa's embeddings number them from its padding id + 1
    counted = states([5, 9, 11], position_ids=torch.arange(3, device=model.device)[None])
    if (default - counted).abs().max().item() > tolerance * (default.abs().max().item() + 1e-6):
        raise PromptCacheError(f"{name} does not number positions from 0 by itself (RoBERTa's embeddings count from its padding "
                               "id + 1): pc-rag numbers them from 0 and would run it at positions it was not trained at; "
                               "this model is not supported")


def _sentinel(model: Any, decoder: Any, name: str, cache_keyword: str, ids: list[int], cache: Any = None,
              positions: list[int] | None = None) -> Any:
    """``ids`` through the model's own forward and transformers' own cache (a new one unless given): the cache."""
    import torch
    from transformers import DynamicCache

    if cache is None:
        config = model.config.get_text_config(decoder=True)
        # a decoder of an encoder-decoder family: its config's num_hidden_layers counts the encoder's
        cache = DynamicCache() if getattr(config, "decoder_layers", None) else DynamicCache(config=config)
    extra = {} if positions is None else {"position_ids": torch.tensor([positions], device=model.device)}
    try:
        with torch.inference_mode():
            decoder(input_ids=torch.tensor([ids], device=model.device), use_cache=True, **{cache_keyword: cache}, **extra)
    except Exception as err:  # noqa: BLE001 - the model's own forward, through transformers' own cache
        raise PromptCacheError(f"{name} failed a {len(ids)}-token forward pass through transformers' own cache ({type(err).__name__}: "
                               f"{str(err)[:200]}): its config does not describe the layers it has; this model is not supported") from err
    return cache


def _check_positions_honoured(model: Any, decoder: Any, name: str, cache_keyword: str, cache: Any) -> None:
    """pc-rag places every token by the position ids it passes (a module moved, a gap left). Two tokens
    given positions 0 and 1 behind the 3 cached ones must get the first layer's keys they get alone
    at 0 and 1 (those keys see only their own token and position): BART's decoder places positions
    by the length of its cache instead, and a module read anywhere would carry the place it was
    encoded at while the probe saw keys that do not move."""
    ids = [5, 9]
    behind = _sentinel(model, decoder, name, cache_keyword, ids, cache, positions=[0, 1]).layers[0].keys[..., -2:, :].float()
    alone = _sentinel(model, decoder, name, cache_keyword, ids, positions=[0, 1]).layers[0].keys[..., -2:, :].float()
    tolerance = 1e-4 if model.dtype.itemsize >= 4 else 3e-2
    if (behind - alone).abs().max().item() > tolerance * (alone.abs().max().item() + 1e-6):
        raise PromptCacheError(f"{name} does not place tokens at the position ids it is given (its first layer's keys follow the "
                               "length of its cache): pc-rag places modules and gaps by position ids; this model is not supported")


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
