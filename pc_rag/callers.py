"""The callers' side of the scheduler: what a caller submits, and how it reads the answer.

A caller plans its prompts on its own thread and submits a :class:`Ticket` (one row per plan,
with its :class:`RequestState`) to a :class:`TicketQueue` (the scheduler). The loop thread emits
events on the ticket: text as it is decoded, then the result or the error. The caller reads them
through :func:`wait` (a generator, wrapped as :class:`StreamingGeneration`) or, under asyncio,
:class:`AsyncStream`, whose event loop never waits on a forward pass. Leaving early, either way,
cancels the ticket: its rows stop at the scheduler's next step.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import queue
from collections.abc import Awaitable, Callable, Generator, Iterator, Sequence
from typing import Any, Protocol, TypeVar

from .decode.loop import RunningBatch
from .decode.request import CacheStats, Generation, RequestState
from .prompt.plan import Plan

logger = logging.getLogger(__name__)
_ids = itertools.count(1)


class RequestStatus(enum.Enum):
    """Where a submission is. The scheduler's loop moves it along; the last three are final."""

    WAITING = "waiting"  # queued with the admission policy
    ADMITTING = "admitting"  # chosen, being prefilled in one pass
    PREFILLING = "prefilling"  # being prefilled in chunks, one per iteration
    RUNNING = "running"  # its rows decode in the running batch
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED)


class Ticket:
    """One submission: its plans (a row each), their request states, and the events its caller reads.

    Events are ``("text", str)`` (a single request's text as it is decoded), then ``("done",
    result)`` or ``("error", exception)``. ``status`` (a :class:`RequestStatus`) is where it is;
    ``id`` names it in the scheduler. Each of its requests knows it: ``request.owner`` is
    ``(ticket, index)``, so whichever row of a batch holds a request, its caller is found there.
    """

    def __init__(self, plans: Sequence[Plan], requests: Sequence[RequestState], *, use_cache: bool, share: bool,
                 submitted: float, logits_only: bool = False) -> None:
        self.plans, self.requests = list(plans), list(requests)
        self.use_cache, self.share, self.logits_only = use_cache, share, logits_only
        self.submitted = submitted
        self.id = next(_ids)
        self.status = RequestStatus.WAITING
        self.events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.cancelled = False  # set by the caller's side
        self.results: list[Generation | None] = [None] * len(self.plans)
        self.unfinished = len(self.plans)
        self.listeners: list[Callable[[], None]] = []  # called after every event (an asyncio waiter's wake-up)
        self.alone = logits_only  # admitted by itself (a prefill that failed in company is tried again alone)
        for index, request in enumerate(self.requests):
            request.owner = (self, index)

    @property
    def rows(self) -> int:
        return len(self.plans)

    @property
    def tokens(self) -> int:
        """Tokens its prefill computes."""
        return sum(p.computed_tokens if self.use_cache else len(p.input_ids) for p in self.plans)

    @property
    def entries(self) -> int:
        """Cache entries its longest row may need: the prompt and the answer's budget."""
        return max(len(p.input_ids) + r.budget for p, r in zip(self.plans, self.requests))

    @property
    def single(self) -> bool:
        return len(self.plans) == 1

    @property
    def closed(self) -> bool:
        """Whether its last event is out (its status is final)."""
        return self.status.final

    def emit(self, kind: str, payload: Any) -> None:
        self.events.put((kind, payload))
        for listener in self.listeners:
            try:
                listener()
            except Exception as err:  # noqa: BLE001 - the caller's side, not the loop's, is broken
                # its waiter is gone (an asyncio loop that closed with the stream unread): nobody
                # reads this request any more, so its row stops at the next step, as if cancelled
                logger.warning("a caller's wake-up failed (%s); cancelling its request", err)
                self.cancelled = True

    def finish(self, status: RequestStatus, payload: Any) -> None:
        """The last event: the result (``FINISHED``) or the error (``CANCELLED``, ``FAILED``); once only."""
        assert status.final
        if not self.closed:
            self.status = status
            self.emit("done" if status is RequestStatus.FINISHED else "error", payload)


class TicketQueue(Protocol):
    """Where tickets go (:class:`pc_rag.scheduler.Scheduler`)."""

    def submit(self, ticket: Ticket) -> Ticket: ...

    def cancel(self, ticket: Ticket) -> None: ...


def wait(ticket: Ticket, cancel: Callable[[Ticket], None]) -> Generator[str, None, Any]:
    """The caller's side: yields a single request's text as it comes, returns the result (a list
    for several rows); leaving early (closing the generator) calls ``cancel(ticket)``."""
    over = False
    try:
        while True:
            kind, payload = ticket.events.get()
            if kind == "text":
                yield payload
            elif kind == "done":
                over = True
                return payload
            else:
                over = True
                raise payload
    finally:
        if not over:
            cancel(ticket)


