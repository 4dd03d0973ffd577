"""Linear layers in 4 bits on a CPU (``PromptCache(..., weights="int4")``): decode reads a quarter of
the bytes.

A decode step is bound by the bytes of weights it reads: SmolLM2-135M's linear layers are 538 MB in
float32, ~47 ms a step at this machine's ~11 GB/s. torch's own CPU kernel
``aten._weight_int4pack_mm_for_cpu`` multiplies bf16 activations by weights packed 4 bits a value,
in groups of 32 along the input with a scale and a zero per group: ``w = (q - 8) * scale + zero``.

The weights are quantized per group of 32 from their minimum to their maximum (``d = (max - min) /
15``, ``q = round((w - min) / d)``), which is how GGUF's Q4_1 blocks were made: for the embedded
model, whose float32 weights are its GGUF's Q4_1 values dequantized, every block holds q = 0 and
q = 15, so this recovers the file's own ``d`` and ``m`` (``scale = d``, ``zero = m + 8d``), rounded
to bf16 as the kernel reads them. Both cached and full prefill run on these weights, so fidelity
is measured like for like.

Where the CPU has no bf16 instructions (AVX2), the kernel multiplies a wide input (a prefill
chunk, a document) slower than float32 GEMM: 512 rows of the embedded model took 2.23 s against
1.29 s. There each layer also keeps its 4-bit values in float32 (in place of the weights it was
made from: the model grows by the packed bytes, an eighth) and inputs of :data:`FLOAT_ROWS` rows or
more multiply those: decode steps read 4 bits, prefill runs at float32's speed, both on the same
weights. Whether the float32 values are kept is measured at install on the model's widest layer.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..errors import PromptCacheError

logger = logging.getLogger(__name__)

GROUP = 32  # input features per scale and zero (GGUF Q4_1's block)
WEIGHTS = ("float32", "int4")
FLOAT_ROWS = 32  # inputs this wide multiply the float weights where kept (narrower: decode steps, a few recomputed tokens)
MEASURED_ROWS = 512  # the width of the product install times both ways (a prefill chunk)


class Int4Linear(torch.nn.Module):
    """``nn.Linear``'s product over 4-bit weights (see the module docstring); outputs in the input's dtype."""

    def __init__(self, linear: torch.nn.Linear, *, keep_float: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed, scales_and_zeros, values = quantize(linear.weight.detach())
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        # inputs of FLOAT_ROWS rows or more multiply the 4-bit values in float32 (see the module docstring):
        # the same weights at every width, so a token computed in a prefill and recomputed alone agree
        self.register_buffer("float_weight", values if keep_float else None)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float_weight is not None and x.numel() >= FLOAT_ROWS * self.in_features:
            return torch.nn.functional.linear(x, self.float_weight, self.bias)
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_and_zeros).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer computes with (for tests and fidelity reports)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scales_and_zeros).float().t()


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` as the kernel's packed 4-bit values and its ``[groups, out, 2]`` bf16
    scales and zeros, each group of 32 inputs spanning its own minimum to maximum; and the float32
    weight those hold (what the kernel multiplies by)."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // GROUP, GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    zero = low + 8 * scale
    scales_and_zeros = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    held_scale, held_zero = (t.transpose(0, 1).float()[..., None] for t in scales_and_zeros.unbind(-1))
    values = ((q.reshape(out_features, -1, GROUP) - 8) * held_scale + held_zero).reshape(out_features, in_features)
    return packed, scales_and_zeros, values


def install(model: Any, weights: str | None, *, keep_float: bool | None = None) -> int:
    """Replace ``model``'s linear layers by :class:`Int4Linear` for ``weights="int4"``; returns how
    many were replaced (0 for ``"float32"``/None). A CPU model only (the kernel is torch's CPU
    one), and only layers whose inputs come in whole groups of 32. ``keep_float``: wide inputs
    multiply the float weights (None: where :func:`float_is_faster` measures it so)."""
    if weights not in (None, *WEIGHTS):
        raise PromptCacheError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}", param="weights")
    if weights != "int4":
        return 0
    if torch.device(model.device).type != "cpu":
        raise PromptCacheError(f'weights="int4" runs on a CPU (torch\'s int4 CPU kernel); this model is on {model.device}', param="weights")
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear and child.in_features % GROUP == 0]
    if keep_float is None:
        keep_float = bool(targets) and float_is_faster(max((child for _, _, child in targets), key=lambda c: c.weight.numel()))
    for parent, name, child in targets:
        setattr(parent, name, Int4Linear(child, keep_float=keep_float))
    logger.info("%d linear layers in 4 bits (groups of %d)%s", len(targets), GROUP,
                f"; inputs of {FLOAT_ROWS}+ rows multiply their float weights (faster here)" if keep_float else "")
    return len(targets)


@torch.inference_mode()
def float_is_faster(linear: torch.nn.Linear) -> bool:
    """Whether this CPU multiplies a prefill chunk (:data:`MEASURED_ROWS` rows) by ``linear`` faster
    in float32 than by its 4-bit form: each timed twice after a first call, the faster of each kept."""
    if linear.weight.dtype != torch.float32:
        return False  # a bf16/fp16 model's own GEMM is what its prefill runs; nothing float32 to keep
    x = torch.randn(MEASURED_ROWS, linear.in_features)
    packed = Int4Linear(linear)  # keep_float=False: always the kernel

    def seconds(layer: torch.nn.Module) -> float:
        layer(x)
        times = []
        for _ in range(2):
            started = time.perf_counter()
            layer(x)
            times.append(time.perf_counter() - started)
        return min(times)

    return seconds(linear) < seconds(packed)
