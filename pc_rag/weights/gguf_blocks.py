"""A GGUF file's own blocks for the linear layers of a model read from it (``weights="int4"``).

transformers reads a GGUF file by dequantizing every tensor to float32; :mod:`pc_rag.weights.blocks`
would then quantize those floats again. Where a tensor's GGUF type is one pc-rag's blocks hold
(32 weights a float32 scale, 4-bit values with a float32 minimum or signed 8-bit values), its
layer is built from the file's blocks instead, value for value:

- ``Q4_0`` (``d * (q - 8)``) and ``Q4_1`` (``d * q + m``): 4 bits, scale ``d``, minimum ``-8d`` or ``m``.
- ``Q4_K``: super-blocks of 256 whose eight blocks of 32 each have a scale ``d * sc`` and a minimum
  ``-dmin * m`` (6-bit ``sc`` and ``m`` times the fp16 ``d`` and ``dmin``: exact in float32): 4 bits.
- ``Q8_0`` (``d * q``) and ``Q5_0`` (``d * (q - 16)``, 5-bit values in 8): 8 bits, scale ``d``.

Every product above is exact in float32 and the kernels' dequantization rounds ``q * d + m`` once, as
gguf's does: a layer built from the file holds the very floats transformers loaded, checked value
for value against the model's weight before it is used (rows may be permuted: Llama's query and key
rows are stored in another order). Other types (``Q5_1``, ``Q5_K``, ``Q6_K``, ``F16`` ...) cannot be
held in one scale (and no minimum) per 32 at 8 bits: their layers are quantized from their floats
to 8-bit blocks (finer than the file's own 5-6 bits a weight, not equal to them), named in one log
line with their largest error.
"""

from __future__ import annotations

import logging
import os
from collections import Counter, defaultdict
from typing import Any

import numpy as np
import torch

from ..kernels.products import BLOCK, pack_nibbles
from .blocks import Quantized, quantize8

logger = logging.getLogger(__name__)

# the decode KL such layers cost, as measured (docs/performance.md#a-gguf-file-of-other-block-types-q4_k_m), and how to measure it
MEASURED_COST = ("SmolLM2-135M's Q4_K_M file, 14 Q6_K layers: decode KL 1.5e-4 against the file's own values; this file's: "
                 "python benchmarks/decode_fidelity.py --model FILE")
HELD = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q8_0": 8, "Q5_0": 8}  # GGUF types held as they are, and at how many bits


def _halves(data: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte ``start`` of each block (``data [blocks, bytes]``), as float32."""
    return np.ascontiguousarray(data[:, start : start + 2]).view(np.float16).astype(np.float32)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF's 16 bytes a block of 32 (``[blocks, 16]``): values 0-15 (low nibbles first, then high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def unpack(kind: str, data: np.ndarray, rows: int, columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A ``rows x columns`` tensor's raw GGUF blocks (``data``, uint8) of a :data:`HELD` type as ``q
    [rows, columns]`` (0..15 at 4 bits, int8 at 8), float32 ``scales [rows, columns / 32]`` and (4 bits)
    ``minimums``: ``w = scale * q + minimum`` per block of 32, as gguf dequantizes it."""
    groups = rows * columns // BLOCK
    if kind == "Q4_K":
        from gguf.quants import Q4_K

        supers = data.reshape(-1, 144)
        d, dmin = _halves(supers, 0), _halves(supers, 2)
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(supers[:, 4:16]))
        scales = (d[:, None] * sc.astype(np.float32)).reshape(rows, -1)
        minimums = -(dmin[:, None] * m.astype(np.float32)).reshape(rows, -1)
        qs = supers[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        return (qs & 0x0F).reshape(rows, columns), scales, minimums
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22}[kind]
    blocks = data.reshape(groups, size)
    d = _halves(blocks, 0)
    if kind == "Q4_0":
        return _nibbles(blocks[:, 2:]).reshape(rows, columns), d.reshape(rows, -1), (-8 * d).reshape(rows, -1)
    if kind == "Q4_1":
        return _nibbles(blocks[:, 4:]).reshape(rows, columns), d.reshape(rows, -1), _halves(blocks, 2).reshape(rows, -1)
    if kind == "Q8_0":
        return np.ascontiguousarray(blocks[:, 2:]).view(np.int8).reshape(rows, columns), d.reshape(rows, -1), None
    high = np.ascontiguousarray(blocks[:, 2:6]).view(np.uint32) >> np.arange(32, dtype=np.uint32)  # Q5_0: each value's 5th bit
    q = (_nibbles(blocks[:, 6:]) | ((high & 1).astype(np.uint8) << 4)).astype(np.int8) - 16
    return q.reshape(rows, columns), d.reshape(rows, -1), None


def _held(q: np.ndarray, scales: np.ndarray, minimums: np.ndarray | None) -> Quantized:
    """``unpack``'s arrays as :class:`~pc_rag.weights.blocks.BlockLinear` holds them."""
    exact = torch.ones(scales.shape, dtype=torch.bool)
    if minimums is None:
        return torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(np.ascontiguousarray(scales)), None, exact
    return (pack_nibbles(torch.from_numpy(q.astype(np.int32))), torch.from_numpy(np.ascontiguousarray(scales)),
            torch.from_numpy(np.ascontiguousarray(minimums)), exact)


