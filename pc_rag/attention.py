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

from . import shared_attention
from .errors import PromptCacheError

logger = logging.getLogger(__name__)

ATTENTION_NAME = "pc_rag_sdpa"
# attention keywords of model families whose attention is more than softmax(q k^T) v
_SPECIAL = ("position_bias", "cache", "softcap")
_registered = False


def _pc_rag_sdpa(
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

    shared = kwargs.pop(shared_attention.KWARG, None)
    special = any(kwargs.get(k) is not None for k in _SPECIAL)
    if shared is not None:
        if special or kwargs.get("sliding_window") is not None:
            raise PromptCacheError("shared-module attention does not support position biases, soft-capping or sliding windows")
        return shared_attention.split_attention(module, query, key, value, attention_mask, scaling, shared), None
    groups = getattr(module, "num_key_value_groups", 1)
    special = special or kwargs.get("output_attentions")
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


# attention implementations that take an arbitrary 4D mask: boolean (True = attend) for SDPA,
# additive float for eager
BOOLEAN_MASK = ("sdpa", ATTENTION_NAME)
ADDITIVE_MASK = ("eager",)


def accepts_custom_mask(model: Any) -> bool:
    return getattr(model.config, "_attn_implementation", None) in BOOLEAN_MASK + ADDITIVE_MASK


def position_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, model: Any) -> torch.Tensor:
    """``[1, 1, q, k]`` mask letting each query attend to every key whose position is not after its own.

    For a cache whose entries are not in position order (see ``PromptCache._prefill_one_pass``).
    """
    return _as_mask((key_positions[None, :] <= query_positions[:, None])[None, None], model)


def row_mask(valid: torch.Tensor, model: Any) -> torch.Tensor:
    """``[rows, 1, 1, k]`` mask for one decoding step of a batch: row ``r`` sees the keys ``valid[r]``."""
    return _as_mask(valid[:, None, None, :], model)


def _as_mask(allowed: torch.Tensor, model: Any) -> torch.Tensor:
    if getattr(model.config, "_attn_implementation", None) in BOOLEAN_MASK:
        return allowed
    mask = torch.zeros(allowed.shape, dtype=model.dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(model.dtype).min)
