"""Quantized linear layers a model always hands the same input (attention's q, k and v; an MLP's
gate and up), multiplied as one: one kernel call and one preparation of the input instead of one
per layer. Used by :mod:`pc_rag.weights.int4` (torch's 4-bit kernel) and :mod:`pc_rag.weights.blocks`
(pc-rag's kernels); each says how to join its layers' weights.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)


class Siblings:
    """Layers handed the same input: the first one called multiplies it by all their weights at once
    (``product``) and each layer returns its slice. Outputs wait per thread (a model may run on
    several), and a layer called with another input recomputes them all. Each layer gets
    ``.siblings`` (this group) and ``.sibling`` (its place); ``undo`` puts each back on its own
    weights (the joining layer's ``detach``)."""

    def __init__(self, layers: Sequence[torch.nn.Module], product: Callable[[torch.Tensor], torch.Tensor],
                 detach: Callable[[], None]) -> None:
        self.layers = list(layers)
        self.sizes = [layer.out_features for layer in self.layers]
        self.product, self.detach = product, detach
        for index, layer in enumerate(self.layers):
            layer.siblings, layer.sibling = self, index
        self._waiting = threading.local()

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``index``'s output for ``x``: from the joined product of ``x``, computed at most once
        per sibling's call."""
        waiting = self._waiting
        if getattr(waiting, "input", None) is not x or index not in waiting.pending:
            out = self.product(x)
            waiting.input, waiting.outputs, waiting.pending = x, out.split(self.sizes, dim=-1), set(range(len(self.layers)))
        waiting.pending.discard(index)
        out = waiting.outputs[index]
        if not waiting.pending:  # every sibling served: let go of the input and the product
            waiting.input = waiting.outputs = None
        return out.reshape(*x.shape[:-1], self.sizes[index])

    def undo(self) -> None:
        """Each layer back on its own weights."""
        for layer in self.layers:  # first: detach replaces the layers' weights, which must not undo again
            layer.siblings, layer.sibling = None, 0
        self.detach()


def joined_bias(layers: Sequence[torch.nn.Module]) -> torch.Tensor | None:
    """The layers' biases end to end (zeros for a layer without), or None if none has one."""
    biases = [layer.bias for layer in layers]
    if all(b is None for b in biases):
        return None
    return torch.cat([b.detach() if b is not None else torch.zeros(layer.out_features) for b, layer in zip(biases, layers)])


@torch.inference_mode()
def join_siblings(model: Any, layers: Sequence[torch.nn.Module], join: Callable[[list], Siblings],
                  kind: Callable[[torch.nn.Module], Hashable] = lambda layer: layer.in_features) -> int:
    """Join the ``layers`` that one short pass of ``model`` shows are handed the very same input
    tensor (and share a ``kind``) with ``join``, kept only if the pass's logits stay bitwise the
    same; returns how many groups were joined. A model whose pass fails keeps its layers apart."""
    handed: dict[int, list[torch.nn.Module]] = {}
    keep: list[torch.Tensor] = []  # the inputs stay alive during the pass, so no id is reused

    def record(layer: torch.nn.Module, args: tuple[Any, ...]) -> None:  # returns None: the arguments go on unchanged
        keep.append(args[0])
        handed.setdefault(id(args[0]), []).append(layer)

    hooks = [layer.register_forward_pre_hook(record) for layer in layers]
    ids = torch.arange(4, dtype=torch.long)[None] % max(1, getattr(model.config, "vocab_size", 4))
    try:
        before = model(input_ids=ids).logits
    except Exception as err:  # noqa: BLE001 - any failure: the layers simply stay apart
        logger.info("layers not joined: a probe pass failed (%s)", err)
        return 0
    finally:
        for hook in hooks:
            hook.remove()
    groups = [join(group) for group in handed.values()
              if len(group) > 1 and len(set(map(id, group))) == len(group) and len(set(map(kind, group))) == 1]
    if groups and not torch.equal(model(input_ids=ids).logits, before):
        for group in groups:
            group.undo()
        logger.info("layers not joined: the joined product changed the logits")
        return 0
    return len(groups)
