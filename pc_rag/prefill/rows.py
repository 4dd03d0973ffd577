"""What assembly hands to the passes: the rows' KV and positions (:class:`Rows`), the tokens they
compute (:class:`Inputs`), and a prefilled batch (:class:`Prefilled`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..forward.shared_attention import SharedKV
from ..kv.buffers import KVBuffer


@dataclass
class Rows:
    """What a batch of rows attends to while it is prefilled and decoded."""

    buffer: KVBuffer  # each row's own KV, [rows, capacity] entries
    key_positions: torch.Tensor  # [rows, capacity] int64: the position of every entry
    valid: torch.Tensor  # [rows, capacity] bool: real entries (not padding)
    shared: SharedKV | None = None  # KV read where it is stored (zero-copy, shared by rows)
    # one row whose cache holds its tokens in position order and nothing else (full prefill, or a
    # model served segment by segment): transformers' own masks are right, and none is passed
    ordered: bool = False
    bias: torch.Tensor | None = None  # [rows, capacity]: added to every query's logits for each entry (APE)
    holes: bool = False  # some entries are masked out (recomputed further on): every step needs a mask
    # per row, the cached segments copied into its own cache: (signature, first entry, entry after
    # the last); a row admitted later that reads the same segment shared lets this row read that
    # part instead (its copy masked). None: not tracked (entries recovery masks one by one)
    copies: list[list[tuple[tuple, int, int]]] | None = None

    @property
    def batch(self) -> int:
        return self.buffer.batch


@dataclass
class Inputs:
    """The tokens every row computes, left-padded so that every row's last column is its last token."""

    ids: torch.Tensor  # [rows, width]
    positions: torch.Tensor  # [rows, width]; padding takes its row's first position (it must see some key)
    real: torch.Tensor  # [rows, width] bool: not padding
    bounds: tuple[int, int]  # smallest and largest position (read on the host, never from the device)

    @classmethod
    def left_padded(cls, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], placeholder_id: int, device: torch.device) -> Inputs:
        """Rows of ``(token ids, positions)`` (each in position order), left-padded to one width."""
        width = max(len(row_ids) for row_ids, _ in sequences)
        batch = len(sequences)
        ids = torch.full((batch, width), placeholder_id, dtype=torch.long)
        positions = torch.zeros(batch, width, dtype=torch.long)
        real = torch.zeros(batch, width, dtype=torch.bool)
        for row, (row_ids, row_positions) in enumerate(sequences):
            pad = width - len(row_ids)
            ids[row, pad:] = torch.as_tensor(row_ids)
            positions[row, pad:] = torch.as_tensor(row_positions)
            positions[row, :pad] = int(row_positions[0])  # padding queries see what the row's first token sees: no NaN
            real[row, pad:] = True
        low = min(int(p[0]) for _, p in sequences)
        high = max(int(p[-1]) for _, p in sequences)
        return cls(ids.to(device), positions.to(device), real.to(device), (low, high))


@dataclass
class Prefilled:
    """A batch after prefill: its rows, every row's first-token logits, and what recovery did."""

    rows: Rows
    logits: torch.Tensor  # [rows, vocab]
    order: list[int]  # row -> index of its plan
    assembled_at: float
    recomputed: list[int] | None = None  # cached entries each row recomputed (scored recovery)
