"""The decode loop, in the spirit of gpt-fast's ``generate.py``: :func:`decode_one_token` and
:func:`decode`, one loop for 1..n rows, over what :mod:`pc_rag.prefill.passes` prefilled.

Per-request state (sampling, stops, detokenising, statistics) lives in
:class:`pc_rag.decode.request.RequestState`; the running batch (:class:`RunningBatch`) is what the
scheduler steps.
"""


from __future__ import annotations

import logging
from collections.abc import Generator, Sequence
from typing import Any

import torch

from ..forward.attention import attention_mask
from ..forward.forward import Forward, NewTokens
from ..forward.row_extents import RowExtents, extents_for
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
    """Where each row of a step attends (:mod:`pc_rag.forward.row_extents`): for a batch in a CPU's
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


class RunningBatch:
    """Rows decoding together, one token per row per step: the state :func:`decode` loops over,
    and what the scheduler (:mod:`pc_rag.scheduler`) keeps running while callers come and go.

    A step is :meth:`take` (every row's next token chosen from the pending logits, on the device
    for the whole batch, and read back in one transfer; each request records its own) then
    :meth:`feed` (those tokens, a finished row's replaced by a placeholder, through the model:
    the next pending logits). Between the two the scheduler hands out the text, and may rebuild
    the batch from the rows that go on plus newly prefilled ones (:mod:`pc_rag.decode.layout`).
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
