"""The precision a CPU model's linear layers compute in (``PromptCache(..., weights=...)``).

- ``"float32"`` (or None): as loaded.
- ``"float16"``: each weight packed in fp16, float32 arithmetic (:mod:`pc_rag.weights.float16`):
  half the bytes, first-token KL ~1e-6.
- ``"int4"``: blocks of 32 in 4 bits, the LM head in 8, on pc-rag's own AVX2 kernels
  (:mod:`pc_rag.weights.blocks`): the embedded model's GGUF blocks held bit for bit (its float32
  weights, at 0.75 bytes a weight), float32 activations. On the AVX2 development CPU, through the
  engine: decode 42.9 ms/token against fp16's 50.5, 8 concurrent callers 43.1 tokens/s against
  33.7, the first token 0.36 against 0.25 s (prefill dequantizes). Where the kernels cannot be built
  (no C compiler, no AVX2): torch's 4-bit kernel (:mod:`pc_rag.weights.int4`; bf16 activations,
  first-token KL ~1e-3).
- ``"int4-a8"``: ``"int4"``, and the decode step in C (:mod:`pc_rag.forward.fused_step`) quantizes
  each product's input to 8 bits a block of 32 (llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 arithmetic)
  and multiplies in integers: fewer instructions a weight. Prefill (the first token) is unchanged;
  decode steps the C step does not serve (over shared KV) keep float32 inputs.

The embedded model is served in int4 on a CPU by default, float16 where the kernels cannot be
built (:func:`chosen`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..errors import PromptCacheError
from ..kernels.loader import library
from . import blocks, float16, gguf_blocks, int4

logger = logging.getLogger(__name__)

WEIGHTS = ("float32", "float16", "int4", "int4-a8")


def install(model: Any, weights: str | None, compiled: bool = False, weights_from: str | os.PathLike | None = None) -> int:
    """Put ``model``'s linear layers in ``weights``; returns how many were replaced (0 as loaded).
    ``compiled``: the decode step runs through ``torch.compile``; ``weights_from``: the GGUF file the
    model was read from, whose own blocks pc-rag's kernels hold (:mod:`pc_rag.weights.gguf_blocks`)."""
    if weights not in (None, *WEIGHTS):
        raise PromptCacheError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}", param="weights")
    if weights == "float16":
        if compiled:  # dynamo guards on each layer's packed weight object: it recompiles per layer, then gives up
            raise PromptCacheError('weights="float16" runs eagerly (torch.compile recompiles for every layer\'s packed weight); '
                                   'pass compile=False, or weights="float32" or "int4"', param="weights")
        return float16.install(model)
    if weights == "int4-a8" and library() is None:
        logger.warning('weights="int4-a8" runs on pc-rag\'s kernels, which are not built here: weights="int4" on torch\'s kernel instead')
        weights = "int4"
    if weights in ("int4", "int4-a8") and library() is not None:
        given = gguf_blocks.file_blocks(weights_from, model) if weights_from is not None else None
        return blocks.install(model, decode_activation_bits=8 if weights == "int4-a8" else 16, given=given)
    return int4.install(model, weights)


def chosen(asked: str | None, *, from_gguf: bool, dtype: Any = None, device: str | torch.device | None,
           compile: bool | str = False) -> str | None:
    """The weights :meth:`~pc_rag.PromptCache.from_pretrained` builds with: those ``asked`` for, or for a
    model read from a GGUF file (``from_gguf``: the embedded model's safetensors copy of one, or a file
    by path) at its own dtype (``dtype`` None) on a CPU, eagerly: int4 where pc-rag's kernels build (the
    file's own blocks), else float16 where FBGEMM runs; else as loaded."""
    if asked is not None or not from_gguf or dtype is not None:
        return asked
    if torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu").type != "cpu" or compile:
        return None
    if library() is not None:
        return "int4"
    return "float16" if float16.available() else None