def hand_out(batch: RunningBatch, deltas: Sequence[str]) -> tuple[int, int]:
    """Each row's new text (from :meth:`RunningBatch.take`) to its caller; a row finished at this
    step gives its caller its result at once (all of them, for a ticket of several rows). A row
    that failed alone (its processors, grammar, sampler or detokeniser raised) fails its ticket,
    whose other rows stop at the next step. Returns the rows finished and the rows failed."""
    finished = failed = 0
    for row, (request, delta) in enumerate(zip(batch.requests, deltas)):
        if request.owner is None:  # a vacant row
            continue
        ticket, index = request.owner
        if ticket.closed:
            continue
        if request.error is not None:  # this row alone failed (pc_rag.decode.loop.choose)
            failed += ticket.unfinished
            ticket.finish(RequestStatus.FAILED, request.error)
            continue
        if delta and ticket.single:
            ticket.emit("text", delta)
        if batch.alive[row] and batch.fed[row] is None:  # finished at this step (alive: before it)
            try:
                tail, result = request.close()
            except Exception as err:  # noqa: BLE001 - its detokeniser's failure is its request's alone
                logger.warning("a request failed as it finished (%s: %s); the rows beside it go on", type(err).__name__, err)
                request.fail(err)
                failed += ticket.unfinished
                ticket.finish(RequestStatus.FAILED, err)
                continue
            if ticket.cancelled:
                result.finish_reason = "cancelled"
            if tail and ticket.single:
                ticket.emit("text", tail)
            ticket.results[index] = result
            ticket.unfinished -= 1
            finished += 1
            if ticket.unfinished == 0:
                ticket.finish(RequestStatus.FINISHED, result if ticket.single else list(ticket.results))
    return finished, failed


class StreamingGeneration(Iterator[str]):
    """Iterator over text deltas; ``.result`` (a :class:`Generation`) is set once exhausted.

    ``deltas`` is a generator that yields text and *returns* the final Generation.
    """

    def __init__(self, deltas: Generator[str, None, Generation]) -> None:
        self._deltas = deltas
        self.result: Generation | None = None

    def __iter__(self) -> "StreamingGeneration":
        return self

    def __next__(self) -> str:
        try:
            return next(self._deltas)
        except StopIteration as done:
            self.result = done.value
            raise

    def close(self) -> None:
        """Stop decoding now; the request's buffer goes back to the pool (as when the stream is collected)."""
        self._deltas.close()

    @property
    def stats(self) -> CacheStats | None:
        return self.result.stats if self.result else None


class AsyncStream:
    """Async iterator over one submission's text; ``result`` (its Generation) once exhausted.

    ``start`` plans and builds the ticket; it runs, with the submission, on a worker thread at
    the first ``__anext__`` (planning may read a remote registry, and a full queue may make a
    submission wait), so the event loop never blocks. Cancelling the task that awaits the stream,
    or ``aclose()``, cancels the request: its row stops at the scheduler's next step.
    """

    def __init__(self, queue: TicketQueue, start: Callable[[], Ticket]) -> None:
        self._queue, self._start = queue, start
        self._ticket: Ticket | None = None  # once submitted
        self._planned: Ticket | None = None  # once built, on the worker thread (before it is queued)
        self._wake: asyncio.Event | None = None
        self._over = False
        self.result: Any = None

    def __aiter__(self) -> "AsyncStream":
        return self

    def _submit(self, loop: asyncio.AbstractEventLoop, wake: asyncio.Event) -> Ticket:
        ticket = self._start()
        ticket.listeners.append(lambda: loop.call_soon_threadsafe(wake.set))
        # the awaiting task may be cancelled while this thread runs (asyncio does not stop it):
        # aclose() cancels the planned ticket, or this sees that it came first; the ticket is not queued
        self._planned = ticket
        if self._over:
            ticket.cancelled = True
        return self._queue.submit(ticket)

    async def __anext__(self) -> str:
        if self._over:
            raise StopAsyncIteration
        try:
            if self._ticket is None:
                self._wake = asyncio.Event()
                self._ticket = await asyncio.to_thread(self._submit, asyncio.get_running_loop(), self._wake)
            assert self._wake is not None
            while True:
                try:
                    kind, payload = self._ticket.events.get_nowait()
                except queue.Empty:
                    self._wake.clear()
                    if self._ticket.events.empty():  # nothing slipped in between: sleep until the loop emits
                        await self._wake.wait()
                    continue
                if kind == "text":
                    return payload
                self._over = True
                if kind == "done":
                    self.result = payload
                    raise StopAsyncIteration
                raise payload
        except asyncio.CancelledError:
            await self.aclose()
            raise

    def __del__(self) -> None:
        # dropped unfinished without aclose (a `break` out of `async for` over it): nobody will
        # read it, so its row stops at the next step. No lock here (a collection may run this on
        # any thread, the loop's included, inside its own locked section): the flag alone suffices
        ticket = self._ticket or self._planned
        if not self._over and ticket is not None:
            ticket.cancelled = True

    async def aclose(self) -> None:
        """Stop now: the request's row is let go at the scheduler's next step."""
        if not self._over:
            self._over = True
            ticket = self._ticket or self._planned
            if ticket is not None:
                self._queue.cancel(ticket)


T = TypeVar("T")


async def gather_or_cancel(*awaitables: Awaitable[T]) -> list[T]:
    """Every result, in order, like ``asyncio.gather``; but when one fails, the others are
    cancelled (their rows let go at the next step) and awaited before the error propagates.
    ``asyncio.gather`` leaves them running: a batch with one refused prompt would decode the
    others' whole budgets for nobody."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # a finished task ignores it
        await asyncio.gather(*tasks, return_exceptions=True)
