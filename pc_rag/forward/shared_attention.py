"""Split attention: cached KV read in place and shared by a batch, merged by log-sum-exp.

Attention over keys ``[A | B]`` equals attention over ``A`` and over ``B`` computed separately
and merged with their log-sum-exps (RelayAttention's relay fusion, ChunkAttention's two-phase
partition): with ``m`` each part's maximum score, ``l`` its sum of ``exp(score - m)`` and ``o``
its unnormalised output, the merge rescales each part by ``exp(m_part - m_max)``. That is exact
arithmetic, not an approximation, and it lets the engine

- serve one request without copying module KV into its cache: each imported module's stored
  tensor is one part, read where it lies (*zero-copy assembly*);
- serve a batch whose requests import the same modules at the same positions with one copy of
  that KV: a shared part is attended to by all its rows in one matrix-matrix product per layer
  (their queries stacked), read once per decoding step instead of once per request.

A moved RoPE module is read unrotated: ``R(p) q . R(s + d) k == R(p - d) q . R(s) k``, so the
queries are rotated back by the move ``d`` instead of copying rotated keys.

The engine passes a :class:`SharedKV` to the model as the forward keyword ``pc_rag_shared``;
transformers hands forward keywords to the attention function, ``pc_rag_sdpa``, which calls
:func:`split_attention` when it is present. The model's own cache holds only each request's
private keys (computed tokens, generated tokens, KV no other row shares).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import PromptCacheError
from ..kv.buffers import read_at
from .rotation import rotate_with
from .row_extents import RowExtents

KWARG = "pc_rag_shared"


RowSet = slice | tuple[int, ...]  # batch rows: a contiguous range, or any rows (ascending)


def row_list(rows: RowSet) -> list[int]:
    """The rows of a :data:`RowSet`, ascending."""
    return list(range(rows.start, rows.stop)) if isinstance(rows, slice) else list(rows)


def row_set(rows: Iterable[int]) -> RowSet:
    """``rows`` as a :data:`RowSet`: a slice where they are contiguous (a view of the batch, no gather)."""
    ordered = sorted(set(rows))
    if ordered and ordered[-1] - ordered[0] + 1 == len(ordered):
        return slice(ordered[0], ordered[-1] + 1)
    return tuple(ordered)


@dataclass(frozen=True)
class SharedPart:
    """Cached KV that batch rows ``rows`` attend to, besides their own cache."""

    kv: torch.Tensor  # [layers, 2, kv_heads, n, head_dim]: stored module KV (a view, not a copy)
    positions: torch.Tensor  # [n] int64 on the model's device: where the prompts place these keys
    rows: RowSet  # the batch rows that import it
    shift: int = 0  # the keys were encoded `shift` positions before `positions`: queries rotate back by it
    # APE (pc_rag.prefill.recovery): scores over this part divided by `temperature`, its weight times exp(log_scale)
    temperature: float = 1.0
    log_scale: float = 0.0
    # what it holds, segment by segment (pc_rag.prefill.assemble.signature): parts with the same
    # signature hold the same KV at the same positions, so rows admitted later join one (empty: never)
    signature: tuple[Hashable, ...] = ()


class _Group:
    """The parts read by one range of rows: scored together, one softmax over all of them.

    Per layer and step a group costs two matrix products per part (scores, then values) and a
    fixed handful of operations for the softmax and the merge, however many parts it has.
    """

    def __init__(self, rows: RowSet, parts: list[SharedPart], rotator: Any) -> None:
        # a range of rows is a view of the batch; other rows are gathered (a decode step's queries: a few KB)
        self.rows: slice | torch.Tensor = rows if isinstance(rows, slice) else torch.tensor(rows, dtype=torch.long,
                                                                                           device=parts[0].kv.device)
        self.count = len(row_list(rows))
        self.parts = parts
        self.positions = torch.cat([p.positions for p in parts])
        # read once here (a host sync per batch, not per step): decides when masks are needed
        low, high = torch.aminmax(self.positions) if self.positions.numel() else (torch.tensor(0), torch.tensor(-1))
        self.first_position, self.last_position = int(low), int(high)
        self.bounds: list[tuple[int, int]] = []
        start = 0
        for part in parts:
            self.bounds.append((start, start + part.kv.shape[3]))
            start += part.kv.shape[3]
        self.cos = self.sin = None
        self.interleaved = bool(getattr(rotator, "interleaved", False))
        self.per_layer = bool(getattr(rotator, "per_layer", False))
        if any(p.shift for p in parts):
            if rotator is None:
                raise PromptCacheError("moved modules read in place need a RoPE rotator")
            shifts = torch.tensor([-p.shift for p in parts], dtype=torch.long)
            # per part [1, 1, rotary_dim] (broadcast over [kv_heads, queries, head_dim]); with
            # frequencies per layer, per part and layer: [parts, layers, 1, 1, rotary_dim]
            cos, sin = rotator.cos_sin_many(shifts, parts[0].kv)
            self.cos, self.sin = (cos, sin) if self.per_layer else (cos[:, None, None, :], sin[:, None, None, :])

    def queries(self, stacked: torch.Tensor, layer: int) -> Iterator[torch.Tensor]:
        """Each part's queries in turn: ``stacked`` rotated back by the part's move (by ``layer``'s
        frequencies, where layers differ: Gemma 3's local and global layers, a layer without RoPE).

        One scratch tensor is reused for every part (it stays in cache; rotating all parts'
        copies at once was a memory-bound third of the prefill on CPU).
        """
        if self.cos is None:
            for _ in self.parts:
                yield stacked
            return
        moved = stacked.clone()  # dims past the rotary ones stay as they are
        for cos, sin in zip(self.cos, self.sin):
            if self.per_layer:
                cos, sin = cos[layer], sin[layer]
            rotate_with(moved, stacked, cos, sin, interleaved=self.interleaved)
            yield moved


class SharedKV:
    """The shared parts of one batch (or one request's modules read in place)."""

    def __init__(self, parts: Sequence[SharedPart], *, heads_per_kv: int, dtype: torch.dtype, rotator: Any = None) -> None:
        self.heads_per_kv = heads_per_kv  # query heads per key/value head (grouped-query attention)
        self.dtype = dtype
        self.parts = list(parts)
        self.rotator = rotator
        by_rows: dict[tuple[int, ...], list[SharedPart]] = {}
        for part in parts:
            by_rows.setdefault(tuple(row_list(part.rows)), []).append(part)
        self.groups = [_Group(row_set(rows), members, rotator) for rows, members in by_rows.items()]

    def select(self, rows: Sequence[int], offset: int) -> list[SharedPart]:
        """The parts that rows ``rows`` (ascending) read, renumbered for a batch where those rows
        sit at ``offset``, ``offset + 1``, ...: what a running batch that takes rows in or lets
        rows go keeps (the KV itself is not copied). A part none of them reads is dropped."""
        return self.renumbered({old: offset + new for new, old in enumerate(rows)})

    def renumbered(self, rows: dict[int, int]) -> list[SharedPart]:
        """The parts read by the rows in ``rows`` (old row -> new row), read by their new rows."""
        kept: list[SharedPart] = []
        for part in self.parts:
            reading = [rows[row] for row in row_list(part.rows) if row in rows]
            if reading:
                kept.append(replace(part, rows=row_set(reading)))
        return kept

    def like(self, parts: Sequence[SharedPart]) -> "SharedKV | None":
        """Another batch's shared KV over ``parts`` (this one's settings), parts with the same
        signature joined into one read by all their rows; None without parts."""
        return SharedKV(join(parts), heads_per_kv=self.heads_per_kv, dtype=self.dtype, rotator=self.rotator) if parts else None

    def for_queries(self, query_positions: torch.Tensor, bounds: tuple[int, int] | None = None) -> "SharedStep":
        """The per-forward view for queries at ``query_positions`` ``[rows, q]``.

        ``bounds``: the smallest and largest query position, known on the host (else read from
        the tensor: one device sync). Masks are built once per forward pass (per sliding window),
        in the layout the kernels take, not per layer, and only where some query does not see
        every key of a group: a prefill whose recomputed module heads precede later modules, or
        a window that has moved past a module's first keys.
        """
        if bounds is None:
            low, high = torch.aminmax(query_positions)
            bounds = (int(low), int(high))
        return SharedStep(self, query_positions, bounds)


def join(parts: Iterable[SharedPart]) -> list[SharedPart]:
    """``parts`` with those of the same (non-empty) signature merged into one read by all their
    rows: the same KV at the same positions, attended to once per step for every row."""
    joined: dict[Hashable, SharedPart] = {}
    for index, part in enumerate(parts):
        key = part.signature or ("unsigned", index)
        held = joined.get(key)
        joined[key] = part if held is None else replace(held, rows=row_set(row_list(held.rows) + row_list(part.rows)))
    return list(joined.values())


@dataclass
class _PartMask:
    bias: torch.Tensor  # [1, 1, queries, keys] additive (0 or -inf), the layout SDPA kernels take
    dead: torch.Tensor | None  # [queries]: queries that see no key of the part (None when every one sees some)

    @classmethod
    def build(cls, keys: torch.Tensor, queries: torch.Tensor, dtype: torch.dtype, window: int | None = None) -> "_PartMask":
        allowed = keys[None, :] <= queries[:, None]
        if window is not None:
            allowed &= keys[None, :] > queries[:, None] - window
        bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        dead = ~allowed.any(dim=-1)
        return cls(bias[None, None], dead if bool(dead.any()) else None)


class SharedStep:
    """One forward pass's view of the shared parts: the queries' positions and the masks they need."""

    def __init__(self, shared: SharedKV, query_positions: torch.Tensor, bounds: tuple[int, int]) -> None:
        self.shared = shared
        self.query_positions = query_positions
        self.bounds = bounds
        self._masks: dict[int | None, list[list[_PartMask] | None]] = {}
        # the rows' own mask in kernel layout, by the mask object transformers hands every layer
        # (one per layer type): converted once per forward pass, not once per layer
        self._own: dict[int, tuple[Any, _PartMask | None]] = {}

    def masks(self, window: int | None) -> list[list[_PartMask] | None]:
        """Per group: per part masks, or None where every query sees every key of the group."""
        if window not in self._masks:
            low, high = self.bounds
            shared = self.shared
            masks: list[list[_PartMask] | None] = []
            for group in shared.groups:
                if low > group.last_position and (window is None or high - window < group.first_position):
                    masks.append(None)
                    continue
                queries = self.query_positions[group.rows]
                n, q_len = queries.shape
                # stacked query order is (row, head in group, query): [n * heads_per_kv * q]
                at = queries[:, None, :].expand(n, shared.heads_per_kv, q_len).reshape(-1)
                masks.append([_PartMask.build(group.positions[start:stop], at, shared.dtype, window) for start, stop in group.bounds])
            self._masks[window] = masks
        return self._masks[window]

    def own_mask(self, mask: torch.Tensor | None, q_len: int, groups: int, k_len: int, like: torch.Tensor) -> _PartMask | None:
        held = self._own.get(id(mask))
        if held is None or held[0] is not mask:
            held = (mask, _own_mask(mask, q_len, groups, k_len, like))
            self._own[id(mask)] = held
        return held[1]


# PyTorch's CPU flash-attention kernel, which also returns the log-sum-exp that the public
# scaled_dot_product_attention computes and drops. torch is pinned; without it: plain math.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# devices whose fused SDPA kernels return the log-sum-exp ("meta" runs their shape logic only)
_FUSED_DEVICES = ("cuda",)


def fused_attention_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, h, m, d], lse [b, h, m])`` from SDPA's fused CUDA kernels, which return the
    log-sum-exp they compute anyway: no score matrix is materialised, in float32 or at all.

    Unmasked half-precision parts (most parts: every query sees every key of a module placed
    before it) take the flash kernel; a mask or float32 takes the memory-efficient kernel, whose
    additive bias must sit on 16-element-aligned rows (padded here, then viewed back) and whose
    log-sum-exp comes padded to a multiple of 32 queries (sliced here).
    """
    m = query.shape[-2]
    if bias is None and query.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, False, False, scale=scale)[:2]
        return out, lse
    if bias is not None:
        n = bias.shape[-1]
        aligned = torch.nn.functional.pad(bias.to(query.dtype), (0, -n % 16))[..., :n]
        bias = aligned.expand(query.shape[0], query.shape[1], m, n)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, True, 0.0, False, scale=scale)[:2]
    return out, lse[..., :m]


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, mask: _PartMask | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T * scale + bias) v`` and its log-sum-exp (float32): ``[b, h, m, d]``, ``[b, h, m]``.

    A query that sees no key gets output 0 and log-sum-exp -inf, so it vanishes in the merge.
    """
    bias = mask.bias if mask is not None else None
    key, value = read_at(key, value, query.dtype)
    if query.device.type == "cpu" and _FLASH_CPU is not None:
        out, lse = _FLASH_CPU(query, key, value, 0.0, False, attn_mask=bias, scale=scale)
    elif query.device.type in _FUSED_DEVICES:
        out, lse = fused_attention_with_lse(query, key, value, scale, bias)
    else:
        scores = torch.matmul(query, key.transpose(-1, -2)).float().mul_(scale)
        if bias is not None:
            scores = scores + bias
        lse = torch.logsumexp(scores, dim=-1)
        weights = torch.exp(scores - lse.clamp_min(torch.finfo(scores.dtype).min)[..., None])
        out = torch.matmul(weights.to(value.dtype), value)
    if mask is not None and mask.dead is not None:
        lse = lse.masked_fill(mask.dead, float("-inf"))
        out = out.masked_fill(mask.dead[..., None], 0)
    return out, lse.float()


