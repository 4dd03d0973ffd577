"""The probe: a forward pass read layer by layer from inside the attention function.

Scored recovery (:mod:`pc_rag.prefill.scored`) hands a :class:`Probe` to the model as a forward keyword
(``PROBE_KWARG``), the way shared KV reaches it; pc-rag's attention function
(:mod:`pc_rag.forward.attention`) gives it each layer's queries and keys, and it ends the pass early
(:class:`ProbeDone`) after its last layer.
"""

from __future__ import annotations

from typing import Any

import torch

PROBE_KWARG = "pc_rag_probe"


class ProbeDone(Exception):
    """Raised by the attention function after the probe's last layer: the rest of the model is not run."""


class Probe:
    """Reads a forward pass layer by layer from inside the attention function.

    ``stop_after``: the last layer to run (its KV is written before its attention runs, so the
    cache holds it). ``query_weight [rows, q]`` (the real, not padded, queries): when given,
    every layer's attention probabilities from those queries are summed over heads and queries
    into ``scores [rows, keys]``.
    """

    def __init__(self, stop_after: int, query_weight: torch.Tensor | None = None) -> None:
        self.stop_after = stop_after
        self.query_weight = query_weight
        self.scores: torch.Tensor | None = None
        self._calls = 0

    def observe(self, module: Any, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float | None) -> None:
        layer = getattr(module, "layer_idx", None)
        layer = self._calls if layer is None else layer
        self._calls += 1
        if self.query_weight is not None:
            self._score(query, key, mask, scaling)
        if layer >= self.stop_after:
            raise ProbeDone

    def _score(self, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float | None) -> None:
        rows, heads, q, dim = query.shape
        kv_heads, keys = key.shape[1], key.shape[2]
        groups = heads // kv_heads
        scale = scaling if scaling is not None else dim**-0.5
        # grouped queries against their shared key head, no repeated keys: [rows, kv_heads, groups*q, keys]
        logits = torch.matmul(query.reshape(rows, kv_heads, groups * q, dim).float(), key.float().transpose(-1, -2)) * scale
        logits = logits.view(rows, kv_heads, groups, q, keys)
        if mask is None and q > 1:  # transformers' causal case: the queries are the last q keys
            causal = torch.ones(q, keys, dtype=torch.bool, device=logits.device).tril(keys - q)
            logits = logits.masked_fill(~causal, float("-inf"))
        elif mask is not None:
            if mask.dtype == torch.bool:
                logits = logits.masked_fill(~mask[:, :, None, :, :keys], float("-inf"))
            else:
                logits = logits + mask[:, :, None, :, :keys].float()
        probs = logits.softmax(-1)
        weight = self.query_weight.to(probs.device, probs.dtype)  # type: ignore[union-attr]
        scores = torch.einsum("rhgqk,rq->rk", probs, weight)
        self.scores = scores if self.scores is None else self.scores + scores
