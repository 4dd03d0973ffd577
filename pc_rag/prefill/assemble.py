"""Assembly: plans + the store -> what attention reads (:class:`~pc_rag.prefill.rows.Rows`) and what
each row computes (:class:`~pc_rag.prefill.rows.Inputs`).

Three ways to hand a prompt's cached KV to attention:

- ``copy``: each cached segment is copied into the request's own cache (rotated on the way
  when it moved), then the computed tokens follow it;
- ``in_place`` (one request, split attention): each cached segment is attended to where the
  store keeps it, moved modules read unrotated (their queries rotate back instead);
- shared (a batch, split attention): rows are sorted by their cached segments and
  :func:`~pc_rag.forward.shared_attention.share_prefixes` finds the runs two or more rows import at the
  same positions (ChunkAttention's prefix tree); a run is held once (read in place when it is
  one stored module, else assembled once for the batch), what a row shares with nobody is
  copied into its own cache.

Every cached segment's KV is read by the store key its plan pinned; a module the store lost is
encoded again from the schema the plan pinned (``ModuleEncoder.fetch``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from ..errors import PromptCacheError
from ..forward.rotation import rotate_in_place, rotate_with
from ..forward.shared_attention import RowSet, SharedKV, SharedPart, row_set, share_prefixes
from ..kv.buffers import BufferPool, KVBuffer, batch_capacity
from ..kv.quantize import QuantizedModuleKV
from ..kv.records import StoredKV
from ..model.spec import ModelSpec
from ..prompt.plan import Plan, Segment
from .ape import Ape, adjust_attention, moved_entries
from .encode import ModuleEncoder
from .rows import Inputs, Rows

Assembly = Literal["copy", "in_place"]


Signature = tuple  # one cached segment as a row reads it (see :func:`signature`)
# what a running batch holds, by the signatures of its segments: a part rows read shared, or None
# for one segment running rows hold in their own caches (pc_rag.decode.layout.held)
Held = Mapping[tuple[Signature, ...], SharedPart | None]


def signature(segment: Segment, moved: bool) -> Signature:
    """What a row reads for a cached segment: its stored entry's tokens at its positions, moved
    (APE-adjusted) or not. Rows whose segments have the same signature read the same KV alike,
    so one copy can serve them all (:mod:`pc_rag.forward.shared_attention`)."""
    return (segment.key, segment.offset, len(segment), segment.position, segment.source_position, moved)


def choose_assembly(requested: Assembly | None, default: Assembly, spec: ModelSpec) -> Assembly:
    """``in_place`` (zero-copy: modules are attended to where they are stored) needs split attention."""
    if requested is None:
        return default if spec.split else "copy"
    if requested not in ("copy", "in_place"):
        raise PromptCacheError(f"assembly must be 'copy' or 'in_place', got {requested!r}")
    if requested == "in_place" and not spec.split:
        raise PromptCacheError(
            "assembly='in_place' needs a RoPE model on sdpa attention; this one has "
            f"{spec.position_kind} positions and {spec.attn_implementation!r} attention"
        )
    return requested


@dataclass
class Assembled:
    rows: Rows
    inputs: Inputs
    order: list[int]  # row -> index of its plan (shared batches sort their rows)


class Assembler:
    """Turns plans into :class:`Rows` and :class:`Inputs` (see module docstring)."""

    def __init__(self, spec: ModelSpec, encoder: ModuleEncoder, buffers: BufferPool) -> None:
        self.spec = spec
        self.encoder = encoder
        self.buffers = buffers

    # -- reading the store -------------------------------------------------------------------
    def segment_kv(self, plan: Plan, segment: Segment) -> tuple[StoredKV, int]:
        """The stored module a cached segment reads (its tokens ``[offset, offset + len)``) and how far it moved."""
        schema = plan.sources[segment.schema]  # type: ignore[index]
        module = self.encoder.fetch(schema, segment.owner, segment.key, plain=segment.plain)  # type: ignore[arg-type]
        delta = segment.position - segment.source_position
        if delta and not self.spec.movable:
            raise PromptCacheError(f"module {segment.owner!r} cannot move on a model with {self.spec.pinned_reason}")
        # ALiBi keys carry no position: a moved module's KV is used as it is
        return module, delta if self.spec.rotator is not None else 0

    def write(self, buffer: KVBuffer, at: int, plan: Plan, segments: Sequence[Segment], row: int = 0) -> int:
        """Copy ``segments``' KV into ``buffer`` row ``row`` from entry ``at`` on, each rotated to
        where the prompt puts it; returns the entry after the last. The rotations of all moved
        segments come from one cos/sin computation. Quantized modules are dequantized straight
        into the buffer (and rotated there)."""
        views = [self.segment_kv(plan, segment) for segment in segments]
        deltas = sorted({delta for _, delta in views if delta})
        table = {}
        interleaved = self.spec.rotator is not None and self.spec.rotator.interleaved
        if deltas:
            # in the model's dtype: 16-bit buffers (kv_dtype) take keys rotated at full precision, rounded once
            like = torch.empty(0, dtype=self.spec.dtype, device=buffer.storage.device)
            cos, sin = self.spec.rotator.cos_sin_many(torch.tensor(deltas), like)  # type: ignore[union-attr]
            table = {delta: (cos[i], sin[i]) for i, delta in enumerate(deltas)}
        for segment, (module, delta) in zip(segments, views):
            first, last = segment.offset, segment.offset + len(segment)
            if isinstance(module, QuantizedModuleKV):
                dest = buffer.slice(at, at + len(segment), row)  # [layers, 2, kv_heads, len(segment), head_dim]
                module.read_into(dest, first, last)
                if delta:
                    rotate_in_place(dest[:, 0], *table[delta], interleaved=interleaved)  # the keys [layers, kv_heads, tokens, head_dim]
                at += len(segment)
                continue
            rotate = None
            if delta:
                cos, sin = table[delta]
                rotate = lambda out, keys, cos=cos, sin=sin: rotate_with(out, keys, cos, sin, interleaved=interleaved)  # noqa: E731
            # module.read: [layers, 2, kv_heads, last - first, head_dim], into the row at `at`
            buffer.write(module.read(first, last), at, row=row if buffer.batch > 1 else None, rotate=rotate)
            at += len(segment)
        return at

    def append(self, buffer: KVBuffer, plan: Plan, segment: Segment) -> None:
        """One cached segment after what ``buffer`` holds (segment-by-segment prefill)."""
        end = self.write(buffer, len(buffer), plan, [segment])
        buffer.grow_to(end)

    def _parts(self, plan: Plan, segments: Sequence[Segment], moved: Sequence[bool], rows: RowSet, ape: Ape | None) -> list[SharedPart]:
        """KV that ``rows`` read in place: the stored tensor where it is one segment, else assembled
        once; under APE, one part per run of segments that moved (adjusted) or did not."""
        if ape is None:
            return [self._part(plan, segments, rows, moved=False)]
        parts, start = [], 0
        for end in range(1, len(segments) + 1):
            if end == len(segments) or moved[end] != moved[start]:
                adjust = (ape.temperature, math.log(ape.scale)) if moved[start] else (1.0, 0.0)
                parts.append(self._part(plan, segments[start:end], rows, *adjust, moved=moved[start]))
                start = end
        return parts

    def _part(self, plan: Plan, segments: Sequence[Segment], rows: RowSet, temperature: float = 1.0, log_scale: float = 0.0,
              *, moved: bool) -> SharedPart:
        spec = self.spec
        held = tuple(signature(s, moved) for s in segments)
        if len(segments) == 1:
            (segment,) = segments
            module, shift = self.segment_kv(plan, segment)
            # read in place, the queries rotated back by the move (by each layer's frequencies where layers differ)
            kv = module.read(segment.offset, segment.offset + len(segment), dtype=spec.kv_dtype, device=spec.device)  # [layers, 2, kv_heads, n, dim]
            return SharedPart(kv, _positions(segments, spec.device), rows, shift, temperature, log_scale, held)
        run = KVBuffer(spec.layers, spec.kv_heads, spec.head_dim, sum(len(s) for s in segments), dtype=spec.kv_dtype, device=spec.device)
        self.write(run, 0, plan, segments)
        return SharedPart(run.slice(0, run.capacity), _positions(segments, spec.device), rows, 0, temperature, log_scale, held)

    # -- building rows ---------------------------------------------------------------------------
    def assemble(self, plans: Sequence[Plan], new_tokens: int, *, use_cache: bool, assembly: Assembly, share: bool,
                 ape: Ape | None = None, held: Held | None = None) -> Assembled:
        """The rows for ``plans`` (with room for ``new_tokens`` more each) and their computed inputs.

        ``share``: a batch shares the runs of cached segments its rows import at the same
        positions, and reads shared what a running batch it will join already ``held``s (its parts,
        and the segments its rows copied); ``assembly='in_place'``: one request reads its cached
        segments where they are stored. Both need split attention (``spec.split``). ``ape``: the
        attention of computed queries to moved segments is adjusted (APE), wherever their KV is read from.
        """
        spec = self.spec
        cached = [[s for s in p.segments if s.cached] if use_cache else [] for p in plans]
        moved = [[m for s, m in zip(p.segments, ape.moved[i]) if s.cached] if ape is not None else [False] * len(cached[i])
                 for i, p in enumerate(plans)] if use_cache else [[] for _ in plans]
        order, parts, own, own_moved = self._split(plans, cached, moved, in_place=use_cache and assembly == "in_place",
                                                   share=use_cache and share, ape=ape, held=held)
        computed = [_computed(plans[i], use_cache) for i in order]
        own_width = max(sum(len(s) for s in segments) for segments in own)
        buffer = self._buffer(len(plans), own_width + max(len(ids) for ids, _ in computed) + new_tokens)
        # each row's cache entries: the position its key was encoded for, and whether it holds one
        key_positions = torch.zeros(len(plans), buffer.capacity, dtype=torch.long)  # [batch, capacity]
        valid = torch.zeros(len(plans), buffer.capacity, dtype=torch.bool)  # [batch, capacity]
        for row, segments in enumerate(own):
            filled = self.write(buffer, 0, plans[order[row]], segments, row=row)  # KV [layers, 2, row, kv_heads, :filled, head_dim]
            if filled:
                key_positions[row, :filled] = _positions(segments, torch.device("cpu"))
                valid[row, :filled] = True
        buffer.grow_to(own_width)
        shared = SharedKV(parts, heads_per_kv=spec.heads_per_kv, dtype=spec.dtype, rotator=spec.rotator) if parts else None
        ordered = len(plans) == 1 and own_width == 0 and shared is None
        copies = [_copies(segments, flags) for segments, flags in zip(own, own_moved)]
        rows = Rows(buffer, key_positions.to(spec.device), valid.to(spec.device), shared, ordered, copies=copies)
        inputs = Inputs.left_padded(computed, spec.placeholder_id, spec.device)  # ids and positions [batch, longest computed]
        if ape is not None and any(any(flags) for flags in own_moved):
            adjust_attention(rows, moved_entries(own, own_moved), ape.temperature, ape.scale)
        return Assembled(rows, inputs, order)

    def _split(self, plans: Sequence[Plan], cached: list[list[Segment]], moved: list[list[bool]], *, in_place: bool, share: bool,
               ape: Ape | None, held: Held | None = None) -> tuple[list[int], list[SharedPart], list[list[Segment]], list[list[bool]]]:
        """The rows' order, the parts read in place (shared by rows, or one request's in place), and
        each row's own cached segments (with their APE flags), copied into its buffer."""
        order = list(range(len(plans)))
        if in_place and len(plans) == 1:
            parts = [part for s, m in zip(cached[0], moved[0]) for part in self._parts(plans[0], [s], [m], slice(0, 1), ape)]
            return order, parts, [[]], [[]]
        if not share or (len(plans) == 1 and not held):
            return order, [], cached, moved
        # rows share a segment only when they read it alike: the same KV at the same position,
        # moved (APE-adjusted) in both or in neither; a shared part has one adjustment for all its rows
        signatures = [[signature(s, m) for s, m in zip(segments, flags)] for segments, flags in zip(cached, moved)]
        joins, rest = _joins(signatures, held or {})
        order = sorted(order, key=lambda i: [signatures[i][k] for k in rest[i]])
        runs, private_from = share_prefixes([tuple(signatures[i][k] for k in rest[i]) for i in order])
        parts = []
        for run in runs:
            first = order[run.rows.start]
            taken = rest[first][run.first : run.stop]
            parts += self._parts(plans[first], [cached[first][k] for k in taken], [moved[first][k] for k in taken], run.rows, ape)
        row_of = {i: row for row, i in enumerate(order)}
        for join in joins:  # what the running batch holds: read shared, never copied
            rows = row_set(row_of[i] for i in join.readers)
            parts += [replace(join.part, rows=rows)] if join.part is not None else \
                self._parts(plans[join.first], cached[join.first][join.start : join.stop], moved[join.first][join.start : join.stop], rows, ape)
        own = [rest[i][private_from[row] :] for row, i in enumerate(order)]  # indices of the segments each row copies
        return order, parts, [[cached[i][k] for k in ks] for i, ks in zip(order, own)], \
            [[moved[i][k] for k in ks] for i, ks in zip(order, own)]

    def _buffer(self, batch: int, capacity: int) -> KVBuffer:
        """A KV buffer for ``batch`` rows of ``capacity`` entries: the pool's for one row."""
        if batch == 1:
            return self.buffers.acquire(capacity)
        # rounded up like the pool's buffers: a compiled decode step sees few shapes
        buffer = KVBuffer(self.spec.layers, self.spec.kv_heads, self.spec.head_dim, batch_capacity(capacity), dtype=self.spec.kv_dtype,
                          device=self.spec.device, batch=batch)
        # masked entries still meet the values in a product (weight 0 x value): uninitialised
        # memory can hold NaN, and 0 x NaN is NaN
        buffer.storage.zero_()
        return buffer

    def empty_row(self, capacity: int) -> Rows:
        """One row with an empty cache, for segment-by-segment prefill."""
        buffer = self.buffers.acquire(capacity)
        device = self.spec.device
        return Rows(buffer, torch.zeros(1, buffer.capacity, dtype=torch.long, device=device),
                    torch.zeros(1, buffer.capacity, dtype=torch.bool, device=device), None, ordered=True)