def _attend_extents(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, mask: _PartMask | None, extents: RowExtents
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_attend` a few rows at a time, each call within its rows' extents; rows no call
    covers (finished) get output 0 and log-sum-exp -inf."""
    out = query.new_zeros(query.shape)
    lse = torch.full(query.shape[:-1], float("-inf"), dtype=torch.float32, device=query.device)
    for rows, entries in extents.spans():
        span_mask = None if mask is None else _PartMask(mask.bias[rows, :, :, entries],
                                                        None if mask.dead is None else mask.dead[rows])
        out[rows], lse[rows] = _attend(query[rows], key[rows, :, entries], value[rows, :, entries], scale, span_mask)
    return out, lse


def relay_merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Relay fusion: attention over the union of two disjoint key sets from each set's (output, lse)."""
    lse = torch.logaddexp(lse_a, lse_b)
    # clamped: a query that saw no key in either keeps output 0 instead of 0 * exp(nan)
    floor = lse.clamp_min(torch.finfo(lse.dtype).min)
    out = out_a.float() * torch.exp(lse_a - floor)[..., None]
    out.addcmul_(out_b.float(), torch.exp(lse_b - floor)[..., None])
    return out, lse


def split_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    step: SharedStep,
    *,
    window: int | None = None,
    extents: RowExtents | None = None,
) -> torch.Tensor:
    """Attention of ``query [rows, heads, q, dim]`` over the rows' own ``key``/``value``
    ``[rows, kv_heads, k, dim]`` (masked by ``attention_mask``: boolean, additive, or causal when None;
    within each row's ``extents``, if given: :mod:`pc_rag.forward.row_extents`) and over every shared
    part (seen through the layer's sliding ``window``, if any); returns ``[rows, q, heads, dim]``
    like transformers' kernels."""
    rows, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    layer = module.layer_idx

    # the rows' own keys: each kv head's query heads stacked, [rows, kv_heads, groups * q, dim]
    grouped = query.reshape(rows, kv_heads, groups * q_len, dim)
    # out [rows, kv_heads, groups * q, dim], lse [rows, kv_heads, groups * q]
    own = step.own_mask(attention_mask, q_len, groups, key.shape[2], query)
    out, lse = _attend(grouped, key, value, scale, own) if extents is None else _attend_extents(grouped, key, value, scale, own, extents)
    if step.shared.groups:
        out = out.float()  # the merge accumulates in float32, in place for groups of some rows only

    for group, masks in zip(step.shared.groups, step.masks(window)):
        sub = grouped[group.rows]
        n = group.count
        # all the group's rows stacked per kv head: [1, kv_heads, n * groups * q, dim], so each
        # part is one attention call (one matrix-matrix product) for every row that shares it
        stacked = sub.transpose(0, 1).reshape(kv_heads, n * groups * q_len, dim)
        g_out: torch.Tensor | None = None
        g_lse: torch.Tensor | None = None
        for index, (q, part) in enumerate(zip(group.queries(stacked, layer), group.parts)):
            # q [kv_heads, n * groups * q, dim] against the part's keys [kv_heads, keys, dim]: o like q, o_lse [kv_heads, n * groups * q]
            o, o_lse = _attend(q[None], part.kv[layer, 0][None], part.kv[layer, 1][None], scale / part.temperature,
                               masks[index] if masks else None)
            if part.log_scale:
                o_lse = o_lse + part.log_scale
            g_out, g_lse = (o[0], o_lse[0]) if g_out is None else relay_merge(g_out, g_lse, o[0], o_lse[0])  # type: ignore[arg-type]
        assert g_out is not None and g_lse is not None
        # back to the rows' layout: [n, kv_heads, groups * q, .]
        g_out = g_out.view(kv_heads, n, groups * q_len, dim).transpose(0, 1)
        g_lse = g_lse.view(kv_heads, n, groups * q_len).transpose(0, 1)
        merged_out, merged_lse = relay_merge(out[group.rows], lse[group.rows], g_out, g_lse)
        if n == rows:
            out, lse = merged_out, merged_lse
        else:
            out[group.rows], lse[group.rows] = merged_out, merged_lse

    # [rows, kv_heads, groups * q, dim] -> [rows, heads, q, dim] -> [rows, q, heads, dim]
    return out.to(query.dtype).reshape(rows, heads, q_len, dim).transpose(1, 2).contiguous()


def _own_mask(mask: torch.Tensor | None, q_len: int, groups: int, k_len: int, like: torch.Tensor) -> _PartMask | None:
    """The mask over the rows' own keys for stacked queries: as given (boolean), or causal
    (the queries are the last keys)."""
    if mask is None:
        if q_len == 1:
            return None
        query_at = torch.arange(k_len - q_len, k_len, device=like.device)
        mask = (torch.arange(k_len, device=like.device)[None, :] <= query_at[:, None])[None, None]
    mask = mask[..., -k_len:]
    rows = mask.shape[0]
    stacked = mask.expand(rows, 1, q_len, k_len)[:, :, None].expand(rows, 1, groups, q_len, k_len).reshape(rows, 1, groups * q_len, k_len)
    if stacked.dtype == torch.bool:
        allowed = stacked
        bias = torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill_(~allowed, float("-inf"))
    else:  # additive (an APE bias on moved entries): its floor marks what a query must not see
        allowed = stacked > torch.finfo(stacked.dtype).min / 2
        bias = stacked.to(like.dtype).masked_fill(~allowed, float("-inf"))
    dead = ~allowed.any(dim=-1)
    return _PartMask(bias, dead if bool(dead.any()) else None)


@dataclass(frozen=True)
class SharedRun:
    """Consecutive cached segments ``[first, stop)`` that batch rows ``rows`` all import at the same positions."""

    rows: slice
    first: int
    stop: int


def share_prefixes(signatures: Sequence[Sequence[Hashable]]) -> tuple[list[SharedRun], list[int]]:
    """ChunkAttention's prefix tree over the rows of a batch, at the level of cached segments.

    ``signatures[row]`` lists the row's cached segments in prompt order, each as a hashable
    (module entry, offset, length, position, encoded position, moved); rows must be sorted, so that
    rows sharing a prefix are adjacent. Every tree node imported by two rows or more becomes
    shared, chains of nodes with the same rows merge into one run, and a row imports the
    segments from ``private_from[row]`` on on its own. Returns ``(runs, private_from)``.
    """
    runs: list[SharedRun] = []
    private_from = [0] * len(signatures)
    # an explicit stack rather than recursion: a drop-in prompt can quote hundreds of modules
    stack: list[tuple[int, int, int, int | None]] = [(0, len(signatures), 0, None)]
    while stack:
        start, stop, depth, parent = stack.pop()
        row = start
        while row < stop:
            if len(signatures[row]) <= depth:
                private_from[row] = depth
                row += 1
                continue
            end = row + 1
            while end < stop and len(signatures[end]) > depth and signatures[end][depth] == signatures[row][depth]:
                end += 1
            if end - row < 2:
                private_from[row] = depth
            elif parent is not None and runs[parent].rows == slice(row, end):
                runs[parent] = SharedRun(runs[parent].rows, runs[parent].first, depth + 1)  # same rows: one run
                stack.append((row, end, depth + 1, parent))
            else:
                runs.append(SharedRun(slice(row, end), depth, depth + 1))
                stack.append((row, end, depth + 1, len(runs) - 1))
            row = end
    return runs, private_from
