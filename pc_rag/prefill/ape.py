"""APE's attention adjustment (arXiv:2502.05431), applied during assembly.

Computed queries attend to the moved cached tokens with logits divided by a temperature and
weights multiplied by a scale (see :mod:`pc_rag.prefill.recovery`). It stacks on any recovery strategy
and costs nothing: the keys of the moved entries are scaled in the request's own copy, and the
scale is a bias added to their logits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .rows import Rows


@dataclass(frozen=True)
class Ape:
    """APE for one assembly (see :mod:`pc_rag.prefill.recovery`): per plan, per segment, whether it moved."""

    temperature: float
    scale: float
    moved: Sequence[Sequence[bool]]


def moved_entries(segments: Sequence[Sequence[Any]], moved: Sequence[Sequence[bool]]) -> torch.Tensor:
    """``[rows, width]`` bool: per row, every entry of its cached ``segments`` (in cache order)
    flagged as its segment's ``moved`` flag."""
    width = max((sum(len(s) for s in row) for row in segments), default=0)
    flags = torch.zeros(len(segments), width, dtype=torch.bool)
    for row, (row_segments, row_moved) in enumerate(zip(segments, moved)):
        per_entry = [m for s, m in zip(row_segments, row_moved) for _ in range(len(s))]
        if per_entry:
            flags[row, : len(per_entry)] = torch.tensor(per_entry)
    return flags


def adjust_attention(rows: Rows, moved: torch.Tensor, temperature: float, scale: float) -> None:
    """APE (arXiv:2502.05431): computed queries attend to the moved cached entries ``moved
    [rows, width]`` (the first ``width`` of each row's cache) with logits divided by
    ``temperature`` (their keys are scaled, in this request's copy) and weighted by ``scale``
    (``log scale`` added to their logits)."""
    width = moved.shape[1]
    moved = moved.to(rows.valid.device)
    if temperature != 1.0:  # keys [layers, rows, heads, width, dim], each moved entry's divided by T
        factor = torch.where(moved, 1.0 / temperature, 1.0).to(rows.buffer.storage.dtype)
        rows.buffer.storage[:, 0, :, :, :width].mul_(factor[None, :, None, :, None])
    if scale != 1.0:
        bias = torch.zeros(rows.valid.shape, dtype=torch.float32, device=rows.valid.device)
        bias[:, :width][moved] = math.log(scale)
        rows.bias = bias
