"""Who runs the model next: the scheduler's steps or a document being encoded in the background.

Documents queued by ``add_documents(background=True)`` are encoded on a worker thread, but a
forward pass of theirs never runs beside one of the scheduler's: on a CPU the two would share the
same cores and both be slower, and neither would be bounded. So the model is taken in turns:
the scheduler takes one turn per iteration (:meth:`ModelTurns.step`), the worker one per forward
pass (:meth:`ModelTurns.encoding`, entered by :class:`~pc_rag.model.forward.Forward` on the
worker's thread only).

While requests are being served the worker gets ``share`` of the model's time: after a pass of
``d`` seconds the scheduler runs ``d * (1 - share) / share`` seconds of steps before the next
pass may start. So documents reach the cache under steady traffic (a service that is never
idle still warms up), and the requests beside them are slowed by at most that share, one pass
at a time. A pass that a request waits for (``urgent``) does not wait for its share (its cost
is still counted). With nothing to serve the worker runs freely; a request that arrives then
waits for at most the pass in progress.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

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
        self._wanting: list[bool] = []  # background passes waiting for a turn: urgent or not
        self._local = threading.local()  # per thread: inside a background job (and whether urgent)
        self.background_s = 0.0  # seconds of background passes taken while requests were served

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
                    self._debt = 0.0  # an idle model owes nobody
                self._cond.notify_all()

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around one scheduler iteration: it waits for a background pass in progress, and lets one
        that is due go first."""
        with self._cond:
            while self._owner is not None or any(self._due(urgent) for urgent in self._wanting):
                self._cond.wait()
            self._owner = SCHEDULER
        started = time.perf_counter()
        try:
            yield
        finally:
            with self._cond:
                self._owner = None
                self._debt = max(0.0, self._debt - (time.perf_counter() - started))
                self._cond.notify_all()

    # -- the background encoder's side ----------------------------------------------------------------
    @contextmanager
    def background_job(self, *, urgent: bool = False) -> Iterator[None]:
        """Around one background job on the calling thread: its forward passes take turns
        (:meth:`encoding`); ``urgent``: a request waits for it."""
        self._local.job = True
        self._local.urgent = urgent
        try:
            yield
        finally:
            self._local.job = False

    @contextmanager
    def encoding(self) -> Iterator[None]:
        """Around one forward pass of module encoding: a turn on a background job's thread, nothing
        on any other (a request's own encoding runs inside the scheduler's turn)."""
        if not getattr(self._local, "job", False) or getattr(self._local, "depth", 0):
            yield
            return
        urgent = bool(getattr(self._local, "urgent", False))
        with self._cond:
            self._wanting.append(urgent)
            try:
                while self._owner is not None or not self._due(urgent):
                    self._cond.wait()
            finally:
                self._wanting.remove(urgent)
            self._owner = BACKGROUND
            during_service = bool(self._serving)
        self._local.depth = 1
        started = time.perf_counter()
        try:
            yield
        finally:
            self._local.depth = 0
            spent = time.perf_counter() - started
            with self._cond:
                self._owner = None
                if during_service or self._serving:
                    self.background_s += spent
                    self._debt += spent * (1 - self.share) / self.share
                self._cond.notify_all()

    def _due(self, urgent: bool) -> bool:
        """(Under the lock.) Whether a background pass may start now."""
        return urgent or not self._serving or self._debt <= 0
