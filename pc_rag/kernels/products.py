"""The kernels' products from Python: ``x @ W^T`` for weights in blocks of 32 (4 bits with a scale
and a minimum, or 8 with a scale), and their dequantization.

Every pointer handed to C comes with what the C reads through it, checked here first: a tensor of
the wrong dtype, shape, layout or device raises :class:`~pc_rag.errors.PromptCacheError` naming it,
never reaches the C (which would read or write past it). ``lib`` is the loaded library
(:func:`pc_rag.kernels.loader.library`).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..errors import PromptCacheError

BLOCK = 32  # weights per scale (and minimum): GGUF's Q4_1 and Q8_0 blocks
# a16_kernels.c's prepared input, a block of 32: its 16-bit values as two signed bytes each (64) and 5 floats
A16_BYTES_PER_BLOCK = 84
_kernel_threads = threading.local()  # a pass's count for the kernels where torch's own ops run on one thread


def kernel_threads() -> int:
    """The threads a product is shared among: the count :func:`threads_for_kernels` set on this
    thread (a narrow prefill pass, :func:`pc_rag.forward.threads.narrow_pass`), else torch's."""
    return getattr(_kernel_threads, "count", None) or torch.get_num_threads()


@contextmanager
def threads_for_kernels(count: int) -> Iterator[None]:
    """Inside, this thread's products run on ``count`` threads whatever torch's own count is."""
    before = getattr(_kernel_threads, "count", None)
    _kernel_threads.count = count
    try:
        yield
    finally:
        _kernel_threads.count = before


