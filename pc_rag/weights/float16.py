"""Linear layers in 16-bit floats on a CPU (``PromptCache(..., weights="float16")``): half the bytes
of float32, float32 arithmetic.

FBGEMM's fp16 GEMM (``quantized.linear_dynamic_fp16``, shipped with every x86 build of torch) keeps
each weight matrix packed in fp16 and widens it in registers: activations, accumulation and
outputs stay float32, so the only change to the model is each weight rounded to the nearest fp16
(relative error ~2e-4; first-token KL against float32 1.8e-6 on the embedded model).

It was the embedded model's CPU default until pc-rag's 4-bit kernels (:mod:`pc_rag.weights.blocks`),
and still is where they cannot be built. Measured through the engine on the AVX2 development CPU
(``benchmarks/cpu_anchor.py``; ``docs/performance.md``, "Weights"): decode at 50.5 ms/token against
float32's 72.5 (the weights stream at half the bytes) and int4's 42.9 on pc-rag's kernels; prefill
as fast as float32 and faster than those kernels' (the first token 0.25 against 0.36 s).

One copy of the weights: the packed matrix. The float32 weight it was made from is let go; a
32-byte SHA-256 of the fp16 values and the bias stays as a buffer, so the engine's fingerprint
(which hashes every buffer) still tells these weights apart.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch

from ..errors import PromptCacheError

logger = logging.getLogger(__name__)


def available() -> bool:
    """Whether this torch build has FBGEMM's fp16 linear (x86 builds do)."""
    return hasattr(torch.ops.quantized, "linear_dynamic_fp16") and "fbgemm" in torch.backends.quantized.supported_engines


class Float16Linear(torch.nn.Module):
    """``nn.Linear``'s product over its weight packed in fp16 (see the module docstring); float32 in and out."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight, bias)
        digest = hashlib.sha256(weight.half().contiguous().view(torch.uint8).numpy().data)
        if bias is not None:
            digest.update(bias.contiguous().view(torch.uint8).numpy().data)
        self.register_buffer("digest", torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise PromptCacheError(f'weights="float16" multiplies float32 inputs; got {x.dtype}', param="weights")
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer computes with (for tests and fidelity reports)."""
        return torch.ops.quantized.linear_unpack_fp16(self.packed)[0]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp16"


def install(model: Any) -> int:
    """Replace every ``nn.Linear`` of a float32 CPU ``model`` (its LM head included) by
    :class:`Float16Linear`; returns how many were replaced."""
    if not available():
        raise PromptCacheError('weights="float16" needs FBGEMM (x86 builds of torch); this build has none', param="weights")
    if torch.device(model.device).type != "cpu" or model.dtype != torch.float32:
        raise PromptCacheError(f'weights="float16" runs a float32 model on a CPU; this one is {model.dtype} on {model.device}',
                               param="weights")
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, Float16Linear(child))
    logger.info("%d linear layers in fp16 (FBGEMM)", len(targets))
    return len(targets)
