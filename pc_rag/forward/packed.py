"""Packed passes: one forward pass over the new tokens of several batches that attend to
different caches (a running batch's decode step and a newcomer's prefill chunk).

Everything in a decoder layer but attention treats tokens independently, so the new tokens of
every pass run through the weights as one sequence ``[1, tokens]``: on a CPU or a GPU bound by
weight reads, a decode step riding on a prefill chunk costs little more than the chunk alone
(Sarathi's piggybacking; vLLM and SGLang mix prefill and decode tokens the same way). Attention is
where the passes part: ``pc_rag_sdpa`` hands the packed queries, keys and values to
:meth:`PackedStep.attend`, which cuts them back into each pass's rows, writes each pass's keys
and values into its own cache and runs that pass's attention as its own forward pass would
(its mask, its shared KV read in place). The model gets no cache object: the keys reach the
caches here, once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..kv.buffers import KVBuffer
from .row_extents import KWARG as EXTENTS_KWARG
from .row_extents import RowExtents
from .shared_attention import KWARG as SHARED_KWARG
from .shared_attention import SharedStep

KWARG = "pc_rag_packed"


@dataclass(frozen=True)
class Pass:
    """One batch's share of a packed forward pass: ``rows x width`` new tokens, row by row."""

    buffer: KVBuffer  # where its keys and values go, and what its queries attend to
    rows: int
    width: int
    mask: Any  # what its own forward pass would take: [rows, 1, width, keys] (or per layer type)
    shared: SharedStep | None = None  # KV read in place besides its buffer
    extents: RowExtents | None = None  # a decode step's rows attend within these (pc_rag.forward.row_extents)

    @property
    def tokens(self) -> int:
        return self.rows * self.width


class PackedStep:
    """The passes of one packed forward, in the order their tokens are packed."""

    def __init__(self, passes: Sequence[Pass], window_layers: Sequence[bool]) -> None:
        self.passes = list(passes)
        self.window_layers = tuple(window_layers)
        self.starts: list[int] = []
        start = 0
        for p in self.passes:
            self.starts.append(start)
            start += p.tokens
        self.tokens = start

    def _mask(self, p: Pass, layer: int) -> Any:
        if not isinstance(p.mask, dict):
            return p.mask
        sliding = layer < len(self.window_layers) and self.window_layers[layer]
        return p.mask["sliding_attention" if sliding else "full_attention"]

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None, inner: Callable[..., tuple[torch.Tensor, Any]], **kwargs: Any) -> torch.Tensor:
        """``query [1, heads, tokens, dim]`` (and this layer's new ``key``/``value``) attended pass by
        pass through ``inner`` (``pc_rag_sdpa``'s own path); returns ``[1, tokens, heads, dim]``."""
        layer = module.layer_idx
        outs = []
        for p, start in zip(self.passes, self.starts):
            # [1, h, rows * width, d] -> [rows, h, width, d]: views, no copy
            cut = lambda t: t[0, :, start : start + p.tokens].unflatten(1, (p.rows, p.width)).transpose(0, 1)  # noqa: E731
            keys, values = p.buffer.cache.layers[layer].update(cut(key), cut(value))
            extra = {} if p.shared is None else {SHARED_KWARG: p.shared}
            if p.extents is not None:
                extra[EXTENTS_KWARG] = p.extents
            out, _ = inner(module, cut(query), keys, values, self._mask(p, layer), scaling=scaling, **kwargs, **extra)
            outs.append(out.reshape(p.tokens, *out.shape[2:]))  # [rows, width, h, d] -> [tokens, h, d]
        return torch.cat(outs)[None]
