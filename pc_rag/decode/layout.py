"""A running batch's rows, laid out and changed between steps (the scheduler merges newcomers here).

:mod:`pc_rag.decode.loop` steps a :class:`RunningBatch`; this module changes which requests its
rows hold, between two steps:

- :func:`merge`, the scheduler's one call: newcomers into the running batch (in place, else
  rebuilt), saying which buffer it made and which it let go of;
- :func:`admit`: newcomers written in place, into finished rows' slots or rows the buffer reserves
  (only the new rows' KV is written; the running rows stay where they are);
- :func:`combine`: several batches' rows rebuilt as one buffer, each row's live entries packed to
  the front, finished rows dropped, with reserved rows (:func:`reserved_rows`) or, under
  ``compile``, vacant rows (:class:`VacantRow`, :func:`vacant_rows`) for later arrivals;
  :func:`padded` a freshly prefilled batch as the running batch;
- :func:`held` and :func:`promote`: the shared parts and copied modules the live rows read, that a
  newcomer reads with them, and running rows that stop reading their copy to share a newcomer's part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from ..forward.shared_attention import SharedKV, SharedPart, row_list, row_set
from ..kv.buffers import KVBuffer, batch_capacity
from ..prefill.rows import Rows
from .loop import RunningBatch
from .request import RequestState


def reserved_rows(device: torch.device, compiled: bool, max_running: int, rows: int) -> int:
    """Rows a rebuilt batch of ``rows`` allocates beyond them, for newcomers to join in place
    (:func:`admit`, no rebuild). On a CPU only: there a row nobody has written
    holds no memory, while a GPU's allocator commits every row at once, which the buffer budget
    (it counts rows in use) would not see; and not under ``compile``, whose step runs only over
    buffers its views span (:attr:`KVBuffer.spans_storage`)."""
    if compiled or device.type != "cpu":
        return 0
    return max(max_running - rows, 0)


def vacant_rows(compiled: bool, max_running: int, rows: int) -> int:
    """Rows a batch of ``rows`` holds beyond them under ``compile``: it is padded to a power of two
    rows (at most ``max_running``, at least ``rows``), so that the compiled step, recorded as a
    CUDA graph per shape under "reduce-overhead", sees a few batch sizes (vLLM and SGLang capture
    theirs the same way), and newcomers join in place in the vacant rows. None eagerly, where a
    vacant row would be compute for nothing."""
    if not compiled:
        return 0
    return max(min(1 << (rows - 1).bit_length(), max_running) - rows, 0)


class VacantRow:
    """A row a batch holds for a newcomer under ``compile`` (:func:`combine`'s
    ``vacant``), so that the compiled step sees a few batch sizes: done from the start, it feeds
    placeholders (attending only to them) until :func:`admit` writes a request into it."""

    done = True
    greedy = True
    matcher = None
    processors = None
    budget = steps = 0
    owner = None  # nobody's

    def __init__(self, next_position: int) -> None:
        self.next_position = next_position  # a live row's: the step's position bounds stay theirs


def admit(batch: RunningBatch, fresh: RunningBatch) -> list[int] | None:
    """``fresh``'s rows written into ``batch`` in place: into finished rows' slots first, then
    into rows its buffer reserves (:meth:`KVBuffer.widen`). Only the new rows' entries are
    copied; the running rows' caches stay where they are. Returns the rows taken (one per fresh
    row, in order), or None where the rows do not fit that way (too few free rows, too little
    capacity, rows that read shared parts or carry logits processors' history): then
    :func:`combine` rebuilds.

    The write column may jump forward to the longest new row: the entries a running row skips
    stay masked (attention follows positions, not where an entry sits; ``spec.one_pass``).
    """
    rows = batch.rows
    if not batch.cursor.fixed or batch.history is not None or fresh.history is not None:
        return None
    if fresh.rows.bias is not None and rows.bias is None:
        return None
    slots = [row for row, request in enumerate(batch.requests) if request.done][: fresh.batch]
    widen = fresh.batch - len(slots)
    if widen > rows.buffer.reserved:
        return None
    going = [r.budget - r.steps for r in batch.requests if not r.done]
    steps = max(going + [r.budget - r.steps for r in fresh.requests] + [0])
    column = max(batch.length, fresh.length)
    end = max(batch.cursor.end, column + steps)
    if end > rows.buffer.capacity:
        return None
    reused = set(slots)
    if widen:  # outside inference mode: the new tensors are written in place by later steps
        _widen(batch, widen, fresh.requests[0])
        slots += range(batch.batch - widen, batch.batch)
    # the shared parts: the finished rows whose slots are taken read none any more, the new rows read theirs
    parts = rows.shared.renumbered({row: row for row in range(batch.batch) if row not in reused}) if rows.shared else []
    if fresh.rows.shared is not None:
        parts += fresh.rows.shared.renumbered(dict(enumerate(slots)))
    template = rows.shared or fresh.rows.shared
    rows.shared = template.like(parts) if template is not None else None
    with torch.inference_mode():
        if end > batch.cursor.end:  # attend further: the new entries masked and zeroed (0 x NaN is NaN)
            rows.valid[:, batch.cursor.end : end] = False
            rows.buffer.fix(end, batch.cursor.column)
            batch.cursor.end = end
        if column > batch.length:  # every row writes further on; the entries between stay masked
            batch.cursor.column.fill_(column)
            batch.cursor.at = column
        for new, slot in enumerate(slots):
            _write_row(batch, slot, fresh, new, end)
        index = torch.tensor(slots, dtype=torch.long, device=batch.logits.device)
        batch.logits = batch.logits.index_copy(0, index, fresh.logits.to(batch.logits.dtype))
        batch.cursor.positions.index_copy_(0, index, fresh.cursor.positions)
    rows.holes = rows.holes or fresh.rows.holes
    positions = [request.next_position for request in batch.requests]
    batch.cursor.bounds = (min(positions), max(positions))
    batch.live = torch.tensor(batch.alive, device=batch.logits.device)[:, None]
    return slots

def _widen(batch: RunningBatch, count: int, placeholder: RequestState) -> None:
    """``count`` more rows from the buffer's reserve, each a copy of row 0's state until written."""
    rows = batch.rows
    rows.buffer.widen(rows.batch + count)
    more = lambda t: torch.cat([t, t[:1].expand(count, *t.shape[1:])])  # noqa: E731
    rows.key_positions, rows.valid = more(rows.key_positions), more(rows.valid)
    if rows.bias is not None:
        rows.bias = more(rows.bias)
    if rows.copies is not None:
        rows.copies += [[] for _ in range(count)]
    batch.logits, batch.cursor.positions = more(batch.logits), more(batch.cursor.positions)
    batch.requests += [placeholder] * count
    batch.alive += [False] * count

def _write_row(batch: RunningBatch, slot: int, fresh: RunningBatch, new: int, end: int) -> None:
    """Row ``new`` of ``fresh`` (its cache, positions, request) as ``batch``'s row ``slot``,
    aligned to end at the write column (its entries and what it decodes are one range:
    :mod:`pc_rag.forward.row_extents`)."""
    rows, filled = batch.rows, fresh.length
    at = batch.length - filled
    taken = slice(at, batch.length)
    rows.buffer.write(fresh.rows.buffer.slice(0, filled, new), at, row=slot)
    # the rest of what a batched step attends to: masked, but 0 x NaN (uninitialised memory) is NaN
    rows.buffer.storage[:, :, slot, :, :at] = 0
    rows.buffer.storage[:, :, slot, :, batch.length : end] = 0
    rows.key_positions[slot, taken] = fresh.rows.key_positions[new, :filled]
    rows.valid[slot] = False
    rows.valid[slot, taken] = fresh.rows.valid[new, :filled]
    if rows.bias is not None:
        rows.bias[slot] = 0
        if fresh.rows.bias is not None:
            rows.bias[slot, taken] = fresh.rows.bias[new, :filled]
    if rows.copies is not None:
        held = fresh.rows.copies[new] if fresh.rows.copies is not None else []
        rows.copies[slot] = [(sig, start + at, stop + at) for sig, start, stop in held]
    batch.requests[slot] = fresh.requests[new]
    batch.alive[slot] = True

def held(batch: RunningBatch) -> dict[tuple, SharedPart | None]:
    """What the live rows read that a newcomer importing it too could read with them (by
    segment signatures, :func:`pc_rag.prefill.assemble.signature`): the shared parts, and
    (None) each cached segment a row copied into its own cache (:func:`promote` turns those
    into parts when a newcomer brings one)."""
    if not batch.cursor.fixed:
        return {}
    live = {row for row, request in enumerate(batch.requests) if not request.done}
    held: dict[tuple, SharedPart | None] = {}
    for row in live:
        for sig, _, _ in (batch.rows.copies[row] if batch.rows.copies is not None else ()):
            held[(sig,)] = None
    for part in batch.rows.shared.parts if batch.rows.shared is not None else ():
        if part.signature and live.intersection(row_list(part.rows)):
            held[part.signature] = part
    return held

def promote(batch: RunningBatch, shared: SharedKV) -> int:
    """Live rows that hold every segment of one of ``shared``'s parts (newcomers') in their own
    cache read that part instead, with the rows that brought it: their copies are masked (a
    rebuild drops them) and each such part is read once per step for all. Between steps;
    returns the rows moved.

    Exact: a moved module's keys are rotated in a copy and read unrotated, its queries
    rotated back, in a part (:mod:`pc_rag.forward.shared_attention`); both are the same product."""
    copies = batch.rows.copies
    if copies is None or not batch.cursor.fixed:
        return 0
    joined = []
    for part in shared.parts:
        wanted = set(part.signature)
        readers = []
        for row, request in enumerate(batch.requests):
            mine = [copy for copy in copies[row] if copy[0] in wanted]
            if request.done or not wanted or len({sig for sig, _, _ in mine}) < len(wanted):
                continue
            with torch.inference_mode():
                for _, start, stop in mine:
                    batch.rows.valid[row, start:stop] = False
            copies[row] = [copy for copy in copies[row] if copy[0] not in wanted]
            readers.append(row)
        if readers:
            joined.append(replace(part, rows=row_set(readers)))
    if joined:
        batch.rows.shared = (batch.rows.shared or shared).like([*(batch.rows.shared.parts if batch.rows.shared else ()), *joined])
        batch.rows.holes = True
    return sum(len(row_list(part.rows)) for part in joined)


def combine(sources: Sequence[tuple[RunningBatch, Sequence[int]]], *, reserve: int = 0, vacant: int = 0) -> RunningBatch:
    """Rows ``rows`` (ascending) of each source batch, in that order, as one new batch whose
    buffer reserves ``reserve`` more rows for later arrivals (:func:`admit`), or holds
    ``vacant`` more rows (:class:`VacantRow`, last) that later arrivals take the same way;
    none where a request carries logits processors (their history has no vacant rows).

    Every source waits between steps (its pending logits unread). Each row's live entries
    (its prompt and what it decoded, not the masked ones between) are packed into one new
    buffer, as runs of slices, aligned to end where the batch writes next; rows shorter than
    the longest start later, after masked entries (a CPU step does not read them:
    :mod:`pc_rag.forward.row_extents`). Packing keeps the batch's length that of its longest
    row, however long the batch has been running. What a row read in place (shared
    parts) it still reads in place. Sources need a model whose attention follows a position
    mask (``spec.one_pass``); their buffers are left to the caller.
    """
    first = sources[0][0]
    spec, forward = first.spec, first.forward
    requests = [batch.requests[row] for batch, rows in sources for row in rows]
    real = len(requests)
    if all(request.processors is None for request in requests):
        requests += [VacantRow(requests[0].next_position) for _ in range(max(vacant, 0))]
    count = len(requests)
    runs = [[live_runs(batch.rows.valid[row, : batch.length]) for row in rows] for batch, rows in sources]
    length = max(_entries(row_runs) for source in runs for row_runs in source)
    steps = max(request.budget - request.steps for request in requests)
    capacity = batch_capacity(length + max(steps, 0))
    device = first.logits.device
    buffer = KVBuffer(spec.layers, spec.kv_heads, spec.head_dim, capacity, dtype=spec.kv_dtype, device=spec.device, batch=count,
                      reserve=max(reserve, 0))
    key_positions = torch.zeros(count, capacity, dtype=torch.long, device=device)
    valid = torch.zeros(count, capacity, dtype=torch.bool, device=device)
    biased = [batch.rows.bias for batch, _ in sources if batch.rows.bias is not None]
    bias = torch.zeros(count, capacity, dtype=biased[0].dtype, device=device) if biased else None
    parts: list[SharedPart] = []
    copies: list[list[tuple[tuple, int, int]]] = []
    packed = Rows(buffer, key_positions, valid, None, ordered=False, bias=bias, copies=copies)
    logits = []
    at = 0
    for (batch, rows), source_runs in zip(sources, runs):
        old = batch.rows
        for row, row_runs in zip(rows, source_runs):
            begin = length - _entries(row_runs)
            copies.append(_packed(old.copies[row] if old.copies is not None else [], row_runs, begin))
            _pack_row(old, row, row_runs, packed, at, begin)
            at += 1
        if old.shared is not None:
            parts += old.shared.select(rows, at - len(rows))
        logits.append(batch.logits.index_select(0, torch.tensor(list(rows), dtype=torch.long, device=device)))
    if count > real:  # vacant rows: nothing valid, zeroed (0 x NaN), their logits never read
        buffer.storage[:, :, real:, :, :length] = 0
        copies += [[] for _ in range(count - real)]
        logits.append(logits[0].new_zeros(count - real, logits[0].shape[-1]))
    buffer.grow_to(length)
    old_shared = first.rows.shared or next((b.rows.shared for b, _ in sources if b.rows.shared is not None), None)
    packed.shared = old_shared.like(parts) if old_shared is not None else None  # a part two sources read: one part
    return RunningBatch(forward, packed, requests, torch.cat(logits), spec)


def steps_left(batch: RunningBatch) -> int:
    """The most steps a live row of ``batch`` may still run (its budget: it may stop sooner)."""
    return max((r.budget - r.steps for r in batch.requests if not r.done), default=0)


def merged_shape(batch: RunningBatch, newcomers: Sequence[tuple[int, RequestState]]) -> tuple[int, int]:
    """(rows, entries) of the batch :func:`combine` builds from ``batch``'s live rows and
    ``newcomers`` (each a prompt length and its request): what a merge, or (none) a rebuild
    without the finished rows, allocates."""
    live = [r for r in batch.requests if not r.done]
    length = max([batch.length] + [prompt for prompt, _ in newcomers])
    steps = max([r.budget - r.steps for r in live] + [r.budget for _, r in newcomers] + [0])
    return len(live) + len(newcomers), length + steps


@dataclass
class Merged:
    """What :func:`merge` did: the running batch now, the buffer it allocated (the caller holds
    it) and the buffers it let go of (the caller releases them, after holding the new one)."""

    batch: RunningBatch | None  # None: no row left
    made: KVBuffer | None
    dropped: list[KVBuffer]
    how: str  # "started", "in place", "rebuilt" or "dropped"
    promoted: int = 0  # running rows that now read a newcomer's shared part instead of their copy


def merge(batch: RunningBatch | None, fresh: RunningBatch | None, *, reserve: Callable[[int], int],
          vacant: Callable[[int], int]) -> Merged:
    """The running ``batch``'s live rows and ``fresh``'s (newly prefilled) rows as one batch;
    with no ``fresh``, ``batch`` rebuilt without its finished rows.

    Running rows that copied a module the newcomers share read the newcomers' part instead
    (:func:`promote`); the newcomers are written in place where they fit (:func:`admit`), else
    every live row is packed into a new buffer (:func:`combine`) with ``reserve(rows)`` reserved
    rows, or ``vacant(rows)`` vacant ones under ``compile``. A first batch is ``fresh`` itself,
    or its padded copy (:func:`padded`)."""
    if batch is None:
        assert fresh is not None
        return padded(fresh, vacant(fresh.batch))
    promoted = 0
    if fresh is not None:
        if fresh.rows.shared is not None:
            promoted = promote(batch, fresh.rows.shared)
        if admit(batch, fresh) is not None:  # the running rows are not copied
            return Merged(batch, None, [fresh.rows.buffer], "in place", promoted)
    keep = [row for row, request in enumerate(batch.requests) if not request.done]
    sources: list[tuple[RunningBatch, Sequence[int]]] = [(batch, keep)] if keep else []
    if fresh is not None:
        sources.append((fresh, range(fresh.batch)))
    if not sources:
        return Merged(None, None, [batch.rows.buffer], "dropped", promoted)
    if len(sources) == 1 and fresh is not None:  # every running row is finished: the newcomers alone
        started = padded(fresh, vacant(fresh.batch))
        return Merged(started.batch, started.made, [*started.dropped, batch.rows.buffer], "started", promoted)
    rows = sum(len(kept) for _, kept in sources)
    merged = combine(sources, reserve=reserve(rows), vacant=vacant(rows))
    dropped = [fresh.rows.buffer] if fresh is not None else []
    return Merged(merged, merged.rows.buffer, [*dropped, batch.rows.buffer], "rebuilt", promoted)


def padded(fresh: RunningBatch, vacant: int) -> Merged:
    """``fresh`` as the running batch: as it is, or (``vacant`` rows, under ``compile``) copied
    into a batch with that many vacant rows."""
    if not vacant:
        return Merged(fresh, None, [], "started")
    copy = combine([(fresh, range(fresh.batch))], vacant=vacant)
    return Merged(copy, copy.rows.buffer, [fresh.rows.buffer], "started")


def _pack_row(old: Rows, row: int, runs: Sequence[tuple[int, int]], new: Rows, at: int, begin: int) -> None:
    """Row ``row``'s live ``runs`` of ``old`` written one after another into row ``at`` of
    ``new`` from entry ``begin`` on: KV, key positions, bias; valid from there to the end."""
    filled = begin
    for start, stop in runs:
        taken = slice(filled, filled + stop - start)
        new.buffer.write(old.buffer.slice(start, stop, row), filled, row=at)
        new.key_positions[at, taken] = old.key_positions[row, start:stop]
        if new.bias is not None and old.bias is not None:
            new.bias[at, taken] = old.bias[row, start:stop]
        filled = taken.stop
    new.valid[at, begin:filled] = True
    new.buffer.storage[:, :, at, :, :begin] = 0  # masked, but 0 x NaN of uninitialised memory is NaN


def _entries(runs: Sequence[tuple[int, int]]) -> int:
    return sum(stop - start for start, stop in runs)


def _packed(copies: Sequence[tuple[tuple, int, int]], runs: Sequence[tuple[int, int]], first: int) -> list[tuple[tuple, int, int]]:
    """A row's copied segments after its live ``runs`` are packed together from entry ``first``
    (each copy lies within one run: its entries are live together or masked together)."""
    out, filled = [], first
    for start, stop in runs:
        out += [(sig, filled + a - start, filled + b - start) for sig, a, b in copies if start <= a and b <= stop]
        filled += stop - start
    return out


def live_runs(valid: torch.Tensor) -> list[tuple[int, int]]:
    """The ranges ``[start, stop)`` where a row's ``valid [entries]`` is True, ascending (read on the host)."""
    flags = valid.to("cpu", torch.int8)
    edge = torch.zeros(1, dtype=torch.int8)
    changes = torch.diff(flags, prepend=edge, append=edge).nonzero().flatten().tolist()
    return list(zip(changes[0::2], changes[1::2]))
