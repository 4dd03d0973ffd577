"""The decode loop, in the spirit of gpt-fast's ``generate.py``: :func:`decode_one_token` and
:func:`decode`, one loop for 1..n rows, over what :mod:`pc_rag.prefill.passes` prefilled.

Per-request state (sampling, stops, detokenising, statistics) lives in
:class:`pc_rag.decode.request.RequestState`; the running batch (:class:`RunningBatch`) is what the
scheduler steps.
"""


from __future__ import annotations

import logging
from collections.abc import Generator, Sequence
from dataclasses import replace
from typing import Any

import torch

from ..kv.buffers import KVBuffer, batch_capacity
from ..model.attention import attention_mask
from ..model.forward import Forward, NewTokens
from ..model.row_extents import RowExtents, extents_for
from ..model.shared_attention import SharedKV, SharedPart, row_list, row_set
from ..model.spec import ModelSpec
from ..prefill.rows import Rows
from .constrained import allowed_tokens
from .request import RequestState, TokenHistory

logger = logging.getLogger(__name__)


class Cursor:
    """Where the decode loop writes next, kept on the device: each row's next position and (fixed
    shapes) the cache column every row's new token goes to.

    With fixed shapes (models whose attention follows a position mask, ``spec.one_pass``) every
    step attends over the same ``end`` entries of the rows' cache: positions, the validity of
    entries and the mask are updated and built on the device, nothing is read back, and the step
    has the same shapes every time (what torch.compile and CUDA graphs need). Otherwise the cache
    grows by one entry per step and a mask is built only where one is needed.
    """

    def __init__(self, rows: Rows, positions: Sequence[int], steps: int, spec: ModelSpec, *, whole: bool = False) -> None:
        device = rows.key_positions.device
        start = len(rows.buffer)
        self.positions = torch.tensor(list(positions), dtype=torch.long, device=device)[:, None]
        self.bounds = (min(positions), max(positions))  # the same, on the host (shared KV reads them)
        self.fixed = spec.one_pass
        # whole: attend over the buffer's whole capacity (rounded by the pool), so that a compiled
        # step sees a few shapes across requests instead of one per prompt length
        self.end = rows.buffer.capacity if whole else start + max(steps, 0)
        self.column = torch.tensor([start], dtype=torch.long, device=device)
        self.at = start  # the same column, on the host: cache entries written
        if self.fixed:
            rows.valid[:, start : self.end] = False
            rows.buffer.fix(self.end, self.column)

    def advance(self) -> None:
        self.positions += 1
        self.column += 1
        self.at += 1
        self.bounds = (self.bounds[0] + 1, self.bounds[1] + 1)


def decode_one_token(forward: Forward, rows: Rows, ids: torch.Tensor, cursor: Cursor, spec: ModelSpec,
                     live: Sequence[bool] | None = None) -> torch.Tensor:
    """Feed one token per row (``ids [rows, 1]``, on the device) at the cursor; the next logits, ``[rows, vocab]``.
    ``live[row]`` False: the row has finished, its logits are not read (a CPU step leaves it out of attention)."""
    # compiled: always an additive mask, whether or not a row carries APE's bias, so that plain and
    # RAG rows run one compiled graph (a boolean mask and a float one are two, each compiled apart)
    mask = _place_step(rows, cursor, spec, additive=forward.compiled)
    logits = forward.decode_batch(rows.buffer, ids, cursor.positions, cursor.bounds, mask, rows.shared,
                                  _extents(rows, cursor, spec, live))
    cursor.advance()
    return logits


