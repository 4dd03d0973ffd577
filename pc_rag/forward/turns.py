"""Who runs the model next: the scheduler's steps or a document being encoded in the background.

Documents queued by ``add_documents(background=True)`` are encoded on a worker thread, but never
beside one of the scheduler's steps: on a CPU the two would share the same cores and both be
slower, and neither would be bounded. So the model is taken in turns: the scheduler takes one
turn per iteration (:meth:`ModelTurns.step`), the worker one per document (:meth:`ModelTurns.background`).

While requests are being served the worker gets ``share`` of the model's time: after a document
of ``d`` seconds the scheduler runs ``d * (1 - share) / share`` seconds of steps before the next
may start. So documents reach the cache under steady traffic (a service that is never idle still
warms up), and the requests beside them are slowed by at most that share, one document at a
time. A document that a request waits for (``urgent``) does not wait for its share (its cost is
still counted). With nothing to serve the worker runs freely; a request that arrives then waits
for at most the document in progress.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .. import forks
from ..errors import PromptCacheError

DEFAULT_ENCODE_SHARE = 0.25
SCHEDULER, BACKGROUND = "scheduler", "background"


class ModelTurns:
    """The model's turns between the scheduler and the background encoder (see the module docstring)."""

    def __init__(self, share: float = DEFAULT_ENCODE_SHARE) -> None:
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise PromptCacheError(f"encode_share must be a fraction in (0, 1], got {share!r}", param="encode_share")
        self.share = float(share)
        self._cond = threading.Condition()
        self._owner: str | None = None
        self._serving = 0  # scheduler busy periods in progress (0 or 1)
        self._debt = 0.0  # seconds of steps the scheduler runs before the next background pass may start
        # ... and, after those, before the next pass of a job nobody added (a learned passage): such
        # jobs use the share callers' documents leave, never delay them (pc_rag.prompt.recurring)
        self._behind_debt = 0.0
        self._wanting: list[tuple[bool, bool]] = []  # background jobs waiting for a turn: (urgent, behind)
        self.background_s = 0.0  # seconds of background jobs run while requests were served
        forks.after_fork_in_child(self._after_fork)

    def _after_fork(self) -> None:
        """In a forked child (:mod:`pc_rag.forks`): nobody holds the model there, nobody waits for it."""
        self._cond = threading.Condition()
        self._owner, self._serving, self._debt, self._behind_debt, self._wanting = None, 0, 0.0, 0.0, []

    # -- the scheduler's side ---------------------------------------------------------------------
    @contextmanager
    def serving(self) -> Iterator[None]:
        """Around a period in which the scheduler has requests: background passes take their share."""
        with self._cond:
            self._serving += 1
        try:
            yield
        finally:
            with self._cond:
                self._serving -= 1
                if not self._serving:
                    self._debt = self._behind_debt = 0.0  # an idle model owes nobody
                self._cond.notify_all()

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around one scheduler iteration: it waits for a background pass in progress, and lets one
        that is due go first."""
        with self._cond:
            while self._owner is not None or any(self._due(*wanting) for wanting in self._wanting):
                self._cond.wait()
            self._owner = SCHEDULER
        started = time.perf_counter()
        try:
            yield
        finally:
            with self._cond:
                self._owner = None
                paid = time.perf_counter() - started
                self._behind_debt = max(0.0, self._behind_debt - max(0.0, paid - self._debt))
                self._debt = max(0.0, self._debt - paid)
                self._cond.notify_all()

    # -- the background encoder's side ----------------------------------------------------------------
    @contextmanager
    def background(self, *, urgent: bool = False, behind: bool = False) -> Iterator[None]:
        """Around one background job (a document's encoding, its writes to the store tiers
        included): it waits for its turn (``urgent``: a request waits for it, so it does not wait
        for its share; ``behind``: nobody added it, so it waits for the share callers' documents
        have used to be worked off too, and what it takes never delays theirs). The turn is taken before the job takes any lock, and held for the whole
        job: a job that waited for a turn while holding the encoder's lock would deadlock with a
        scheduler step that needs that lock (a module evicted from memory, encoded again)."""
        with self._cond:
            self._wanting.append((urgent, behind))
            try:
                while self._owner is not None or not self._due(urgent, behind):
                    self._cond.wait()
            finally:
                self._wanting.remove((urgent, behind))
            self._owner = BACKGROUND
            during_service = bool(self._serving)
        started = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - started
            with self._cond:
                self._owner = None
                if during_service or self._serving:
                    self.background_s += spent
                    owed = spent * (1 - self.share) / self.share
                    if behind:
                        self._behind_debt += owed
                    else:
                        self._debt += owed
                self._cond.notify_all()

    def may_start(self, *, behind: bool = False) -> bool:
        """Whether a background pass's share allows it to start now (it may still wait for a step
        in progress): the background encoder asks before it commits to a job nobody added."""
        with self._cond:
            return self._due(False, behind)

    def _due(self, urgent: bool, behind: bool = False) -> bool:
        """(Under the lock.) Whether a background pass may start now."""
        return urgent or not self._serving or (self._debt <= 0 and (not behind or self._behind_debt <= 0))