def checked(name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``tensor`` itself, where it is a contiguous CPU tensor of ``dtype`` and ``shape``; else a
    :class:`PromptCacheError` that says which argument differs and how."""
    if not isinstance(tensor, torch.Tensor):
        raise PromptCacheError(f"{name} must be a tensor, got {type(tensor).__name__}", param=name)
    if tensor.dtype != dtype or tuple(tensor.shape) != shape or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise PromptCacheError(f"{name} must be a contiguous CPU {dtype} tensor of shape {list(shape)}, got a "
                               f"{'' if tensor.is_contiguous() else 'non-contiguous '}{tensor.device.type} {tensor.dtype} "
                               f"tensor of shape {list(tensor.shape)}", param=name)
    return tensor


def weight_shapes(values: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor | None,
                  bias: torch.Tensor | None) -> tuple[int, int]:
    """(out_features, in_features) of a weight in blocks, every tensor of it checked against the
    others: 4 bits (``minimums`` given) as int32 words ``[out, in/8]``, 8 bits as int8 ``[out, in]``,
    float32 scales (and minimums) ``[out, in/32]``, a float32 bias ``[out]``."""
    if scales.dim() != 2:
        raise PromptCacheError(f"scales must be [out_features, in_features / {BLOCK}], got shape {list(scales.shape)}", param="scales")
    out_features, in_features = scales.shape[0], scales.shape[1] * BLOCK
    checked("scales", scales, torch.float32, (out_features, in_features // BLOCK))
    if minimums is not None:
        checked("minimums", minimums, torch.float32, (out_features, in_features // BLOCK))
        checked("values", values, torch.int32, (out_features, in_features // 8))
    else:
        checked("values", values, torch.int8, (out_features, in_features))
    if bias is not None:
        checked("bias", bias, torch.float32, (out_features,))
    return out_features, in_features


def _inputs(x: torch.Tensor, in_features: int) -> int:
    """Rows of ``x``, checked as ``[rows, in_features]`` contiguous float32."""
    rows = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else -1
    checked("x", x, torch.float32, (rows, in_features))
    return rows


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def quantized_inputs(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """``x [rows, in]`` as the 8-bit-input kernels (``bits=16``: the 16-bit-input ones) read it: each
    block of 32 rounded (half to even) to ``round(x / s) * s``, ``s`` = its largest magnitude / 127
    (16 bits: / 32512, that is 127 * 256), in the kernels' float32 steps."""
    if bits not in (8, 16):
        raise PromptCacheError(f"quantized_inputs rounds to 8 or 16 bits, got {bits!r}", param="bits")
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / {8: 127, 16: 32512}[bits]
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (torch.round(blocks * inverse) * scale).reshape(x.shape)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit values ``q [out, in]`` (0..15) as the kernels' words ``[out, in / 8]`` (int32 bits):
    weight ``8k + i`` of a block in bits ``4i..4i+3`` of its word ``k``, the top nibble stored ``q ^ 8``."""
    lanes = q.to(torch.int32).reshape(q.shape[0], -1, 8)
    words = lanes[..., 7] ^ 8
    for lane in range(6, -1, -1):  # int32 throughout (a quarter of int64's memory at install)
        words = (words << 4) | lanes[..., lane]
    return words.contiguous()


def q4_matmul(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor,
              bias: torch.Tensor | None, *, lib: ctypes.CDLL) -> torch.Tensor:
    """``x [rows, in] @ W^T (+ bias)`` for a 4-bit ``W`` (contiguous float32 inputs)."""
    out_features, features = weight_shapes(words, scales, minimums, bias)
    rows = _inputs(x, features)
    out = torch.empty(rows, out_features)
    scratch = torch.empty(rows * (features + 2 * features // BLOCK))
    lib.q4_matmul(x.data_ptr(), rows, features, words.data_ptr(), scales.data_ptr(), minimums.data_ptr(),
                  out_features, _pointer(bias), out.data_ptr(), scratch.data_ptr(), kernel_threads())
    return out


def q8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, *,
              lib: ctypes.CDLL) -> torch.Tensor:
    """``x [rows, in] @ W^T (+ bias)`` for an 8-bit ``W`` (contiguous float32 inputs)."""
    out_features, features = weight_shapes(q, scales, None, bias)
    rows = _inputs(x, features)
    out = torch.empty(rows, out_features)
    lib.q8_matmul(x.data_ptr(), rows, features, q.data_ptr(), scales.data_ptr(), out_features,
                  _pointer(bias), out.data_ptr(), kernel_threads())
    return out


def a8_matmul(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor | None,
              bias: torch.Tensor | None, *, lib: ctypes.CDLL) -> torch.Tensor:
    """:func:`q4_matmul` (``minimums`` given) or :func:`q8_matmul` on ``x`` rounded to 8 bits a block
    (:func:`quantized_inputs`), in integers: what the C decode step computes under ``weights="int4-a8"``."""
    out_features, features = weight_shapes(values, scales, minimums, bias)
    rows = _inputs(x, features)
    out = torch.empty(rows, out_features)
    scratch = torch.empty(rows * (features + 8 * features // BLOCK), dtype=torch.uint8)
    ends = (_pointer(bias), out.data_ptr(), scratch.data_ptr(), kernel_threads())
    if minimums is not None:
        lib.q4a8_matmul(x.data_ptr(), rows, features, values.data_ptr(), scales.data_ptr(), minimums.data_ptr(), out_features, *ends)
    else:
        lib.q8a8_matmul(x.data_ptr(), rows, features, values.data_ptr(), scales.data_ptr(), out_features, *ends)
    return out


def a16_matmul(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor,
               bias: torch.Tensor | None, *, lib: ctypes.CDLL) -> torch.Tensor:
    """:func:`q4_matmul` on ``x`` rounded to 16 bits a block (:func:`quantized_inputs` with ``bits=16``),
    in integers: what the C decode step computes under ``weights="int4"`` where ``a16_kernels`` says so
    (AVX512-VNNI; refused elsewhere)."""
    if not lib.a16_kernels(-1):
        raise PromptCacheError("a16_matmul needs AVX512-VNNI and kernels that agreed with torch on it; this CPU or build has not")
    out_features, features = weight_shapes(words, scales, minimums, bias)
    if minimums is None:
        raise PromptCacheError("a16_matmul takes 4-bit weights (minimums given)", param="minimums")
    rows = _inputs(x, features)
    out = torch.empty(rows, out_features)
    scratch = torch.empty(rows * A16_BYTES_PER_BLOCK * (features // BLOCK), dtype=torch.uint8)
    lib.a16_matmul(x.data_ptr(), rows, features, words.data_ptr(), scales.data_ptr(), minimums.data_ptr(), out_features,
                   _pointer(bias), out.data_ptr(), scratch.data_ptr(), kernel_threads())
    return out


def dequantize_into(out: torch.Tensor, start: int, stop: int, values: torch.Tensor, scales: torch.Tensor,
                    minimums: torch.Tensor | None, *, lib: ctypes.CDLL) -> torch.Tensor:
    """Rows ``[start, stop)`` of a 4-bit (``minimums`` given) or 8-bit weight, float32, written row after
    row from the start of ``out`` (a contiguous float32 buffer of at least that many values)."""
    out_features, features = weight_shapes(values, scales, minimums, None)
    if not 0 <= start <= stop <= out_features:
        raise PromptCacheError(f"rows [{start}, {stop}) are not within the weight's {out_features}", param="start")
    if out.numel() < (stop - start) * features:
        raise PromptCacheError(f"out holds {out.numel()} values, fewer than the {(stop - start) * features} of "
                               f"{stop - start} rows of {features}", param="out")
    checked("out", out, torch.float32, tuple(out.shape))
    if minimums is not None:
        lib.q4_dequantize(values.data_ptr(), scales.data_ptr(), minimums.data_ptr(), features, start, stop, out.data_ptr(),
                          kernel_threads())
    else:
        lib.q8_dequantize(values.data_ptr(), scales.data_ptr(), features, start, stop, out.data_ptr(), kernel_threads())
    return out
