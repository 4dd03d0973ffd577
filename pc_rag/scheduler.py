"""The scheduler: one thread owns the model and serves every caller at once (continuous batching).

Callers (``generate``, ``stream``, ``generate_batch``, ``next_token_logits``, the LangChain and
LlamaIndex adapters, the server) plan their prompts on their own thread, where a prompt that
cannot be served is refused before it touches anything shared, and submit a
:class:`~pc_rag.callers.Ticket`; they read its events (:mod:`pc_rag.callers`). The loop, every
iteration, calls into the room that owns each step (docs/architecture.md walks one request through them):

1. let go of rows whose caller went away (a closed stream, a cancelled task);
2. admit: the policy (:mod:`pc_rag.admission`) chooses waiting tickets while rows, the step's
   prefill budget and the KV buffers' memory budget (:mod:`pc_rag.kv.budget`) allow; they are
   prefilled together in one pass, reading shared what the running rows hold, or one newcomer in
   chunks of the step budget, each riding on the running rows' decode step (step 5);
3. merge the prefilled rows into the running batch (:mod:`pc_rag.decode.layout`: in place where
   they fit, else rebuilt with every row's live entries packed), or rebuild a half-finished batch;
4. take every row's next token and hand each caller its text; a finished row's caller gets its
   result at once (:func:`pc_rag.callers.hand_out`), and its slot is free for the next admission;
5. feed: one decode step for every row still going, with a newcomer's next prefill chunk in the
   same forward pass (:mod:`pc_rag.forward.packed`).

Models whose attention cannot take per-row masks (ALiBi, learned positions, flash/flex
attention) are served one request at a time by the same loop. A row whose processors, grammar,
sampler or detokeniser raise fails its own request and no other; a prefill that raises fails its
request (a batched one is retried one by one); a forward pass that raises fails the requests of
that step and nothing else. The loop lives on.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from . import forks
from .admission import AdmissionPolicy, FirstComeFirstServed, Limits, Room, cancel_waiting, in_chunks, rebuild_without_finished
from .callers import RequestStatus, Ticket, hand_out
from .decode import layout
from .decode.layout import VacantRow, reserved_rows, vacant_rows
from .decode.loop import RunningBatch
from .decode.request import RequestState
from .errors import PromptCacheError, QueueFull, ServingFailed
from .kv.budget import BufferBudget
from .kv.buffers import BufferPool
from .model.spec import ModelSpec
from .prefill.chunked import ChunkedPrefill
from .prefill.rows import Prefilled
from .prompt.plan import Plan

logger = logging.getLogger(__name__)

IDLE_EXIT_S = 2.0  # the loop thread ends after this long with nothing to do


@dataclass
class SchedulerStats:
    """What the loop has done (read them through :meth:`Scheduler.stats`)."""

    steps: int = 0  # decode steps
    admitted: int = 0  # requests (rows) admitted
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    refused: int = 0  # submissions refused for a full queue or a budget they alone exceed
    chunks: int = 0  # prefill chunks of newcomers prefilled one chunk per iteration
    fused: int = 0  # of those, chunks that shared a forward pass with the running rows' decode step
    merges: int = 0  # running batches rebuilt to take rows in or let rows go
    in_place: int = 0  # admissions written into the running batch's finished or reserved rows (no rebuild)
    promoted: int = 0  # running rows that stopped reading their copy of a module to share newcomers' part
    step_rows: deque[int] = field(default_factory=lambda: deque(maxlen=64))  # rows of the last decode steps


def _owner(request: RequestState) -> Ticket:
    """The ticket ``request`` is a row of."""
    assert request.owner is not None
    return request.owner[0]


_OPEN: "weakref.WeakSet[Scheduler]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At exit, every loop thread ends before the interpreter tears down (a daemon thread caught
    inside torch at finalisation aborts the process: "terminate called without an active exception")."""
    for scheduler in list(_OPEN):
        scheduler.close(timeout=5.0)


