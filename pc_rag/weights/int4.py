"""Linear layers in 4 bits on torch's CPU kernel: ``PromptCache(..., weights="int4")`` where
pc-rag's own kernels (:mod:`pc_rag.weights.blocks`) cannot be built. Decode reads a quarter of the
bytes.

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

Where the CPU has no bf16 instructions (AVX2), the kernel is bound by its arithmetic, not by the
bytes it reads: a prefill (512 rows of the embedded model) took 2.23 s against 1.29 s in float32,
and a batch of 4 rows costs it nearly 2x one row. There each layer also keeps its 4-bit values in
float32 (in place of the weights it was made from: the model grows by the packed bytes, an eighth)
and inputs of :data:`FLOAT_ROWS` rows or more multiply those: decode steps of one to three
requests read 4 bits; wider batches and prefill run at float32's speed, all on the same weights.
Whether the float32 values are kept is measured at install on the model's widest layer.

Layers a model always hands the same input (q, k and v; gate and up) are joined
(:mod:`pc_rag.weights.siblings`): one kernel call for the group.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..errors import PromptCacheError
from . import small_batch
from .siblings import Siblings, join_siblings, joined_bias

logger = logging.getLogger(__name__)

GROUP = 32  # input features per scale and zero (GGUF Q4_1's block)
# inputs this wide multiply the float weights where kept: the 4-bit kernel is compute-bound on AVX2, and
# over the embedded model's MLP layers (weights not in cache) it takes 13, 14, 17 and 22 ms for 1-4 rows
# and 33 for 8, where float32 takes 18.5 ms for one row and about as long for 2-16 as W @ x^T
# (pc_rag.weights.small_batch): decode steps of 1-3 rows read 4 bits, wider batches and prefill float32
FLOAT_ROWS = 4
MEASURED_ROWS = 512  # the width of the product install times both ways (a prefill chunk)


class Int8Linear(torch.nn.Module):
    """The output projection (the LM head) in 8 bits, one scale per output row (torch's
    ``aten._weight_int8pack_mm``, bf16 activations): GGUF files keep it at 8 bits or more (the embedded
    model's is Q8_0). In 4 bits it alone moved the first token's distribution by a KL of 0.033 against
    float32 (median of 8 held-out prompts; 0.0001 with every other layer in 4 bits), for ~1 ms a step."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(torch.bfloat16)
        self.register_buffer("packed", (weight / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int8pack_mm(rows, self.packed, self.scales).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def int4_product(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x``'s rows (bf16 for the kernel) times 4-bit weights, ``[rows, out]`` in ``x``'s dtype, plus ``bias``."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, GROUP, scales_and_zeros).to(x.dtype)
    return out if bias is None else out + bias


class Int4Linear(torch.nn.Module):
    """``nn.Linear``'s product over 4-bit weights (see the module docstring); outputs in the input's dtype."""

    def __init__(self, linear: torch.nn.Linear, *, keep_float: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed, scales_and_zeros, values = quantize(linear.weight.detach())
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        # inputs of FLOAT_ROWS rows or more multiply the 4-bit values in float32 (see the module docstring):
        # the same weights at every width, so a token computed in a prefill and recomputed alone agree.
        # Not persistent: they follow from the packed values and scales, which the engine's
        # fingerprint hashes, so replicas that measured differently still share module KV
        self.register_buffer("float_weight", values if keep_float else None, persistent=False)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.siblings: Siblings | None = None  # layers always handed the same input: one product for all
        self.sibling = 0  # this layer's place among them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float_weight is not None and x.numel() >= FLOAT_ROWS * self.in_features:
            return small_batch.product(x, self.float_weight, self.bias)
        if self.siblings is not None:
            return self.siblings.output(self.sibling, x)
        return int4_product(x, self.packed, self.scales_and_zeros, self.bias).reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer computes with (for tests and fidelity reports)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scales_and_zeros).float().t()


def join(layers: list[Int4Linear]) -> Siblings:
    """One :class:`~pc_rag.weights.siblings.Siblings` product over ``layers``' joined 4-bit weights: the
    layers' packed weights become views of the joined ones (no copy)."""
    packed = torch.cat([layer.packed for layer in layers])
    scales_and_zeros = torch.cat([layer.scales_and_zeros for layer in layers], dim=1)
    bias = joined_bias(layers)
    start = 0
    for layer in layers:
        layer.packed = packed[start : start + layer.out_features]  # a view of the joined rows
        start += layer.out_features

    def detach() -> None:  # each layer on its own copy of its rows
        for layer in layers:
            layer.packed = layer.packed.clone()

    return Siblings(layers, lambda x: int4_product(x, packed, scales_and_zeros, bias), detach)


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
    """Replace ``model``'s linear layers by :class:`Int4Linear` for ``weights="int4"`` (its output
    projection by :class:`Int8Linear`); returns how many were replaced (0 for any other ``weights``,
    which :mod:`pc_rag.weights.choice` checks).
    A CPU model only (the kernels are torch's CPU ones), and only layers whose inputs come in whole
    groups of 32. ``keep_float``: wide inputs multiply the float weights (None: where
    :func:`float_is_faster` measures it so)."""
    if weights != "int4":
        return 0
    if torch.device(model.device).type != "cpu":
        raise PromptCacheError(f'weights="int4" runs on a CPU (torch\'s int4 CPU kernel); this model is on {model.device}', param="weights")
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear and child.in_features % GROUP == 0]
    if keep_float is None:
        keep_float = bool(targets) and float_is_faster(max((child for _, _, child in targets), key=lambda c: c.weight.numel()))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for parent, name, child in targets:
        setattr(parent, name, Int8Linear(child) if child is head else Int4Linear(child, keep_float=keep_float))
    joined = join_siblings(model, [module for module in model.modules() if isinstance(module, Int4Linear)], join)
    logger.info("%d linear layers in 4 bits (groups of %d), %d groups of them joined%s", len(targets), GROUP, joined,
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