def _values(q: np.ndarray, scales: np.ndarray, minimums: np.ndarray | None) -> torch.Tensor:
    """The float32 weight ``unpack``'s arrays hold, one rounding a value (the kernels' dequantization)."""
    rows, columns = q.shape
    values = torch.from_numpy(q.astype(np.float32)).view(rows, -1, BLOCK)
    scale = torch.from_numpy(scales)[..., None]
    if minimums is None:
        return (values * scale).view(rows, columns)
    return torch.addcmul(torch.from_numpy(minimums)[..., None], values, scale).view(rows, columns)


def _row_order(held: torch.Tensor, weight: torch.Tensor) -> np.ndarray | None:
    """``order`` such that ``held[order]`` equals ``weight`` value for value, or None (identity first)."""
    if torch.equal(held, weight):
        return np.arange(weight.shape[0])
    width = np.dtype((np.void, 4 * weight.shape[1]))
    file_rows = np.ascontiguousarray(held.numpy()).view(width).ravel()
    model_rows = np.ascontiguousarray(weight.numpy()).view(width).ravel()
    by_file, by_model = np.argsort(file_rows, kind="stable"), np.argsort(model_rows, kind="stable")
    if not np.array_equal(file_rows[by_file], model_rows[by_model]):
        return None
    order = np.empty(weight.shape[0], dtype=np.int64)
    order[by_model] = by_file
    return order


def _layer_blocks(tensor: Any, module: torch.nn.Linear) -> tuple[str, int, Quantized, float | None]:
    """A file tensor's type, and the bits and blocks ``module`` gets from it: the file's own where they
    hold its weight value for value (error None), else 8-bit blocks from its floats and their largest
    error against its largest weight."""
    kind, weight = tensor.tensor_type.name, module.weight.detach().float()
    if kind in HELD:
        q, scales, minimums = unpack(kind, np.asarray(tensor.data), module.out_features, module.in_features)
        order = _row_order(_values(q, scales, minimums), weight)
        if order is not None:
            return kind, HELD[kind], _held(q[order], scales[order], None if minimums is None else minimums[order]), None
        kind += " (blocks not the model's values)"  # another file, or a processor's arithmetic on loading
    eight = quantize8(weight)
    error = (eight[0].float().view(*eight[1].shape, BLOCK) * eight[1][..., None]).view_as(weight).sub(weight).abs().max()
    return kind, 8, eight, float(error) / max(float(weight.abs().max()), 1e-30)


def file_blocks(path: str | os.PathLike, model: Any) -> dict[str, tuple[int, Quantized]]:
    """For each linear layer of ``model`` (its qualified name) whose weight the GGUF file at ``path``
    holds, the bits and blocks :func:`~pc_rag.weights.blocks.install` gives it: a :data:`HELD` type's own
    blocks, checked to hold the layer's weight value for value; another type's floats in 8-bit blocks
    (named in one log line with their largest error). A file whose tensors cannot be matched to the
    model's is logged and gives nothing (its layers are quantized as any float model's)."""
    from gguf import GGUFReader

    where = os.fspath(path)
    try:
        from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

        reader = GGUFReader(where)
        to_model = get_gguf_hf_weights_map(model, TensorProcessor())
    except (OSError, ValueError, KeyError, NotImplementedError, ImportError) as err:  # a file or architecture gguf-py cannot map
        logger.warning("GGUF %s: its tensors cannot be matched to the model's (%s); its layers are quantized from their floats",
                       where, err)
        return {}
    tensors = {to_model[t.name]: t for t in reader.tensors if t.name in to_model}
    names = defaultdict(list)  # a parameter object's names (a tied LM head shares the embedding's)
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names[id(parameter)].append(name)
    chosen: dict[str, tuple[int, Quantized]] = {}
    held: Counter[str] = Counter()
    other: dict[str, list[tuple[str, float]]] = defaultdict(list)  # type -> (layer, largest error against the layer's largest weight)
    for module_name, module in model.named_modules():
        if type(module) is not torch.nn.Linear or module.in_features % BLOCK:
            continue
        tensor = next((tensors[name] for name in names[id(module.weight)] if name in tensors), None)
        if tensor is None:
            continue
        kind, bits, blocks, error = _layer_blocks(tensor, module)
        chosen[module_name] = (bits, blocks)
        if error is None:
            held[kind] += 1
        else:
            other[kind].append((module_name, error))
    if other:
        logger.warning("GGUF %s: layers not held as the file's blocks, quantized from their floats to 8-bit blocks of %d: %s (what it "
                       "costs in answers: %s)", where, BLOCK,
                       "; ".join(f"{kind}: {len(layers)} layers (e.g. {layers[0][0]}), largest error {max(e for _, e in layers):.2%} of "
                                 "a layer's largest weight" for kind, layers in other.items()), MEASURED_COST)
    logger.info("GGUF %s: %d linear layers in the file's own blocks (%s)", where, sum(held.values()),
                ", ".join(f"{kind} {count}" for kind, count in sorted(held.items())) or "none")
    return chosen
