"""Attention kernels the engine registers with transformers' public ``AttentionInterface``.

``pc_rag_sdpa`` is transformers' own SDPA path with one change: on CPU, grouped-query attention
with a mask runs through ``scaled_dot_product_attention(..., enable_gqa=True)`` instead of first
materialising ``repeat_kv`` copies of every key and value. transformers only does that copy-free
call without a mask (a CUDA kernel restriction that does not apply on CPU); a cached prompt always
has a mask (its query starts after the imported modules), so on a 7.5K-token context the copies
cost a quarter of the time to first token. The arithmetic is the same kernel's.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import PromptCacheError
from ..kv.buffers import read_at
from . import key_tiles, row_extents, shared_attention
from . import packed as packed_mod
from .probe import PROBE_KWARG
from .threads import attention_threads

logger = logging.getLogger(__name__)

ATTENTION_NAME = "pc_rag_sdpa"
SENTINEL_KWARG = "pc_rag_sentinel"
# the config's sliding window, on a layer whose attention is told neither by keyword nor by attribute
CONFIG_WINDOW = "pc_rag_config_window"
# attention keywords of model families whose attention is more than softmax(q k^T) v
_SPECIAL = ("position_bias", "cache", "softcap")
_registered = False
TILE_PLANS = key_tiles.TilePlans()  # a prefill pass's tiles of keys, planned once a pass


def _pc_rag_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention (see the module docstring), on every thread inside a narrow
    prefill pass (:func:`pc_rag.forward.threads.narrow_pass`)."""
    key, value = read_at(key, value, query.dtype)
    with attention_threads():
        return _attention(module, query, key, value, attention_mask, *args, **kwargs)


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    sentinel = kwargs.pop(SENTINEL_KWARG, None)
    if sentinel is not None:  # receives_keywords: this layer's call was reached with pc-rag's keywords
        sentinel.append((module, attention_mask, query.shape[1], key.shape[1], "sliding_window" in kwargs))
    packed = kwargs.pop(packed_mod.KWARG, None)
    if packed is not None:  # several batches' tokens in one pass: each attends to its own cache
        return packed.attend(module, query, key, value, scaling, _pc_rag_sdpa, **kwargs), None
    shared = kwargs.pop(shared_attention.KWARG, None)
    extents = kwargs.pop(row_extents.KWARG, None)
    extents = extents if query.shape[2] == 1 else None  # decode steps only
    probe = kwargs.pop(PROBE_KWARG, None)
    if probe is not None:  # recovery reads this layer's attention (and may stop the pass here)
        probe.observe(module, query, key, attention_mask, scaling)
    special = any(kwargs.get(k) is not None for k in _SPECIAL)
    if shared is not None:
        if special:
            raise PromptCacheError("shared-module attention does not support position biases or soft-capping")
        # a layer that passes sliding_window=None is global (EXAONE 4): never the module's or the config's window
        window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None) \
            if hasattr(module, "sliding_window") else getattr(module, CONFIG_WINDOW, None)
        return shared_attention.split_attention(module, query, key, value, attention_mask, scaling, shared, window=window,
                                                extents=extents), None
    groups = getattr(module, "num_key_value_groups", 1)
    special = special or kwargs.get("output_attentions")
    if extents is not None and not special:  # a CPU decode step: rows attend over their own extents
        return row_extents.attend(query, key, value, attention_mask, scaling, extents), None
    tiles = TILE_PLANS.get(attention_mask, query.dtype) if not special and kwargs.get("s_aux") is None \
        and key_tiles.usable(query, key, attention_mask) else None
    if tiles is not None:  # a CPU prefill pass whose mask hides whole tiles of keys from blocks of its queries
        return key_tiles.attend(query, key, value, tiles, scaling), None
    if query.device.type != "cpu" or groups == 1 or query.shape[2] == 1 or special:
        # decode steps (q_len 1) are already copy-free upstream (pack_gqa); everything else as upstream
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal and attention_mask is None and query.shape[2] > 1)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``pc_rag_sdpa`` (and transformers' SDPA mask builder under the same name)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, _pc_rag_sdpa)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    _registered = True


def install(model: Any) -> bool:
    """Switch a model that uses plain ``sdpa`` to ``pc_rag_sdpa``; returns whether it switched.

    Models on eager, flash or flex attention are left alone: the switch only ever replaces the
    SDPA path with the same SDPA kernel.
    """
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    register()
    try:
        model.set_attn_implementation(ATTENTION_NAME)
    except (ValueError, TypeError) as err:  # a model class that cannot switch dynamically
        logger.info("keeping sdpa attention: %s", err)
        return False
    return getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME


def receives_keywords(model: Any, decoder: Any, shape: tuple[int, int, int], windows: list[int | None]) -> str | None:
    """Why ``pc_rag_sdpa`` cannot rely on the keywords pc-rag passes a forward pass (shared KV,
    packed steps, probes), or None when it can: proved with one sentinel pass, in which every
    layer's attention must be called once with them. Some decoder layers do not pass their
    keyword arguments on to their attention (StableLM, Nemotron), so what split attention hands
    them never arrives and a batch reads what it did not mean to; some call attention twice per
    layer on values they transform (DiffLlama), so KV read in place is not what they attend to;
    some mask each head otherwise, from the values (Doge), where split attention reads one mask;
    some hand attention other head counts than their config's (JetMoE, Laguna), which split
    attention groups queries by."""
    layers, heads, kv_heads = shape
    seen: list[Any] = []
    ids = torch.zeros(1, 2, dtype=torch.long, device=model.device)
    try:
        with torch.inference_mode():
            decoder(input_ids=ids, use_cache=False, **{SENTINEL_KWARG: seen})
    except TypeError as err:  # a forward that takes no keywords at all
        return f"its forward takes no attention keywords ({err})"
    calls: dict[int, int] = {}
    for module, *_ in seen:
        calls[id(module)] = calls.get(id(module), 0) + 1
    if any(mask is not None and mask.dim() == 4 and mask.shape[1] > 1 for _, mask, *_ in seen):
        return "its attention masks differ from head to head (Doge's masks are computed from the values)"
    found = sorted({(q, k) for *_, q, k, _ in seen} - {(heads, kv_heads)})
    if found:  # JetMoE repeats its keys before attention; Laguna's layers have more query heads than its config
        return (f"its attention is called with {', '.join(f'{q} query and {k} key heads' for q, k in found)} where its config "
                f"says {heads} and {kv_heads}")
    for layer, (module, *_, told) in enumerate(seen[:layers]):
        if not told and not hasattr(module, "sliding_window"):  # PhiMoE: its mask has the config's window; its attention is not told
            setattr(module, CONFIG_WINDOW, windows[layer])
    if len(calls) < layers:
        return f"{layers - len(calls)} of its {layers} layers do not pass keyword arguments on to their attention"
    if any(count > 1 for count in calls.values()) or len(calls) > layers:
        return "its layers call attention more than once each (on values they transform)"
    return None


# attention implementations that take an arbitrary 4D mask: boolean (True = attend) for SDPA,
# additive float for eager
BOOLEAN_MASK = ("sdpa", ATTENTION_NAME)
ADDITIVE_MASK = ("eager",)


def accepts_custom_mask(model: Any) -> bool:
    return getattr(model.config, "_attn_implementation", None) in BOOLEAN_MASK + ADDITIVE_MASK


def attention_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, valid: torch.Tensor | None, spec: Any,
    bias: torch.Tensor | None = None, *, additive: bool = False,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The mask for queries at ``query_positions [rows, q]`` over keys at ``key_positions [rows, k]``.

    Causality is given by positions, not by where a key sits in the cache: a request's cache holds
    its cached modules first and its computed tokens after them, out of position order (see
    :func:`pc_rag.prefill.passes.prefill`). ``valid [rows, k]`` marks real entries (not padding).
    Sliding-window models see only keys within the window (``query - window < key``), as
    transformers' own masks do; a model whose layers differ gets one mask per layer type.
    Boolean (True = attend) for SDPA, additive for eager, as ``spec.attn_implementation`` takes;
    additive for both when ``bias [rows, k]`` (added to the attention logits of every query,
    APE's scale) is given, or when asked for (``additive``).
    """
    allowed = key_positions[:, None, :] <= query_positions[:, :, None]
    if valid is not None:
        allowed &= valid[:, None, :]
    allowed = allowed[:, None]  # [rows, 1, q, k]
    window = spec.sliding_window
    if window is None:
        return _as_mask(allowed, spec, bias, additive)
    windowed = allowed & (key_positions[:, None, None, :] > query_positions[:, None, :, None] - window)
    if not spec.mixed_window:
        return _as_mask(windowed, spec, bias, additive)
    return {"full_attention": _as_mask(allowed, spec, bias, additive), "sliding_attention": _as_mask(windowed, spec, bias, additive)}


def _as_mask(allowed: torch.Tensor, spec: Any, bias: torch.Tensor | None = None, additive: bool = False) -> torch.Tensor:
    if spec.attn_implementation in BOOLEAN_MASK and bias is None and not additive:
        return allowed
    lowest = torch.finfo(spec.dtype).min
    if bias is None:
        return torch.zeros(allowed.shape, dtype=spec.dtype, device=allowed.device).masked_fill_(~allowed, lowest)
    # one op where a copy, a negation and a fill were three (a decode step builds this mask every token)
    return torch.where(allowed, bias[:, None, None, : allowed.shape[-1]].to(spec.dtype), lowest)
