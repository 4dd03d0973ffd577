"""Admission: which waiting requests start, how a newcomer is prefilled, when a batch is rebuilt.

The scheduler asks; nothing here runs the model or counts bytes (the memory budget answers
"does it fit", :mod:`pc_rag.kv.budget`):

- :class:`Limits`: what the scheduler holds at once, and how it admits (the engine's options).
- :class:`AdmissionPolicy`: the waiting requests and the order they start in.
  :class:`FirstComeFirstServed` is the policy; a priority or per-tenant fair policy is one more
  class beside it, passed to the scheduler as ``policy``.
- :func:`in_chunks`: the chunk-or-batch rule (a request admitted alone while others decode is
  prefilled in chunks of the step budget, each riding on the running rows' decode step).
- :func:`rebuild_without_finished`: when a half-finished batch is rebuilt without its finished rows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from .callers import Ticket
from .errors import PromptCacheError

DEFAULT_MAX_RUNNING = 16
DEFAULT_MAX_STEP_TOKENS = 512
DEFAULT_MAX_QUEUED = 256
# a batch whose finished rows are half of it is rebuilt without them only when its rows may run
# this many steps more: the rebuild copies the live rows' KV into a new buffer (measured on the
# 2-core CPU: 0.11 s for 4 rows of ~1K entries), a step saves about a finished row's reads each
# (~50 ms there), so it pays back from the third step on and never for a row's last step or two
COMPACTION_MIN_STEPS = 4


@dataclass(frozen=True)
class Limits:
    """What the scheduler holds at once, and how it admits.

    ``max_running``: rows decoding together (a ``generate_batch`` larger than this runs alone).
    ``max_step_tokens``: tokens prefilled per iteration while other rows decode.
    ``max_queued``: requests waiting for admission; past it a submission raises :class:`QueueFull`
    at once, or after waiting ``queue_timeout_s`` for room when that is set.
    ``buffer_budget``: bytes of KV buffers (running rows, rows being admitted, a merge's new
    buffer) held at once; admission waits while a request would exceed it, and a request that
    alone exceeds it is refused at submission. None: no bound.
    ``fuse_prefill``: a request admitted while others decode is prefilled in chunks of
    ``max_step_tokens`` that share a forward pass with the running rows' decode step (the step
    rides on the chunk's weight reads) where that step runs as tensor ops; where it runs in C
    (``Forward.decodes_in_c``) the chunk runs first, then the step: measured faster (docs/performance.md);
    False: its prefill runs between steps.
    """

    max_running: int = DEFAULT_MAX_RUNNING
    max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS
    max_queued: int = DEFAULT_MAX_QUEUED
    queue_timeout_s: float | None = None
    buffer_budget: int | None = None
    fuse_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_running", "max_step_tokens", "max_queued"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PromptCacheError(f"{name} must be an int >= 1, got {value!r}")
        if self.queue_timeout_s is not None and not (isinstance(self.queue_timeout_s, (int, float)) and self.queue_timeout_s >= 0):
            raise PromptCacheError(f"queue_timeout_s must be a number of seconds >= 0 or None, got {self.queue_timeout_s!r}")
        if self.buffer_budget is not None and (isinstance(self.buffer_budget, bool) or not isinstance(self.buffer_budget, int)
                                               or self.buffer_budget < 1):
            raise PromptCacheError(f"buffer_budget must be a number of bytes >= 1 or None, got {self.buffer_budget!r}")
        if not isinstance(self.fuse_prefill, bool):
            raise PromptCacheError(f"fuse_prefill must be True or False, got {self.fuse_prefill!r}")


@dataclass(frozen=True)
class Room:
    """What the scheduler has room for now, as a policy sees it."""

    running: int  # rows decoding, and a long prompt's row being prefilled
    max_running: int
    max_step_tokens: int
    one_pass: bool  # the model's attention takes several requests in one pass (else one at a time)
    fits: Callable[[list[Ticket]], bool]  # the memory budget's answer for a cohort


class AdmissionPolicy(Protocol):
    """The waiting requests, and which of them start next. Called under the scheduler's lock."""

    def add(self, ticket: Ticket) -> None:
        """``ticket`` waits."""

    def retry_first(self, tickets: Iterable[Ticket]) -> None:
        """``tickets`` (taken by :meth:`choose`, their prefill failed in company) wait again, to start first."""

    def drop_cancelled(self) -> list[Ticket]:
        """Cancelled tickets at the head of the queue, taken out (the scheduler tells their callers)."""

    def choose(self, room: Room) -> list[Ticket]:
        """The tickets to prefill together now, taken out of the queue (none: nothing may start)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Ticket]: ...


def cancel_waiting(policy: AdmissionPolicy) -> None:
    """Every ticket waiting in ``policy`` cancelled and dropped (a forked child's copies of its parent's)."""
    for ticket in list(policy):
        ticket.cancelled = True
    policy.drop_cancelled()


class FirstComeFirstServed:
    """In order of submission; a ticket that does not fit stops the choice, so a long prompt is
    never passed over by a stream of short ones."""

    def __init__(self) -> None:
        self._waiting: deque[Ticket] = deque()

    def add(self, ticket: Ticket) -> None:
        self._waiting.append(ticket)

    def retry_first(self, tickets: Iterable[Ticket]) -> None:
        self._waiting.extendleft(reversed(list(tickets)))

    def drop_cancelled(self) -> list[Ticket]:
        dropped = []
        while self._waiting and self._waiting[0].cancelled:
            dropped.append(self._waiting.popleft())
        return dropped

    def choose(self, room: Room) -> list[Ticket]:
        cohort: list[Ticket] = []
        rows = tokens = 0
        for ticket in self._waiting:
            if not _joins(cohort, ticket, room, rows, tokens):
                break
            cohort.append(ticket)
            rows += ticket.rows
            tokens += ticket.tokens
        for _ in cohort:
            self._waiting.popleft()
        return cohort

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Ticket]:
        return iter(self._waiting)


def _joins(cohort: list[Ticket], ticket: Ticket, room: Room, rows: int, tokens: int) -> bool:
    """Whether ``ticket`` may be prefilled with ``cohort`` (of ``rows`` rows and ``tokens``
    computed tokens so far) beside the running rows."""
    if ticket.cancelled:
        return False
    if cohort and ((ticket.use_cache, ticket.share) != (cohort[0].use_cache, cohort[0].share)
                   or ticket.alone or cohort[0].alone):
        return False
    alone = not cohort and room.running == 0
    if not room.one_pass and (room.running or cohort or ticket.rows > 1):
        return False  # attention that reads cache order: one request at a time
    if not alone and room.running + rows + ticket.rows > room.max_running:
        return False
    if cohort and tokens + ticket.tokens > room.max_step_tokens:
        return False
    # a lone ticket fits (checked at submission); for it too idle pool buffers in its way go
    return room.fits(cohort + [ticket]) or alone


def in_chunks(cohort: list[Ticket], limits: Limits, *, running: bool, fusable: bool) -> bool:
    """Whether ``cohort`` is prefilled in chunks of the step budget rather than in one pass: one
    request of one row, while others decode, that is longer than the budget or whose chunks can
    ride on the decode step (``fusable``)."""
    first = cohort[0]
    return (len(cohort) == 1 and first.rows == 1 and running and not first.logits_only
            and (first.tokens > limits.max_step_tokens or fusable))


def rebuild_without_finished(finished: int, rows: int, steps_left: int, *, chunking: bool) -> bool:
    """Whether a batch of ``rows`` rows, ``finished`` of them finished, is rebuilt without them:
    when they are half of it, its rows may run :data:`COMPACTION_MIN_STEPS` more steps, and no
    newcomer is being prefilled in chunks (it will take a finished row's slot)."""
    return bool(finished) and 2 * finished >= rows and not chunking and steps_left >= COMPACTION_MIN_STEPS