class Scheduler:
    """Owns the model: every forward pass of a request runs on its loop thread (started on first use)."""

    def __init__(self, *, spec: ModelSpec, buffers: BufferPool, kv_bytes_per_token: int, limits: Limits,
                 prefill: Callable[[list[Plan], int, bool, bool, Any], Prefilled],
                 assemble: Callable[[list[Plan], int, bool, bool, Any], tuple[Any, float] | None],
                 serving: Callable[[], Any], observe_prefill: Callable[[int, float], None], forward: Any,
                 policy: AdmissionPolicy | None = None) -> None:
        self.spec, self.buffers, self.limits = spec, buffers, limits
        self.budget = BufferBudget(buffers, kv_bytes_per_token, limits.buffer_budget, self._vacant)
        self._prefill, self._assemble, self._serving, self._observe = prefill, assemble, serving, observe_prefill
        self.forward = forward
        self._cond = threading.Condition()
        self.policy: AdmissionPolicy = FirstComeFirstServed() if policy is None else policy  # the waiting tickets
        self._awaiting_room = 0  # submissions waiting for room in a full queue (queue_timeout_s)
        self._batch: RunningBatch | None = None
        self._chunked: ChunkedPrefill | None = None  # a newcomer prefilled a chunk per iteration
        self._newcomer: Ticket | None = None  # its ticket
        self._tickets: dict[int, Ticket] = {}  # every submission held, by id, until its status is final
        self._thread: threading.Thread | None = None
        self._closed, self._stats = False, SchedulerStats()
        _OPEN.add(self)
        forks.after_fork_in_child(self._after_fork)

    # -- the callers' side ------------------------------------------------------------------------
    def submit(self, ticket: Ticket) -> Ticket:
        """Queue ``ticket`` for admission; raises :class:`QueueFull` when ``max_queued`` tickets
        wait (after ``queue_timeout_s`` for room, when set), and refuses a ticket that alone
        would exceed the buffer budget."""
        needed = self.budget.needs(ticket.rows, ticket.entries)
        budget = self.limits.buffer_budget
        if budget is not None and needed > budget:
            with self._cond:
                self._stats.refused += 1
            raise PromptCacheError(f"this request needs {needed:,} bytes of KV buffers, more than the scheduler's "
                                   f"buffer_budget of {budget:,}: shorten the prompt or max_new_tokens, or raise the budget")
        with self._cond:
            if self._closed:
                raise ServingFailed("this engine's scheduler is closed", unavailable=True)
            deadline = None if self.limits.queue_timeout_s is None else time.monotonic() + self.limits.queue_timeout_s
            while len(self.policy) >= self.limits.max_queued and not ticket.cancelled:
                left = 0.0 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    self._stats.refused += 1
                    raise QueueFull(f"the request queue is full ({self.limits.max_queued} requests waiting: max_queued); "
                                    "retry later" + ("" if deadline is None else f" (waited {self.limits.queue_timeout_s} s)"))
                self._awaiting_room += 1
                try:
                    self._cond.wait(left)
                finally:
                    self._awaiting_room -= 1
            if ticket.cancelled:  # its caller left while it was planned or waited for room: it never takes a place
                self._stats.cancelled += 1
                raise PromptCacheError("the request was cancelled before it was queued")
            self.policy.add(ticket)
            self._tickets[ticket.id] = ticket
            self._start()
            self._cond.notify_all()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The caller went away: its rows stop at the next step, or it leaves the queue."""
        with self._cond:
            ticket.cancelled = True
            self._cond.notify_all()

    def stats(self) -> dict[str, Any]:
        """Queue depth (and submissions waiting for room in it), running rows and counters (a snapshot)."""
        with self._cond:
            s = self._stats
            return {"queued": len(self.policy), "awaiting_room": self._awaiting_room, "running": self.running, "steps": s.steps, "admitted": s.admitted,
                    "finished": s.finished, "cancelled": s.cancelled, "failed": s.failed, "refused": s.refused,
                    "chunks": s.chunks, "fused": s.fused, "merges": s.merges, "in_place": s.in_place, "promoted": s.promoted, "buffer_bytes_peak": self.budget.peak,
                    "buffer_bytes": self.budget.held_bytes(idle=False), "buffer_bytes_idle": self.buffers.idle_bytes}

    @property
    def running(self) -> int:
        """Rows decoding now (not finished, not cancelled), and a long prompt being prefilled."""
        batch = self._batch
        live = 0 if batch is None else sum(1 for request in batch.requests if not request.done)
        newcomer = self._newcomer
        return live + (newcomer.rows if newcomer is not None else 0)

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop the loop once what it holds is served; later submissions are refused."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _after_fork(self) -> None:
        """In a forked child (:mod:`pc_rag.forks`): the parent's rows and tickets are not served; a loop starts on demand."""
        self._cond, self._thread, self._tickets, self._awaiting_room = threading.Condition(), None, {}, 0
        cancel_waiting(self.policy)
        self._batch = self._chunked = self._newcomer = None  # their buffers are the child's copies: not held
        self.budget.let_go_of_all()

    # -- the loop ----------------------------------------------------------------------------
    def _start(self) -> None:
        """(Under the lock.) A loop thread, unless one is running."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="pc-rag-scheduler", daemon=True)
            self._thread.start()

    def _busy(self) -> bool:
        return bool(len(self.policy)) or self._batch is not None or self._chunked is not None

    def _loop(self) -> None:
        with ExitStack() as serving:
            held = False  # inside the background encoder's serving(): documents wait while requests are served
            while True:
                with self._cond:
                    self._forget_ended()
                    if not self._busy():
                        serving.close()  # background encoding may run while nothing is served
                        held = False
                        if not self._closed:
                            self._cond.wait(IDLE_EXIT_S)
                        if not self._busy():
                            # idle: the thread ends (the next submission starts one), so an engine
                            # nobody uses any more is not kept alive by its loop
                            self._thread = None
                            return
                    if not held:
                        serving.enter_context(self._serving())
                        held = True
                try:
                    with self.forward.turns.step():  # a background encoding's pass may go first (pc_rag.forward.turns)
                        self._iteration()
                except Exception as err:  # noqa: BLE001 - the loop outlives any request's failure
                    logger.exception("scheduler step failed; failing the requests it was serving")
                    self._fail_running(err)

    def _forget_ended(self) -> None:
        """(Under the lock.) Tickets whose status is final leave the scheduler's table."""
        for key in [key for key, ticket in self._tickets.items() if ticket.closed]:
            del self._tickets[key]

    def _iteration(self) -> None:
        """Let go, admit, merge, take and hand out, feed."""
        self._let_go_of_cancelled()
        fresh = self._admit()
        if fresh is not None:
            self._merge(fresh)
        elif self._rebuild_due():
            self._merge(None)  # half the rows feed placeholders: rebuild without them
        batch = self._batch
        if batch is None:
            return
        deltas = batch.take()
        if batch.finished:
            # the buffer goes back before the callers hear they are done; the batch stays until
            # they have heard (a hand-out that raises fails them: _fail_running)
            self.budget.release(batch.rows.buffer)
        finished, failed = hand_out(batch, deltas)
        self._count(finished=finished, failed=failed)
        if batch.finished:
            self._batch = None
            return
        self._feed(batch)
        with self._cond:
            self._stats.steps += 1
            self._stats.step_rows.append(batch.batch)

    # -- admission ---------------------------------------------------------------------------
    def _admit(self) -> RunningBatch | None:
        """Prefill what may start now: a chunk of a long prompt in progress, or the next tickets."""
        if self._chunked is not None:
            return self._next_chunk()
        cohort = self._choose()
        if not cohort:
            return None
        now = time.perf_counter()
        for ticket in cohort:
            for request in ticket.requests:
                request.stats.queue_s = now - ticket.submitted
                request.prefill_started = now
        plans = [plan for ticket in cohort for plan in ticket.plans]
        requests = [request for ticket in cohort for request in ticket.requests]
        first = cohort[0]
        answer_tokens = max(request.budget for request in requests)
        # what the running rows already hold (shared parts, copied modules): the newcomers read it shared
        held = layout.held(self._batch) if self._batch is not None and first.share and first.use_cache and not first.logits_only else {}
        # one request while others decode: prefilled in chunks of the step budget, each sharing a
        # forward pass with the running rows' decode step where it can (else between steps)
        if in_chunks(cohort, self.limits, running=self._batch is not None, fusable=self._fusable()):
            try:
                plain = self._assemble(plans, answer_tokens, first.use_cache, first.share, held)
            except Exception as err:  # noqa: BLE001
                self._fail_cohort(cohort, err)
                return None
            if plain is not None:  # the plain path (no scored recovery): chunks of the budget
                first.status = RequestStatus.PREFILLING
                self._chunked, self._newcomer = ChunkedPrefill.of(*plain, self.limits.max_step_tokens), first
                self.budget.hold(self._chunked.buffer, pooled=True)  # one row: the pool's
                return self._next_chunk()
        try:
            prefilled = self._prefill(plans, answer_tokens, first.use_cache, first.share and (len(plans) > 1 or bool(held)), held)
        except Exception as err:  # noqa: BLE001
            self._fail_cohort(cohort, err)
            return None
        return self._prefilled(prefilled, requests)

    def _fusable(self) -> bool:
        """Whether a newcomer's chunk may share a forward pass with the running rows' decode step: split attention
        (the packed pass's routing lives there) over fixed shapes, not compiled, not the C step (faster after the chunk)."""
        batch = self._batch
        return (self.limits.fuse_prefill and batch is not None and self.spec.split and batch.cursor.fixed
                and not self.forward.compiled and not self.forward.decodes_in_c)

    def _next_chunk(self) -> RunningBatch | None:
        """The newcomer in chunks: its next chunk alone when no decode step can take it, or its
        prefilled row once the last chunk is done."""
        chunked, ticket = self._chunked, self._newcomer
        assert chunked is not None and ticket is not None
        if ticket.cancelled:
            self._drop_chunked()
            self._cancelled(ticket)
            return None
        if not chunked.done:
            if self._fusable():
                return None  # its next chunk rides on this iteration's decode step (_feed)
            try:
                chunked.prefill_next(self.forward, self.spec)
            except Exception as err:  # noqa: BLE001
                self._fail_chunked(err)
                return None
            self._count_chunk(fused=False)
            if not chunked.done:
                return None
        self._chunked = self._newcomer = None
        return self._prefilled(chunked.prefilled(), ticket.requests)

    def _count_chunk(self, *, fused: bool) -> None:
        with self._cond:
            self._stats.chunks += 1
            self._stats.fused += int(fused)

    def _drop_chunked(self) -> None:
        assert self._chunked is not None
        self.budget.release(self._chunked.buffer)
        self._chunked = self._newcomer = None

    def _fail_chunked(self, err: Exception) -> None:
        ticket = self._newcomer
        assert ticket is not None
        self._drop_chunked()
        self._fail_cohort([ticket], err)

    def _feed(self, batch: RunningBatch) -> None:
        """The running rows' decode step, with a newcomer's next chunk in the same forward pass
        where one is waiting for it."""
        chunked, ticket = self._chunked, self._newcomer
        if chunked is None or ticket is None or chunked.done or ticket.cancelled or not self._fusable():
            batch.feed()
            return
        try:
            logits = batch.feed(alongside=chunked.next_tokens(self.spec))
        except Exception as err:  # noqa: BLE001
            # the newcomer's chunk fails it alone: the running rows take their step without it
            logger.warning("a decode step with a newcomer's prefill chunk failed (%s); stepping without it", err)
            self._fail_chunked(err)
            batch.feed()
            return
        assert logits is not None
        chunked.took(logits)
        self._count_chunk(fused=True)

    def _prefilled(self, prefilled: Prefilled, requests: list[RequestState]) -> RunningBatch | None:
        rows, order = prefilled.rows, prefilled.order
        self.budget.hold(rows.buffer, pooled=rows.batch == 1)  # one row: the pool's
        # the prefill rate the load-or-compute choice weighs fetches against (pc_rag.kv.load_or_compute)
        self._observe(sum(requests[i].stats.computed_tokens for i in order), time.perf_counter() - prefilled.assembled_at)
        requests = [requests[i] for i in order]
        for request, recomputed in zip(requests, prefilled.recomputed or [0] * len(requests)):
            request.stats.assemble_s = prefilled.assembled_at - request.started
            request.stats.cached_tokens -= recomputed
            request.stats.computed_tokens += recomputed
        ticket = _owner(requests[0])
        if ticket.logits_only:
            self.budget.release(rows.buffer)
            ticket.finish(RequestStatus.FINISHED, prefilled.logits[0])
            self._count(finished=1)
            return None
        for request in requests:
            _owner(request).status = RequestStatus.RUNNING
        return RunningBatch(self.forward, rows, requests, prefilled.logits, self.spec)

    def _choose(self) -> list[Ticket]:
        """The next tickets to admit, as the admission policy chooses them."""
        with self._cond:
            for ticket in self.policy.drop_cancelled():
                self._cancelled(ticket)
            room = Room(running=self.running, max_running=self.limits.max_running, max_step_tokens=self.limits.max_step_tokens,
                        one_pass=self.spec.one_pass, fits=self._fits)
            cohort = self.policy.choose(room)
            for ticket in cohort:
                ticket.status = RequestStatus.ADMITTING
            self._stats.admitted += sum(t.rows for t in cohort)
            if cohort:
                self._cond.notify_all()  # room in the queue
            return cohort

    # -- memory ------------------------------------------------------------------------------
    def _fits(self, cohort: list[Ticket]) -> bool:
        """Whether admitting ``cohort`` keeps the buffers within the budget: its own and (both
        held while it is built) the batch it is merged into."""
        if self.budget.limit is None:
            return True
        requests = [(len(p.input_ids), r) for t in cohort for p, r in zip(t.plans, t.requests)]
        merged = None if self._batch is None else layout.merged_shape(self._batch, requests)
        return self.budget.admits(len(requests), max(t.entries for t in cohort), merged)

    def _rebuild_due(self) -> bool:
        """Whether the running batch is rebuilt without its finished rows now (the rule:
        :func:`pc_rag.admission.rebuild_without_finished`), its rebuilt size fitting the budget."""
        batch = self._batch
        if batch is None:
            return False
        # finished rows (not vacant ones: counting those, a compiled batch padded to 16 rows for 9
        # would rebuild to 8 when one row finished, and back to 16 for the next newcomer)
        dead = sum(1 for request in batch.requests if request.done and not isinstance(request, VacantRow))
        return (rebuild_without_finished(dead, batch.batch, layout.steps_left(batch), chunking=self._chunked is not None)
                and self.budget.rebuild_fits(*layout.merged_shape(batch, [])))

    def _vacant(self, rows: int) -> int:
        return vacant_rows(self.forward.compiled, self.limits.max_running, rows)

    # -- the running batch -------------------------------------------------------------------
    def _merge(self, fresh: RunningBatch | None) -> None:
        """``fresh``'s rows into the running batch, or (None) the batch rebuilt without its
        finished rows (:func:`pc_rag.decode.layout.merge`); the budget holds what it allocated."""
        reserve = partial(reserved_rows, self.spec.device, self.forward.compiled, self.limits.max_running)
        merged = layout.merge(self._batch, fresh, reserve=reserve, vacant=self._vacant)
        if merged.made is not None:
            self.budget.hold(merged.made)  # the peak counts it beside the buffers it replaces
        for buffer in merged.dropped:
            self.budget.release(buffer)
        self.budget.track()  # an in-place admission may have widened the buffer into its reserve
        self._batch = merged.batch
        with self._cond:
            self._stats.promoted += merged.promoted
            self._stats.in_place += int(merged.how == "in place")
            self._stats.merges += int(merged.how == "rebuilt")

    def _let_go_of_cancelled(self) -> None:
        """Rows whose caller went away, or whose ticket failed in another of its rows, stop now
        (they feed placeholders until the next rebuild)."""
        batch = self._batch
        if batch is None:
            return
        for row, request in enumerate(batch.requests):
            owner = request.owner
            if owner is None:
                continue
            ticket, _ = owner
            if (ticket.cancelled or ticket.closed) and not request.done:
                request.done = True
                if not ticket.closed:
                    self._cancelled(ticket)

    # -- endings -----------------------------------------------------------------------------
    def _count(self, *, finished: int = 0, failed: int = 0) -> None:
        if finished or failed:
            with self._cond:
                self._stats.finished += finished
                self._stats.failed += failed

    def _cancelled(self, ticket: Ticket) -> None:
        with self._cond:
            self._stats.cancelled += 1
        ticket.finish(RequestStatus.CANCELLED, PromptCacheError("the request was cancelled"))

    def _fail_cohort(self, cohort: Sequence[Ticket], err: Exception) -> None:
        """A prefill failed: with several tickets, each is tried again alone, so only the one that
        fails is failed; a lone ticket gets the error."""
        if len(cohort) > 1:
            logger.warning("a batched prefill failed (%s); admitting its %d requests one by one", err, len(cohort))
            with self._cond:
                self.policy.retry_first(cohort)
                for ticket in cohort:
                    ticket.alone, ticket.status = True, RequestStatus.WAITING
            return
        self._count(failed=cohort[0].rows)
        cohort[0].finish(RequestStatus.FAILED, err)

    def _fail_running(self, err: Exception) -> None:
        """A step raised outside any one row: the requests it was serving fail, and the running
        state is dropped first, whatever fails after, so the next step starts clean (a state left
        half dropped would fail every step after it, or end the loop with callers waiting)."""
        serving = (RequestStatus.ADMITTING, RequestStatus.PREFILLING, RequestStatus.RUNNING)
        with self._cond:
            tickets = [t for t in self._tickets.values() if t.status in serving]
        self._batch, self._chunked, self._newcomer = None, None, None
        for buffer in self.budget.held():  # the batch's, a chunked newcomer's, a merge's half built
            try:
                self.budget.release(buffer)
            except Exception:  # noqa: BLE001 - a buffer the pool cannot take back is left to the collector
                logger.exception("a failed step's KV buffer could not go back to the pool; dropping it")
        self._count(failed=sum(t.rows for t in tickets))
        for ticket in tickets:
            ticket.finish(RequestStatus.FAILED, ServingFailed(f"the step serving this request failed: {err}"))
