"""Forward passes: module text -> per-layer K/V at given positions, and logits for new tokens."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from .kvcache import KVBuffer, ModuleKV
from .shared_attention import KWARG, SharedKV


def _shared_kwargs(shared: SharedKV | None, positions: torch.Tensor) -> dict[str, Any]:
    """The forward keyword that hands shared KV to the attention function (none without it)."""
    return {} if shared is None else {KWARG: shared.for_queries(positions)}


class Forward:
    """Runs the model over new tokens at explicit positions, appending to a :class:`KVBuffer`.

    Counts its work (thread-safe): ``passes`` (forward passes of any kind) and ``encoded``
    (token sequences encoded as module KV). Tests use them to prove that a cache hit runs no
    forward pass and that concurrent callers encode every module once.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.passes = 0
        self.encoded = 0
        self._count_lock = threading.Lock()

    def _count(self, passes: int, encoded: int = 0) -> None:
        with self._count_lock:
            self.passes += passes
            self.encoded += encoded

    def reset_counts(self) -> None:
        with self._count_lock:
            self.passes = self.encoded = 0

    @torch.inference_mode()
    def __call__(
        self,
        buffer: KVBuffer,
        token_ids: Sequence[int],
        positions: Sequence[int],
        *,
        logits: bool,
        mask: torch.Tensor | None = None,
        shared: SharedKV | None = None,
    ) -> torch.Tensor | None:
        """Extend ``buffer`` with ``token_ids``; return the last token's logits when asked.

        ``mask`` (``[1, 1, new, buffer + new]``, see :func:`pc_rag.attention.position_mask`)
        replaces the causal mask transformers would build from buffer order. ``shared`` is KV
        attended to besides the buffer, read in place (see :mod:`pc_rag.shared_attention`).
        """
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        pos = torch.tensor([list(positions)], dtype=torch.long)
        if logits:
            return self._step(buffer, ids, pos, mask, shared)[0]
        self._count(1)
        device = self.model.device
        pos = pos.to(device)
        self.model.base_model(
            input_ids=ids.to(device), position_ids=pos, attention_mask=mask, past_key_values=buffer.cache, use_cache=True,
            **_shared_kwargs(shared, pos),
        )
        return None

    def decode_batch(
        self, buffer: KVBuffer, token_ids: Sequence[int], positions: Sequence[int], mask: torch.Tensor, shared: SharedKV | None = None
    ) -> torch.Tensor:
        """One decoding step for every row of a batched ``buffer``: logits ``[rows, vocab]``."""
        ids = torch.tensor(list(token_ids), dtype=torch.long)[:, None]
        pos = torch.tensor(list(positions), dtype=torch.long)[:, None]
        return self._step(buffer, ids, pos, mask, shared)

    def prefill_batch(
        self, buffer: KVBuffer, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, shared: SharedKV | None = None
    ) -> torch.Tensor:
        """Run ``ids [rows, n]`` (left-padded, so every row's last column is a real token) at
        ``positions``: the last column's logits, ``[rows, vocab]``."""
        return self._step(buffer, ids, positions, mask, shared)

    @torch.inference_mode()
    def _step(
        self, buffer: KVBuffer, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None, shared: SharedKV | None = None
    ) -> torch.Tensor:
        """Run ``ids [rows, n]`` at ``pos``; the last token's logits of each row, ``[rows, vocab]``."""
        self._count(1)
        device = self.model.device
        pos = pos.to(device)
        # logits_to_keep=1: the vocabulary projection runs for the last token only
        out = self.model(
            input_ids=ids.to(device), position_ids=pos, attention_mask=mask, past_key_values=buffer.cache,
            use_cache=True, logits_to_keep=1, **_shared_kwargs(shared, pos),
        )
        return out.logits[:, -1]

    def encode(self, token_ids: Sequence[int], positions: Sequence[int], prefix: ModuleKV | None = None) -> ModuleKV:
        """The KV of ``token_ids`` at ``positions``, attending to ``prefix`` (if any) and to themselves."""
        before = len(prefix) if prefix is not None else 0
        buffer = KVBuffer.for_model(self.model, before + len(token_ids))
        if prefix is not None:
            buffer.append(prefix.kv)
        self._count(0, 1)
        self(buffer, token_ids, positions, logits=False)
        kv = buffer.slice(before, before + len(token_ids)).clone()
        return ModuleKV(kv, torch.tensor(list(positions), dtype=torch.long))

    @torch.inference_mode()
    def encode_batch(
        self, sequences: Sequence[Sequence[int]], start: int, prefix: ModuleKV | None = None, *, pad_id: int = 0
    ) -> list[ModuleKV]:
        """The KV of several token sequences, each at positions ``start, start+1, ...`` behind ``prefix``.

        One forward pass for all: rows are right-padded, and since attention is causal a real
        token never sees the padding after it, so no mask is needed and each row's KV equals
        what :meth:`encode` gives it alone.
        """
        before = len(prefix) if prefix is not None else 0
        width = max(len(s) for s in sequences)
        buffer = KVBuffer.for_model(self.model, before + width, batch=len(sequences))
        if prefix is not None:
            buffer.append(prefix.kv)
        device = self.model.device
        ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        positions = torch.arange(start, start + width, dtype=torch.long).expand(len(sequences), -1)
        self._count(1, len(sequences))
        self.model.base_model(input_ids=ids.to(device), position_ids=positions.to(device), past_key_values=buffer.cache, use_cache=True)
        return [
            ModuleKV(buffer.slice(before, before + len(seq), row).clone(), torch.arange(start, start + len(seq), dtype=torch.long))
            for row, seq in enumerate(sequences)
        ]

    def keys_at(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        """Keys ``[layers, heads, n, dim]`` of ``token_ids`` encoded alone from position ``start``."""
        module = self.encode(token_ids, range(start, start + len(token_ids)))
        return module.kv[:, 0]
