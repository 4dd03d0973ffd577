"""Decode-sized linear layers on a CPU as ``W @ x^T``.

A decode step multiplies every weight matrix by a few rows, one per running request. On a CPU,
``F.linear`` (``x @ W^T``) for 2-16 rows streams the weights more than once: with MKL, 2-3 rows
take as long as one matrix-vector product per row, and more rows as a GEMM that packs ``W`` first.
Measured on the 2-core development machine (``benchmarks/serving.py linear``), one sweep over
SmolLM2-135M's linear layers (538 MB of float32 weights, never in cache): 47 ms for one row,
98-101 ms for 2-3 rows, 62-75 ms for 4-8; the same products as ``W @ x^T`` (the weights on the
left, ``x^T`` a transposed view, no copy) take 26-56 ms for 2-8 rows. A decode step of 2 rows
sharing their documents that cost 1.9x one row's costs 1.2x.

The product is the same; only the summation order inside the kernel differs (float rounding).
One row and prefill-sized inputs keep ``F.linear``, which is as fast or faster there.
"""

from __future__ import annotations

import logging
from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

ROWS = range(2, 17)  # input rows (tokens x batch) that take W @ x^T: decode steps of up to 16 requests
MIN_WEIGHT_BYTES = 32 << 20  # smaller models' weights stay in cache, where F.linear is not slower


def linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``: ``W @ x^T`` for :data:`ROWS` rows on a CPU, ``F.linear`` otherwise."""
    return product(x, module.weight, module.bias)


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, as ``W @ x^T`` for :data:`ROWS` rows on a CPU."""
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    # comparisons, not `in ROWS`: under torch.compile with a symbolic batch size they become guards
    if not ROWS.start <= rows < ROWS.stop or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    # [rows, out] in row order again: model code may .view() what a projection returns (a few KB)
    out = torch.mm(weight, x.reshape(rows, features).t()).t().contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def wanted(model: Any) -> bool:
    """The default: a float32 model on a CPU whose linear weights do not stay in cache."""
    device = getattr(model, "device", None)
    if device is None or torch.device(device).type != "cpu" or getattr(model, "dtype", None) != torch.float32:
        return False
    weights = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) is torch.nn.Linear)
    return weights >= MIN_WEIGHT_BYTES


def _routed(module: torch.nn.Module) -> bool:
    """Whether ``module``'s own ``forward`` (an instance attribute, over the class's) is :func:`linear`."""
    forward = vars(module).get("forward")
    return isinstance(forward, MethodType) and forward.__func__ is linear


def install(model: Any, enabled: bool | None = None) -> bool:
    """Route ``model``'s ``nn.Linear`` layers through :func:`linear` (``enabled=None``: where
    :func:`wanted`), or back to their own forward (``False``); returns whether they take it.

    Only plain ``nn.Linear`` modules change (not subclasses such as quantized layers), and not
    those an accelerate hook wraps (it owns their ``forward``).
    """
    on = wanted(model) if enabled is None else enabled
    changed = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or hasattr(module, "_hf_hook") or _routed(module) == on:
            continue
        if on:
            module.forward = MethodType(linear, module)
        else:
            del module.forward  # the class's forward again
        changed += 1
    if changed:
        logger.info("%s W @ x^T for decode-sized inputs in %d linear layers", "using" if on else "no longer using", changed)
    return on
