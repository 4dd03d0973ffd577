"""The decode loop, in the spirit of gpt-fast's ``generate.py``: :func:`decode_one_token` and
:func:`decode`, one loop for 1..n rows, over what :mod:`pc_rag.prefill.passes` prefilled.

Per-request state (sampling, stops, detokenising, statistics) lives in
:class:`pc_rag.decode.request.RequestState`; the running batch (:class:`RunningBatch`) is what the
scheduler steps.
"""


from __future__ import annotations

from collections.abc import Generator, Sequence

import torch

from ..kv.buffers import KVBuffer, batch_capacity
from ..model.attention import attention_mask
from ..model.forward import Forward
from ..model.shared_attention import SharedKV, SharedPart
from ..model.spec import ModelSpec
from ..prefill.rows import Rows
from .constrained import allowed_tokens
from .request import RequestState, TokenHistory


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
        if self.fixed:
            rows.valid[:, start : self.end] = False
            rows.buffer.fix(self.end, self.column)

    def advance(self) -> None:
        self.positions += 1
        self.column += 1
        self.bounds = (self.bounds[0] + 1, self.bounds[1] + 1)


def decode_one_token(forward: Forward, rows: Rows, ids: torch.Tensor, cursor: Cursor, spec: ModelSpec) -> torch.Tensor:
    """Feed one token per row (``ids [rows, 1]``, on the device) at the cursor; the next logits, ``[rows, vocab]``."""
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
    mask = attention_mask(positions, rows.key_positions[:, :keys], rows.valid[:, :keys], spec, rows.bias) if masked else None
    logits = forward.decode_batch(rows.buffer, ids, positions, cursor.bounds, mask, rows.shared)
    cursor.advance()
    return logits


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
        self.length = len(rows.buffer)  # cache entries written (read on the host: the cursor's column)
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

    def feed(self) -> None:
        """The tokens :meth:`take` chose through the model, one per row: the next pending logits.
        What is fed is those same tokens (a finished row's replaced by a placeholder) unless the
        host changed one (a grammar closing its document)."""
        fed, chosen = self.fed, self._chosen
        assert self._tokens is not None, "take() comes first"
        if [token is not None for token in fed] != self.alive:  # a row finished: it feeds placeholders from now on
            self.alive = [token is not None for token in fed]
            self.live = torch.tensor(self.alive, device=self.logits.device)[:, None]
        if any(token is not None and token != chosen[row] for row, token in enumerate(fed)):
            ids = torch.tensor([[self.spec.placeholder_id if token is None else token] for token in fed], device=self.logits.device)
        else:
            ids = torch.where(self.live, self._tokens[:, None], self.placeholder)
        if self.history is not None:
            self.history.append(ids)
        self.logits = decode_one_token(self.forward, self.rows, ids, self.cursor, self.spec)
        self.length += 1
        for request in self.requests:
            request.next_position += 1

    @classmethod
    def combine(cls, sources: Sequence[tuple["RunningBatch", Sequence[int]]]) -> "RunningBatch":
        """Rows ``rows`` (ascending) of each source batch, in that order, as one new batch.

        Every source waits between steps (its pending logits unread). Each row's own cache
        entries are copied into one new buffer, up to the longest source's length (shorter rows
        are padded with masked entries, which cost nothing but their place); what a row read in
        place (shared parts) it still reads in place. Sources need a model whose attention
        follows a position mask (``spec.one_pass``); their buffers are left to the caller.
        """
        first = sources[0][0]
        spec, forward = first.spec, first.forward
        requests = [batch.requests[row] for batch, rows in sources for row in rows]
        count = len(requests)
        length = max(batch.length for batch, _ in sources)
        steps = max(request.budget - request.steps for request in requests)
        capacity = batch_capacity(length + max(steps, 0))
        device = first.logits.device
        buffer = KVBuffer(spec.layers, spec.kv_heads, spec.head_dim, capacity, dtype=spec.dtype, device=spec.device, batch=count)
        key_positions = torch.zeros(count, capacity, dtype=torch.long, device=device)
        valid = torch.zeros(count, capacity, dtype=torch.bool, device=device)
        biased = [batch.rows.bias for batch, _ in sources if batch.rows.bias is not None]
        bias = torch.zeros(count, capacity, dtype=biased[0].dtype, device=device) if biased else None
        parts: list[SharedPart] = []
        logits = []
        at = 0
        for batch, rows in sources:
            index = torch.tensor(list(rows), dtype=torch.long, device=device)
            end, taken = batch.length, slice(at, at + len(rows))
            # [layers, 2, rows, kv_heads, entries, head_dim]: the rows' written entries, then zeros
            # up to the common length (masked, but 0 x NaN of uninitialised memory is NaN)
            buffer.storage[:, :, taken, :, :end] = batch.rows.buffer.storage[:, :, :, :, :end].index_select(2, index)
            buffer.storage[:, :, taken, :, end:length] = 0
            key_positions[taken, :end] = batch.rows.key_positions[index, :end]
            valid[taken, :end] = batch.rows.valid[index, :end]
            if bias is not None and batch.rows.bias is not None:
                bias[taken, :end] = batch.rows.bias[index, :end]
            if batch.rows.shared is not None:
                parts += batch.rows.shared.select(rows, at)
            logits.append(batch.logits.index_select(0, index))
            at += len(rows)
        buffer.grow_to(length)
        old = first.rows.shared or next((b.rows.shared for b, _ in sources if b.rows.shared is not None), None)
        shared = SharedKV(parts, heads_per_kv=old.heads_per_kv, dtype=old.dtype, rotator=old.rotator) if parts and old else None
        holes = any(batch.rows.holes for batch, _ in sources)
        rows_ = Rows(buffer, key_positions, valid, shared, ordered=False, bias=bias, holes=holes)
        return cls(forward, rows_, requests, torch.cat(logits), spec)


