"""Linear layers over weights in blocks of 32, 4 or 8 bits a weight, with pc-rag's own kernels
(``PromptCache(..., weights="int4")`` where :mod:`pc_rag.kernels.library` builds).

A decode step is bound by the bytes of weights it reads. The embedded model's GGUF file holds
them as Q4_1 blocks (32 weights: an fp16 scale ``d``, an fp16 minimum ``m`` and 4-bit ``q``,
``w = d*q + m``) and its LM head as Q8_0 (``w = d*q``, ``q`` 8 bits); the float32 model pc-rag
loads is those values dequantized. :func:`quantize4` and :func:`quantize8` find them again
exactly: a block whose minimum and ``(max - min) / 15`` rounded to fp16 reproduce all of its 32
values bit for bit holds the file's own ``d``, ``m`` and ``q``. So these layers compute with the
very weights the float32 model does (products exact, sums rounded differently), at 4.6 bits a
weight for the 4-bit layers. A layer none of whose blocks are exact at 4 bits but all at 8 is
kept at 8; a user's own float checkpoint is quantized from each block's minimum to maximum (lossy,
as asked), its LM head in 8 bits.

Inputs of up to :data:`KERNEL_ROWS` rows (decode steps, a cached prompt's computed tokens) go
through the kernels, which read each weight once for up to 8 rows. Wider inputs (prefill) dequantize the
weight a tile at a time into one reused float32 buffer and run torch's GEMM on it: one copy of
the weights in memory, the 4-bit one. Both are bound by arithmetic on an AVX2 CPU beyond a few
rows, so prompts prefill up to ~1.7x slower than with FBGEMM's fp16 weights (see KERNEL_ROWS);
decode, which reads every weight for a handful of rows, is where 4 bits pay.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from ..errors import PromptCacheError
from ..kernels import ops, products
from ..kernels.loader import library
from ..kernels.products import BLOCK
from .siblings import Siblings, join_siblings, joined_bias

logger = logging.getLogger(__name__)

# inputs up to this many rows take the kernels (decode batches, a cached prompt's computed tokens); wider ones
# (full prefill, encoding) torch's GEMM over dequantized tiles. Every linear layer of the embedded model once, on
# an engine's scheduler thread (2 threads; ms, min of 2): 64 rows 136 here against 191 dequantizing, 128 rows
# 229 against 245, 256 rows 453 against 501; on a thread whose OpenMP team is the process's only one, 256 rows
# 390 against 356, 512 rows 1785-2073 against 981-1245 (wider, the GEMM's blocking wins)
KERNEL_ROWS = 256
TILE_FLOATS = 4 << 20  # a wide input's dequantized tile: at most 16 MB of float32 at a time
_TINY = torch.finfo(torch.float32).tiny
_tiles = threading.local()  # one dequantization buffer per thread, shared by every layer
# a weight in blocks: values (4-bit words or int8), scales, minimums (4 bits; None at 8) and which blocks are exact
Quantized = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None", torch.Tensor]
_WEIGHTS = frozenset(("values", "scales", "minimums", "bias"))
_generation = 0  # see weights_generation


def weights_generation() -> int:
    """A number that changes whenever any :class:`BlockLinear`'s tensors may have been replaced
    (the model moved or cast, a tensor reassigned) or a Parameter was assigned to any module (a
    norm's weight replaced, ``load_state_dict(assign=True)``): what holds their addresses (the
    decode steps) checks it before every step, one comparison instead of one per layer. A
    Parameter's ``.data`` swapped for another tensor is not seen: copy into it, or assign a Parameter."""
    return _generation


def _replaced(*_: Any) -> None:
    global _generation
    _generation += 1


# torch calls this whenever a Parameter is registered on a module (assigned or constructed), for every module in
# the process: building any module also counts, which costs the decode steps one rebuild of their addresses
torch.nn.modules.module.register_module_parameter_registration_hook(_replaced)


