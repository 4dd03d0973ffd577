"""A prefill pass's attention over only the keys its mask lets it see (CPU).

A cached prompt's computed tokens (its question, chat markers, separators and each moved module's
recomputed head and tail tokens) are few, and spread over the prompt: a recomputed token near the
start attends to a few cached keys, the question to all of them. Their mask is given by positions
(:func:`pc_rag.forward.attention.attention_mask`), and torch's CPU flash kernel computes every
score of a masked pass before the mask removes it: on a 7.7K-token prompt with 230 computed tokens
45% of the scores it computes are masked away.

Here the queries are cut into blocks of :data:`QUERY_BLOCK` (in cache order, which is position
order for a prompt's computed tokens), the keys into tiles of :data:`KEY_TILE`, and each block
attends only to the runs of tiles some query of it sees: one call of the flash kernel per run,
which also returns its log-sum-exp, merged exactly (relay fusion, as in
:mod:`pc_rag.forward.shared_attention`). The plan depends on the mask alone, so it is made once per
pass and read by every layer (:class:`TilePlans`). A skipped tile holds no key any query of the
block sees, so the result is the one call's up to the order of the sums.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .shared_attention import relay_merge

QUERY_BLOCK = 32  # queries attending together: the flash kernel's own block on a CPU
KEY_TILE = 32  # keys skipped together
WORTHWHILE = 0.85  # take the tiles when they leave at most this share of the scores
MIN_KEYS = 256  # shorter passes: one call (the planning would cost what it saves)

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(frozen=True)
class TilePlan:
    """Which keys each block of queries attends to: ``blocks[i] = (q0, q1, ((k0, k1), ...))``, and
    the mask the flash kernel reads (additive, in the queries' dtype)."""

    blocks: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]
    additive: torch.Tensor  # [rows, 1, q, k]


def plan_tiles(mask: torch.Tensor, dtype: torch.dtype, *, query_block: int = QUERY_BLOCK, key_tile: int = KEY_TILE,
               worthwhile: float = WORTHWHILE) -> TilePlan | None:
    """The tiles of ``mask [rows, 1, q, k]`` (boolean, True = attend, or additive) worth attending
    block by block, or None when one call is as good: under ``worthwhile`` of the scores left, and
    every query sees a key (a query that sees none keeps the one call's answer for it)."""
    floor = torch.finfo(mask.dtype).min if mask.dtype.is_floating_point else None
    visible = mask if floor is None else mask > floor
    allowed = visible.any(dim=(0, 1))  # [q, k]: over rows, so one plan serves a batch
    queries, keys = allowed.shape
    if not bool(allowed.any(dim=-1).all()):
        return None
    tiles = -(-keys // key_tile)
    padded = torch.nn.functional.pad(allowed, (0, tiles * key_tile - keys))
    blocks_count = -(-queries // query_block)
    padded = torch.nn.functional.pad(padded, (0, 0, 0, blocks_count * query_block - queries))
    needed = padded.view(blocks_count, query_block, tiles, key_tile).any(dim=3).any(dim=1).tolist()  # one host read
    blocks, area = [], 0
    for index, row in enumerate(needed):
        q0, q1 = index * query_block, min(queries, (index + 1) * query_block)
        runs, start = [], None
        for tile, need in enumerate(row + [False]):
            if need and start is None:
                start = tile
            elif not need and start is not None:
                runs.append((start * key_tile, min(keys, tile * key_tile)))
                start = None
        area += (q1 - q0) * sum(k1 - k0 for k0, k1 in runs)
        blocks.append((q0, q1, tuple(runs)))
    if area > worthwhile * queries * keys:
        return None
    # hidden keys at the dtype's lowest finite value (float32's lowest is -inf in float16): a block's
    # query that sees no key of one run gets a finite log-sum-exp there, which the merge weighs 0
    shown = torch.zeros((), dtype=dtype) if floor is None else mask.to(dtype)
    additive = torch.where(visible, shown, torch.finfo(dtype).min)
    return TilePlan(tuple(blocks), additive)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: TilePlan, scale: float | None) -> torch.Tensor:
    """Attention of ``query [rows, heads, q, dim]`` over ``key``/``value [rows, kv_heads, k, dim]``
    by ``plan``, ``[rows, q, heads, dim]`` (transformers' layout after attention)."""
    out = torch.empty_like(query)
    mask = plan.additive
    for q0, q1, runs in plan.blocks:
        block = query[:, :, q0:q1]
        merged, lse = None, None
        for k0, k1 in runs:
            part, part_lse = _FLASH_CPU(block, key[:, :, k0:k1], value[:, :, k0:k1], 0.0, False,
                                        attn_mask=mask[:, :, q0:q1, k0:k1], scale=scale)[:2]
            merged, lse = (part, part_lse) if merged is None else relay_merge(merged, lse, part, part_lse)
        out[:, :, q0:q1] = merged
    return out.transpose(1, 2).contiguous()


def usable(query: torch.Tensor, key: torch.Tensor, mask: object) -> bool:
    """Whether a pass may take the tiles: a CPU prefill pass (several queries) over enough keys,
    with one mask for every head, as wide as the keys and as long as the queries, and torch's CPU
    flash kernel present."""
    return (_FLASH_CPU is not None and query.device.type == "cpu" and query.shape[2] > 1
            and isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] == 1
            and mask.shape[0] in (1, query.shape[0]) and mask.shape[2] == query.shape[2] and mask.shape[3] == key.shape[2]
            and key.shape[2] >= MIN_KEYS and query.dtype in (torch.float32, torch.bfloat16, torch.float16))


class TilePlans:
    """The plan of the last masks seen on each thread, by identity: a pass hands every layer the same
    mask object (one per layer type), so it is planned once a pass. Holds the masks it planned (an
    id is never reused while its object lives); per thread, as passes are (engines over one model run
    theirs on their own scheduler threads). ``tiled`` counts the masks planned in tiles."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self.tiled = 0
        self._local = threading.local()

    def get(self, mask: torch.Tensor, dtype: torch.dtype) -> TilePlan | None:
        plans = self._local.__dict__.setdefault("plans", {})
        held = plans.get(id(mask))
        if held is None or held[0] is not mask or (held[1] is not None and held[1].additive.dtype != dtype):
            held = (mask, plan_tiles(mask, dtype))
            self.tiled += held[1] is not None
            while len(plans) >= self.size:
                plans.pop(next(iter(plans)))
            plans[id(mask)] = held
        return held[1]