def decode(
    forward: Forward, rows: Rows, requests: Sequence[RequestState], logits: torch.Tensor, spec: ModelSpec
) -> Generator[list[str], None, None]:
    """The decode loop: every row's next token from ``logits``, fed back until every request is
    done (:class:`RunningBatch`). Yields each step's new text, one string per row."""
    batch = RunningBatch(forward, rows, requests, logits, spec)
    while True:
        deltas = batch.take()
        yield deltas
        if batch.finished:
            return
        batch.feed()


def choose(requests: Sequence[RequestState], logits: torch.Tensor, history: TokenHistory | None, alive: Sequence[bool]) -> torch.Tensor:
    """Every row's next token, ``[rows]`` on the device, in transformers' order: logits
    processors, the grammar's mask (one bitmask for the batch, one transfer), then greedy choice
    (one argmax for the batch) or sampling."""
    scores = logits
    if history is not None:
        scores = torch.stack([request.scores(logits[row], history, row).float() for row, request in enumerate(requests)])
    matchers = [request.matcher if live else None for request, live in zip(requests, alive)]
    if any(matcher is not None for matcher in matchers):
        allowed = allowed_tokens(matchers, logits.shape[-1], logits.device)
        masked = scores.float().masked_fill(~allowed, float("-inf"))
        if scores is not logits:
            # the processors banned every token the grammar allows (a repeated n-gram the schema
            # forces): the grammar is the hard constraint, the processors a preference
            banned = ~torch.isfinite(masked).any(-1, keepdim=True)
            masked = torch.where(banned, logits.float().masked_fill(~allowed, float("-inf")), masked)
        scores = masked
    tokens = scores.argmax(-1)
    for row, request in enumerate(requests):
        if alive[row] and not request.greedy:
            tokens[row] = request.sampler(scores[row])
    return tokens


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
        token, delta = request.take(chosen[row], logits[row])
        tokens.append(token)
        deltas.append(delta)
    return tokens, deltas