class BlockLinear(torch.nn.Module):
    """``nn.Linear``'s product over its weight in blocks of 32 at ``bits`` = 4 or 8 (see the module
    docstring); float32 in and out."""

    def __init__(self, linear: torch.nn.Linear, bits: int, quantized: Quantized | None = None) -> None:
        super().__init__()
        if bits not in (4, 8) or linear.in_features % BLOCK:
            raise PromptCacheError(f"blocks of {BLOCK} at 4 or 8 bits; got {bits} bits over {linear.in_features} inputs",
                                   param="weights")
        self.in_features, self.out_features, self.bits = linear.in_features, linear.out_features, bits
        values, scales, minimums, exact = quantized or (quantize4 if bits == 4 else quantize8)(linear.weight.detach().float())
        self.register_buffer("values", values)
        self.register_buffer("scales", scales)
        self.register_buffer("minimums", minimums)
        self.exact = float(exact.float().mean())  # the share of blocks that hold their weights exactly
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().float().clone(), requires_grad=False)
        self.siblings: Siblings | None = None  # layers always handed the same input: one product for all (join)
        self.sibling = 0  # this layer's place among them
        # 8 (16): the C decode step (pc_rag.forward.fused_step) multiplies it by inputs quantized to 8 (16) bits a block
        self.decode_activation_bits = 32

    def _apply(self, fn: Any, recurse: bool = True) -> BlockLinear:
        try:
            return super()._apply(fn, recurse)
        finally:
            _replaced()

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in _WEIGHTS:
            _replaced()
            group = self.__dict__.get("siblings")
            if group is not None:  # a tensor replaced is no view of the joined ones: each layer on its own again
                group.undo()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or self.scales.dtype != torch.float32 or self.scales.device.type != "cpu":
            raise PromptCacheError(f'weights="int4" multiplies float32 inputs on a CPU by float32 scales there; got {x.dtype} inputs on '
                                   f'{x.device} and {self.scales.dtype} scales on {self.scales.device} (the model was moved or cast '
                                   'after its layers were quantized)', param="weights")
        if torch.compiler.is_compiling():  # one node of the compiled graph (siblings' joined product and tiles are eager-only)
            out = ops.block_product(x.reshape(-1, self.in_features), self.values, self.scales, self.minimums, self.bias)
        elif x.numel() > KERNEL_ROWS * self.in_features:
            out = self.wide(x.reshape(-1, self.in_features))
        elif self.siblings is not None:  # the same x object for every sibling: one joined product
            return self.siblings.output(self.sibling, x)
        else:
            rows = x.reshape(-1, self.in_features).contiguous()
            out = narrow_product(rows, self.bits, self.values, self.scales, self.minimums, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def wide(self, rows: torch.Tensor) -> torch.Tensor:
        """Many rows: the weight dequantized a tile of output features at a time, torch's GEMM on each."""
        tile = max(1, min(self.out_features, TILE_FLOATS // self.in_features))
        buffer = getattr(_tiles, "buffer", None)
        if buffer is None or buffer.numel() < tile * self.in_features:
            buffer = _tiles.buffer = torch.empty(tile * self.in_features)
        pieces = []
        for start in range(0, self.out_features, tile):
            stop = min(self.out_features, start + tile)
            weight = products.dequantize_into(buffer, start, stop, self.values, self.scales, self.minimums, lib=library())
            pieces.append(rows @ weight[: (stop - start) * self.in_features].view(stop - start, self.in_features).t())
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
        return out if self.bias is None else out + self.bias

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer computes with (for tests and fidelity reports)."""
        out = torch.empty(self.out_features * self.in_features)
        products.dequantize_into(out, 0, self.out_features, self.values, self.scales, self.minimums, lib=library())
        return out.view(self.out_features, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, exact={self.exact:.0%}"


def narrow_product(rows: torch.Tensor, bits: int, values: torch.Tensor, scales: torch.Tensor,
                   minimums: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """``rows @ W^T (+ bias)`` through the kernel for ``bits``."""
    if bits == 4:
        return products.q4_matmul(rows, values, scales, minimums, bias, lib=library())
    return products.q8_matmul(rows, values, scales, bias, lib=library())


def join(layers: list[BlockLinear]) -> Siblings:
    """One :class:`~pc_rag.weights.siblings.Siblings` product over ``layers``' joined weights (narrow
    inputs; wide ones stay per layer): each layer's buffers become views of the joined ones."""
    names = ("values", "scales") if layers[0].minimums is None else ("values", "scales", "minimums")
    with torch.inference_mode(False):  # (joined in the probe's inference mode) tensors a caller may still change in place
        joined = {name: torch.cat([getattr(layer, name) for layer in layers]) for name in names}
        bias = joined_bias(layers)
    start = 0
    for layer in layers:  # views of the joined rows; the biases too, so a change in place (load_state_dict) reaches the product
        for name in names:
            setattr(layer, name, joined[name][start : start + layer.out_features])
        if layer.bias is not None:
            layer.bias = torch.nn.Parameter(bias[start : start + layer.out_features], requires_grad=False)
        start += layer.out_features

    def detach() -> None:  # each layer on its own copy of its rows (normal tensors, however late: see above)
        with torch.inference_mode(False):
            for layer in layers:
                for name in names:
                    setattr(layer, name, getattr(layer, name).clone())
                if layer.bias is not None:
                    layer.bias = torch.nn.Parameter(layer.bias.detach().clone(), requires_grad=False)

    return Siblings(layers, lambda x: narrow_product(x.reshape(-1, x.shape[-1]).contiguous(), layers[0].bits, joined["values"],
                                                     joined["scales"], joined.get("minimums"), bias), detach)


def quantize4(weight: torch.Tensor) -> Quantized:
    """``weight [out, in]`` as 4-bit words (:func:`~pc_rag.kernels.library.pack_nibbles`), float32
    scales and minimums ``[out, in / 32]``, and which blocks hold their values exactly (fp16 ``d`` and
    ``m`` that reproduce every value, as a GGUF Q4_1 block's do)."""
    out_features, in_features = weight.shape
    blocks = weight.reshape(out_features, in_features // BLOCK, BLOCK)
    low, high = blocks.amin(-1), blocks.amax(-1)
    scale = (high - low) / 15
    scale16, low16 = scale.half().float(), low.half().float()
    q16 = ((blocks - low16[..., None]) / scale16.clamp_min(_TINY)[..., None]).round().clamp(0, 15)
    exact = (torch.addcmul(low16[..., None], q16, scale16[..., None]) == blocks).all(-1)
    scales, minimums = torch.where(exact, scale16, scale), torch.where(exact, low16, low)
    q = ((blocks - minimums[..., None]) / scales.clamp_min(_TINY)[..., None]).round().clamp(0, 15)
    words = products.pack_nibbles(q.reshape(out_features, in_features))
    return words, scales.contiguous(), minimums.contiguous(), exact


def quantize8(weight: torch.Tensor) -> Quantized:
    """``weight [out, in]`` as int8 values, float32 scales ``[out, in / 32]``, no minimums, and which
    blocks hold their values exactly (an fp16 ``d = max|w| / 127`` that reproduces every value, as
    Q8_0's does)."""
    out_features, in_features = weight.shape
    blocks = weight.reshape(out_features, in_features // BLOCK, BLOCK)
    scale = blocks.abs().amax(-1) / 127
    scale16 = scale.half().float()
    q16 = (blocks / scale16.clamp_min(_TINY)[..., None]).round().clamp(-127, 127)
    exact = (q16 * scale16[..., None] == blocks).all(-1)
    scales = torch.where(exact, scale16, scale)
    q = (blocks / scales.clamp_min(_TINY)[..., None]).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(out_features, in_features).contiguous(), scales.contiguous(), None, exact


def chosen_blocks(linear: torch.nn.Linear, *, head: bool) -> tuple[int, Quantized]:
    """The layer at 4 bits, unless its blocks are exact at 8 bits and not at 4 (a GGUF Q8_0 tensor)
    or it is the LM head of a float checkpoint (4 bits there moved the first token's KL by 0.033):
    the bits and the quantized weight."""
    weight = linear.weight.detach().float()
    four = quantize4(weight)
    if bool(four[3].all()):
        return 4, four
    eight = quantize8(weight)
    return (8, eight) if head or bool(eight[3].all()) else (4, four)


def bits_for(linear: torch.nn.Linear, *, head: bool) -> int:
    """The bits :func:`chosen_blocks` holds ``linear`` in."""
    return chosen_blocks(linear, head=head)[0]


def install(model: Any, *, decode_activation_bits: int = 32, given: dict[str, tuple[int, Quantized]] | None = None) -> int:
    """Replace ``model``'s linear layers (inputs in whole blocks of 32) by :class:`BlockLinear`;
    returns how many were replaced. A float32 CPU model only. ``given``: bits and blocks for layers by
    qualified name (a GGUF file's own: :mod:`pc_rag.weights.gguf_blocks`). ``decode_activation_bits=8``: the C
    decode step quantizes their inputs to 8 bits a block (``weights="int4-a8"``); ``16``: the 4-bit
    layers' inputs to 16 bits where the CPU has AVX512-VNNI (``weights="int4"``: ``a16_kernels.c``)."""
    if torch.device(model.device).type != "cpu" or model.dtype != torch.float32:
        raise PromptCacheError(f'weights="int4" runs a float32 model on a CPU; this one is {model.dtype} on {model.device}',
                               param="weights")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear and child.in_features % BLOCK == 0]
    names = {id(module): name for name, module in model.named_modules()} if given else {}
    layers = []
    for parent, name, child in targets:
        layer = BlockLinear(child, *((given or {}).get(names.get(id(child), "")) or chosen_blocks(child, head=child is head)))
        setattr(parent, name, layer)
        layers.append(layer)
    for module in model.modules():  # layers an earlier engine put in blocks too: the engine built now decides
        if isinstance(module, BlockLinear):
            module.decode_activation_bits = decode_activation_bits
    joined = join_siblings(model, layers, join, kind=lambda layer: (layer.in_features, layer.bits))
    exact = sum(layer.exact * layer.out_features * layer.in_features for layer in layers)
    total = sum(layer.out_features * layer.in_features for layer in layers)
    logger.info("%d linear layers in blocks of %d (%d at 8 bits, %d groups joined); %.1f%% of their weights held exactly",
                len(layers), BLOCK, sum(layer.bits == 8 for layer in layers), joined, 100 * exact / max(1, total))
    return len(layers)