def decode_one_token_with(forward: Forward, rows: Rows, ids: torch.Tensor, cursor: Cursor, spec: ModelSpec,
                          other: NewTokens, live: Sequence[bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_one_token` and ``other`` batch's new tokens (a prefill chunk) in one packed
    forward pass (:meth:`Forward.packed`): the step rides on the chunk's weight reads. Returns
    the step's logits and ``other``'s last-column logits. Fixed shapes only (``spec.one_pass``)."""
    mask = _place_step(rows, cursor, spec)
    assert mask is not None, "a packed step needs the decode step's mask (fixed shapes)"
    step = NewTokens(rows.buffer, ids, cursor.positions, mask, rows.shared, cursor.bounds, _extents(rows, cursor, spec, live))
    logits, other_logits = forward.packed([step, other], spec.window_layers)
    cursor.advance()
    return logits, other_logits


def _extents(rows: Rows, cursor: Cursor, spec: ModelSpec, live: Sequence[bool] | None) -> RowExtents | None:
    """Where each row of a step attends (:mod:`pc_rag.model.row_extents`): for a batch in a CPU's
    memory with fixed shapes (its rows' entries are where the mask says) and ``pc_rag_sdpa``
    attention, which reads them, where that reads enough less; None otherwise (one batched call)."""
    if live is None or rows.batch == 1 or not cursor.fixed or not spec.split or rows.valid.device.type != "cpu":
        return None
    return extents_for(rows.valid, cursor.at + 1, live, spec.kv_heads, width=cursor.end)


def _place_step(rows: Rows, cursor: Cursor, spec: ModelSpec, *, additive: bool = False) -> Any:
    """Record the step's new entries (positions, validity); its attention mask (``additive``: a
    float one whatever the attention takes), or None where none is needed."""
    positions = cursor.positions
    if cursor.fixed:
        rows.key_positions.index_copy_(1, cursor.column, positions)
        rows.valid.index_fill_(1, cursor.column, True)
        keys = cursor.end
        masked = True
    else:
        keys = len(rows.buffer) + 1
        rows.key_positions[:, keys - 1] = positions[:, 0]
        rows.valid[:, keys - 1] = True  # finished rows feed a placeholder nobody reads
        # one row's new token comes after every key, so only padding or a window needs a mask
        masked = rows.batch > 1 or rows.holes or rows.bias is not None or (spec.sliding_window is not None and not rows.ordered)
    if not masked:
        return None
    return attention_mask(positions, rows.key_positions[:, :keys], rows.valid[:, :keys], spec, rows.bias, additive=additive)


class VacantRow:
    """A row a batch holds for a newcomer under ``compile`` (:meth:`RunningBatch.combine`'s
    ``vacant``), so that the compiled step sees a few batch sizes: done from the start, it feeds
    placeholders (attending only to them) until :meth:`RunningBatch.admit` writes a request into it."""

    done = True
    greedy = True
    matcher = None
    processors = None
    budget = steps = 0

    def __init__(self, next_position: int) -> None:
        self.next_position = next_position  # a live row's: the step's position bounds stay theirs


class RunningBatch:
    """Rows decoding together, one token per row per step: the state :func:`decode` loops over,
    and what the scheduler (:mod:`pc_rag.scheduler`) keeps running while callers come and go.

    A step is :meth:`take` (every row's next token chosen from the pending logits, on the device
    for the whole batch, and read back in one transfer; each request records its own) then
    :meth:`feed` (those tokens, a finished row's replaced by a placeholder, through the model:
    the next pending logits). Between the two the scheduler hands out the text, and may rebuild
    the batch from the rows that go on plus newly prefilled ones (:meth:`combine`).
    """

    def __init__(self, forward: Forward, rows: Rows, requests: Sequence[RequestState], logits: torch.Tensor, spec: ModelSpec) -> None:
        self.forward, self.rows, self.requests, self.logits, self.spec = forward, rows, list(requests), logits, spec
        steps = max((request.budget - request.steps for request in self.requests), default=0)
        self.cursor = Cursor(rows, [request.next_position for request in self.requests], steps, spec, whole=forward.compiled)
        self.history = None
        if any(request.processors is not None for request in self.requests):
            # what the processors read: the prompt and every token fed so far (a row taken over
            # from another batch brings what it generated there)
            self.history = TokenHistory([[*request.prompt_ids, *request.detok.tokens] for request in self.requests], steps,
                                        logits.device)
        self.alive = [True] * len(self.requests)  # every row takes the pending logits
        self.live = torch.ones(len(self.requests), 1, dtype=torch.bool, device=logits.device)
        self.placeholder = torch.tensor(spec.placeholder_id, device=logits.device)
        self.fed: list[int | None] = []
        self._tokens: torch.Tensor | None = None
        self._chosen: list[int] = []

    @property
    def batch(self) -> int:
        return len(self.requests)

    @property
    def length(self) -> int:
        """Cache entries written: the cursor's column, read on the host."""
        return self.cursor.at

    @property
    def finished(self) -> bool:
        """Whether every row is done (after :meth:`take`)."""
        return all(token is None for token in self.fed)

    def take(self) -> list[str]:
        """Every row's next token from the pending logits, recorded by its request; the new text, one string per row."""
        tokens = choose(self.requests, self.logits, self.history, self.alive)
        self._chosen = tokens.tolist()  # the one host transfer of the step
        self._tokens = tokens
        self.fed, deltas = _take(self.requests, self.logits, self._chosen, self.alive)
        return deltas

    def feed(self, alongside: NewTokens | None = None) -> torch.Tensor | None:
        """The tokens :meth:`take` chose through the model, one per row: the next pending logits.
        What is fed is those same tokens (a finished row's replaced by a placeholder) unless the
        host changed one (a grammar closing its document).

        ``alongside``: another batch's new tokens (a newcomer's prefill chunk, see
        :func:`decode_one_token_with`) run in the same forward pass; returns their last-column
        logits (None without)."""
        fed, chosen = self.fed, self._chosen
        assert self._tokens is not None, "take() comes first"
        if [token is not None for token in fed] != self.alive:  # a row finished: it feeds placeholders from now on
            self.alive = [token is not None for token in fed]
            self.live = torch.tensor(self.alive, device=self.logits.device)[:, None]
        if any(token is not None and token != chosen[row] for row, token in enumerate(fed)):
            ids = torch.tensor([[self.spec.placeholder_id if token is None else token] for token in fed], device=self.logits.device)
        else:
            ids = torch.where(self.live, self._tokens[:, None], self.placeholder)
        other = None
        if alongside is None:
            self.logits = decode_one_token(self.forward, self.rows, ids, self.cursor, self.spec, self.alive)
        else:
            self.logits, other = decode_one_token_with(self.forward, self.rows, ids, self.cursor, self.spec, alongside, self.alive)
        # after the pass: a pass that raised may be run again (the same entries rewritten, nothing counted twice)
        if self.history is not None:
            self.history.append(ids)
        for request in self.requests:
            request.next_position += 1
        return other

    def admit(self, fresh: "RunningBatch") -> list[int] | None:
        """``fresh``'s rows written into this batch in place: into finished rows' slots first, then
        into rows its buffer reserves (:meth:`KVBuffer.widen`). Only the new rows' entries are
        copied; the running rows' caches stay where they are. Returns the rows taken (one per fresh
        row, in order), or None where the rows do not fit that way (too few free rows, too little
        capacity, rows that read shared parts or carry logits processors' history): then
        :meth:`combine` rebuilds.

        The write column may jump forward to the longest new row: the entries a running row skips
        stay masked (attention follows positions, not where an entry sits; ``spec.one_pass``).
        """
        rows = self.rows
        if not self.cursor.fixed or self.history is not None or fresh.history is not None:
            return None
        if fresh.rows.bias is not None and rows.bias is None:
            return None
        slots = [row for row, request in enumerate(self.requests) if request.done][: fresh.batch]
        widen = fresh.batch - len(slots)
        if widen > rows.buffer.reserved:
            return None
        going = [r.budget - r.steps for r in self.requests if not r.done]
        steps = max(going + [r.budget - r.steps for r in fresh.requests] + [0])
        column = max(self.length, fresh.length)
        end = max(self.cursor.end, column + steps)
        if end > rows.buffer.capacity:
            return None
        reused = set(slots)
        if widen:  # outside inference mode: the new tensors are written in place by later steps
            self._widen(widen, fresh.requests[0])
            slots += range(self.batch - widen, self.batch)
        # the shared parts: the finished rows whose slots are taken read none any more, the new rows read theirs
        parts = rows.shared.renumbered({row: row for row in range(self.batch) if row not in reused}) if rows.shared else []
        if fresh.rows.shared is not None:
            parts += fresh.rows.shared.renumbered(dict(enumerate(slots)))
        template = rows.shared or fresh.rows.shared
        rows.shared = template.like(parts) if template is not None else None
        with torch.inference_mode():
            if end > self.cursor.end:  # attend further: the new entries masked and zeroed (0 x NaN is NaN)
                rows.valid[:, self.cursor.end : end] = False
                rows.buffer.fix(end, self.cursor.column)
                self.cursor.end = end
            if column > self.length:  # every row writes further on; the entries between stay masked
                self.cursor.column.fill_(column)
                self.cursor.at = column
            for new, slot in enumerate(slots):
                self._write_row(slot, fresh, new, end)
            index = torch.tensor(slots, dtype=torch.long, device=self.logits.device)
            self.logits = self.logits.index_copy(0, index, fresh.logits.to(self.logits.dtype))
            self.cursor.positions.index_copy_(0, index, fresh.cursor.positions)
        rows.holes = rows.holes or fresh.rows.holes
        positions = [request.next_position for request in self.requests]
        self.cursor.bounds = (min(positions), max(positions))
        self.live = torch.tensor(self.alive, device=self.logits.device)[:, None]
        return slots

    def _widen(self, count: int, placeholder: RequestState) -> None:
        """``count`` more rows from the buffer's reserve, each a copy of row 0's state until written."""
        rows = self.rows
        rows.buffer.widen(rows.batch + count)
        more = lambda t: torch.cat([t, t[:1].expand(count, *t.shape[1:])])  # noqa: E731
        rows.key_positions, rows.valid = more(rows.key_positions), more(rows.valid)
        if rows.bias is not None:
            rows.bias = more(rows.bias)
        if rows.copies is not None:
            rows.copies += [[] for _ in range(count)]
        self.logits, self.cursor.positions = more(self.logits), more(self.cursor.positions)
        self.requests += [placeholder] * count
        self.alive += [False] * count

    def _write_row(self, slot: int, fresh: "RunningBatch", new: int, end: int) -> None:
        """Row ``new`` of ``fresh`` (its cache, positions, request) as this batch's row ``slot``,
        aligned to end at the write column (its entries and what it decodes are one range:
        :mod:`pc_rag.model.row_extents`)."""
        rows, filled = self.rows, fresh.length
        at = self.length - filled
        taken = slice(at, self.length)
        rows.buffer.write(fresh.rows.buffer.slice(0, filled, new), at, row=slot)
        # the rest of what a batched step attends to: masked, but 0 x NaN (uninitialised memory) is NaN
        rows.buffer.storage[:, :, slot, :, :at] = 0
        rows.buffer.storage[:, :, slot, :, self.length : end] = 0
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
        self.requests[slot] = fresh.requests[new]
        self.alive[slot] = True

    def held(self) -> dict[tuple, SharedPart | None]:
        """What the live rows read that a newcomer importing it too could read with them (by
        segment signatures, :func:`pc_rag.prefill.assemble.signature`): the shared parts, and
        (None) each cached segment a row copied into its own cache (:meth:`promote` turns those
        into parts when a newcomer brings one)."""
        if not self.cursor.fixed:
            return {}
        live = {row for row, request in enumerate(self.requests) if not request.done}
        held: dict[tuple, SharedPart | None] = {}
        for row in live:
            for sig, _, _ in (self.rows.copies[row] if self.rows.copies is not None else ()):
                held[(sig,)] = None
        for part in self.rows.shared.parts if self.rows.shared is not None else ():
            if part.signature and live.intersection(row_list(part.rows)):
                held[part.signature] = part
        return held

    def promote(self, shared: SharedKV) -> int:
        """Live rows that hold every segment of one of ``shared``'s parts (newcomers') in their own
        cache read that part instead, with the rows that brought it: their copies are masked (a
        rebuild drops them) and each such part is read once per step for all. Between steps;
        returns the rows moved.

        Exact: a moved module's keys are rotated in a copy and read unrotated, its queries
        rotated back, in a part (:mod:`pc_rag.model.shared_attention`); both are the same product."""
        copies = self.rows.copies
        if copies is None or not self.cursor.fixed:
            return 0
        joined = []
        for part in shared.parts:
            wanted = set(part.signature)
            readers = []
            for row, request in enumerate(self.requests):
                mine = [copy for copy in copies[row] if copy[0] in wanted]
                if request.done or not wanted or len({sig for sig, _, _ in mine}) < len(wanted):
                    continue
                with torch.inference_mode():
                    for _, start, stop in mine:
                        self.rows.valid[row, start:stop] = False
                copies[row] = [copy for copy in copies[row] if copy[0] not in wanted]
                readers.append(row)
            if readers:
                joined.append(replace(part, rows=row_set(readers)))
        if joined:
            self.rows.shared = (self.rows.shared or shared).like([*(self.rows.shared.parts if self.rows.shared else ()), *joined])
            self.rows.holes = True
        return sum(len(row_list(part.rows)) for part in joined)

    @classmethod
    def combine(cls, sources: Sequence[tuple["RunningBatch", Sequence[int]]], *, reserve: int = 0, vacant: int = 0) -> "RunningBatch":
        """Rows ``rows`` (ascending) of each source batch, in that order, as one new batch whose
        buffer reserves ``reserve`` more rows for later arrivals (:meth:`admit`), or holds
        ``vacant`` more rows (:class:`VacantRow`, last) that later arrivals take the same way;
        none where a request carries logits processors (their history has no vacant rows).

        Every source waits between steps (its pending logits unread). Each row's live entries
        (its prompt and what it decoded, not the masked ones between) are packed into one new
        buffer, as runs of slices, aligned to end where the batch writes next; rows shorter than
        the longest start later, after masked entries (a CPU step does not read them:
        :mod:`pc_rag.model.row_extents`). Packing keeps the batch's length that of its longest
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
        buffer = KVBuffer(spec.layers, spec.kv_heads, spec.head_dim, capacity, dtype=spec.dtype, device=spec.device, batch=count,
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
        return cls(forward, packed, requests, torch.cat(logits), spec)


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


def decode(
    forward: Forward, rows: Rows, requests: Sequence[RequestState], logits: torch.Tensor, spec: ModelSpec
) -> Generator[list[str], None, None]:
    """A bare decode loop over one batch, no scheduler: every row's next token from ``logits``,
    fed back until every request is done (:class:`RunningBatch`). Yields each step's new text, one
    string per row. The scheduler's loop does this with admission and callers around it;
    ``benchmarks/serving.py`` measures what those add against this."""
    batch = RunningBatch(forward, rows, requests, logits, spec)
    while True:
        deltas = batch.take()
        failed = next((request.error for request in requests if request.error is not None), None)
        if failed is not None:
            raise failed
        yield deltas
        if batch.finished:
            return
        batch.feed()


def choose(requests: Sequence[RequestState], logits: torch.Tensor, history: TokenHistory | None, alive: Sequence[bool]) -> torch.Tensor:
    """Every row's next token, ``[rows]`` on the device, in transformers' order: logits
    processors, the grammar's mask (one bitmask for the batch, one transfer), then greedy choice
    (one argmax for the batch) or sampling.

    A row whose processors, grammar or sampler raise fails its request alone
    (:meth:`RequestState.fail`); the other rows' tokens are chosen as if it were not there."""
    scores = logits
    if history is not None:
        scores = torch.stack([_row_scores(request, logits, history, row) for row, request in enumerate(requests)])
    matchers = [request.matcher if live and not request.done else None for request, live in zip(requests, alive)]
    if any(matcher is not None for matcher in matchers):
        allowed = allowed_tokens(matchers, logits.shape[-1], logits.device, lambda row, err: _fail(requests[row], err))
        masked = scores.float().masked_fill(~allowed, float("-inf"))
        if scores is not logits:
            # the processors banned every token the grammar allows (a repeated n-gram the schema
            # forces): the grammar is the hard constraint, the processors a preference
            banned = ~torch.isfinite(masked).any(-1, keepdim=True)
            masked = torch.where(banned, logits.float().masked_fill(~allowed, float("-inf")), masked)
        scores = masked
    tokens = scores.argmax(-1)
    for row, request in enumerate(requests):
        if alive[row] and not request.greedy and not request.done:
            try:
                tokens[row] = request.sampler(scores[row])
            except Exception as err:  # noqa: BLE001 - one row's failure is its request's alone
                _fail(request, err)
    return tokens


def _row_scores(request: RequestState, logits: torch.Tensor, history: TokenHistory, row: int) -> torch.Tensor:
    try:
        return request.scores(logits[row], history, row).float()
    except Exception as err:  # noqa: BLE001 - one row's failure is its request's alone
        _fail(request, err)
        return logits[row].float()


def _fail(request: RequestState, err: Exception) -> None:
    if not request.done:
        logger.warning("a request failed while decoding (%s: %s); the rows beside it go on", type(err).__name__, err)
        request.fail(err)


def _take(requests: Sequence[RequestState], logits: torch.Tensor, chosen: Sequence[int], alive: Sequence[bool]
          ) -> tuple[list[int | None], list[str]]:
    """Each live row records its chosen token; the tokens to feed next (None: row done) and the new text."""
    tokens: list[int | None] = []
    deltas: list[str] = []
    for row, request in enumerate(requests):
        if not alive[row] or request.done:
            tokens.append(None)
            deltas.append("")
            continue
        try:
            token, delta = request.take(chosen[row], logits[row])
        except Exception as err:  # noqa: BLE001 - one row's failure is its request's alone
            _fail(request, err)
            token, delta = None, ""
        tokens.append(token)
        deltas.append(delta)
    return tokens, deltas
