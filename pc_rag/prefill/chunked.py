"""One newcomer's prompt prefilled a chunk per iteration while other rows decode.

The scheduler (:mod:`pc_rag.scheduler`) admits a request alone beside running rows this way
(the rule: :func:`pc_rag.admission.in_chunks`): each chunk of the step budget is prefilled in a
pass of its own (:meth:`ChunkedPrefill.prefill_next`) or rides on the running rows' decode step
in one packed forward pass (:meth:`ChunkedPrefill.next_tokens`, then :meth:`ChunkedPrefill.took`),
so a long prompt never stalls the running rows for more than one budget. Each chunk attends to
what the chunks before it wrote, so the row is the one pass's, computed in pieces
(:func:`pc_rag.prefill.passes.chunks_of`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from ..forward.forward import Forward, NewTokens
from ..kv.buffers import KVBuffer
from ..model.spec import ModelSpec
from .assemble import Assembled
from .passes import chunks_of, new_tokens, prefill
from .rows import Inputs, Prefilled


@dataclass
class ChunkedPrefill:
    """A row's assembled prompt and the chunks of it still to prefill, in order."""

    assembled: Assembled  # its row (buffer, positions, shared parts) and inputs
    assembled_at: float
    chunks: deque[Inputs]
    logits: torch.Tensor | None = None  # the last chunk's, once every chunk is prefilled

    @classmethod
    def of(cls, assembled: Assembled, assembled_at: float, chunk_tokens: int) -> "ChunkedPrefill":
        return cls(assembled, assembled_at, deque(chunks_of(assembled.rows, assembled.inputs, chunk_tokens)))

    @property
    def buffer(self) -> KVBuffer:
        return self.assembled.rows.buffer

    @property
    def done(self) -> bool:
        return self.logits is not None

    def prefill_next(self, forward: Forward, spec: ModelSpec) -> None:
        """The next chunk, in a forward pass of its own."""
        self.took(prefill(forward, self.assembled.rows, self.chunks.popleft(), spec))

    def next_tokens(self, spec: ModelSpec) -> NewTokens:
        """The next chunk as one batch of a packed forward pass (``alongside`` the running rows'
        step: :meth:`pc_rag.decode.loop.RunningBatch.feed`); its logits go to :meth:`took`."""
        return new_tokens(self.assembled.rows, self.chunks.popleft(), spec)

    def took(self, logits: torch.Tensor) -> None:
        """A chunk is prefilled; after the last, ``logits`` are the row's."""
        if not self.chunks:
            self.logits = logits

    def prefilled(self) -> Prefilled:
        """The row, once :attr:`done`, as a one-pass prefill returns it."""
        assert self.logits is not None
        return Prefilled(self.assembled.rows, self.logits, self.assembled.order, self.assembled_at)