@dataclass
class _Join:
    """Segments rows read from what a running batch holds: its ``part``, or (None) a part built
    from ``first``'s segments ``[start, stop)``, a run that running rows hold in their own caches."""

    part: SharedPart | None
    first: int
    start: int
    stop: int
    readers: list[int]


def _joins(signatures: list[list[Signature]], held: Held) -> tuple[list[_Join], list[list[int]]]:
    """Which segments each row reads from what a running batch holds, and (``rest[row]``) the
    indices of its other segments."""
    by_first: dict[Signature, list[tuple[Signature, ...]]] = {}
    for key in sorted(held, key=len, reverse=True):  # the longest held run first
        by_first.setdefault(key[0], []).append(key)
    joins: dict[tuple[Signature, ...], _Join] = {}
    rest: list[list[int]] = []
    for row, sigs in enumerate(signatures):
        mine: list[int] = []
        at = 0
        while at < len(sigs):
            run = next((key for key in by_first.get(sigs[at], ()) if tuple(sigs[at : at + len(key)]) == key), None)
            if run is None:
                mine.append(at)
                at += 1
                continue
            stop = at + len(run)
            if held[run] is None:  # copied by running rows: consecutive such segments make one part
                while stop < len(sigs) and held.get((sigs[stop],), False) is None:
                    stop += 1
                run = tuple(sigs[at:stop])
            joins.setdefault(run, _Join(held.get(run), row, at, stop, [])).readers.append(row)
            at = stop
        rest.append(mine)
    return list(joins.values()), rest


def _copies(segments: Sequence[Segment], moved: Sequence[bool]) -> list[tuple[Signature, int, int]]:
    """Where a row's own cached segments lie in its cache (written from entry 0, in order)."""
    out, at = [], 0
    for segment, flag in zip(segments, moved):
        out.append((signature(segment, flag), at, at + len(segment)))
        at += len(segment)
    return out


def _positions(segments: Sequence[Segment], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(s.position, s.position + len(s)) for s in segments]).to(device)


def _computed(plan: Plan, use_cache: bool) -> tuple[list[int], list[int]]:
    """The token ids and positions a row computes: its uncached segments (all of them without the cache)."""
    segments = plan.segments if not use_cache else [s for s in plan.segments if not s.cached]
    ids = [t for s in segments for t in s.token_ids]
    positions = [p for s in segments for p in range(s.position, s.position + len(s))]
    return ids, positions
