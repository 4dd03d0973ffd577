"""The kernels' products as torch operators (``torch.ops.pc_rag.block_product``), so that
``torch.compile`` keeps a model forward over weights in blocks as one graph.

Dynamo cannot trace into a ctypes call: every product of a compiled step broke the graph, hundreds
of fragments a step, so ``weights="int4"`` refused ``compile=True``. An operator registered with
``torch.library`` (a schema, and a fake implementation that says the output's shape without
computing it) is one opaque node in the graph instead; inductor calls it as an external kernel.

Only compiled code goes through the operator (:class:`~pc_rag.weights.blocks.BlockLinear` calls the
products directly in eager mode): the dispatcher costs microseconds a call, and an eager step makes
~200 of them.
"""

from __future__ import annotations

import torch

from .loader import library
from .products import q4_matmul, q8_matmul


@torch.library.custom_op("pc_rag::block_product", mutates_args=())
def block_product(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor | None,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``x [rows, in] @ W^T (+ bias)`` for ``W`` in blocks of 32: 4 bits where ``minimums`` is given, else 8."""
    x = x.contiguous()
    if minimums is not None:
        return q4_matmul(x, values, scales, minimums, bias, lib=library())
    return q8_matmul(x, values, scales, bias, lib=library())


@block_product.register_fake
def _block_product_shape(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor | None,
                         bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], scales.shape[0]))
