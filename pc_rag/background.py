"""Documents encoded when the engine has nothing else to do (``add_documents(background=True)``).

A retriever over a user's own vector store meets documents pc-rag has not encoded yet. Encoding
one costs what prefilling it costs, so doing it inside the request that found it would make that
request slower than full prefill. Instead the request reads the document as text, and the document
is queued here: one worker thread encodes it *after* that request (once a request has finished
since it was queued, or after ``grace_s`` with no request at all) and only while no request is
being served, one document at a time, so a request that arrives meanwhile waits for at most one
document's forward pass. The next request that retrieves it imports its KV.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .errors import PromptCacheError
from .prompt.documents import DocumentRecord

logger = logging.getLogger(__name__)

DEFAULT_GRACE_S = 2.0
_queues: weakref.WeakSet[BackgroundEncoder] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At interpreter exit: start nothing new and let a document being encoded finish, so no
    forward pass runs on a daemon thread while the interpreter is torn down."""
    for queue in list(_queues):
        queue.close(timeout=60.0)


@dataclass
class _Job:
    schema: str
    system: str | None
    name: str
    text: str
    metadata: dict[str, Any]
    replace_changed: bool
    options: dict[str, Any]  # add_documents' neighbour context options (context=, neighbours=, ...)
    served: int  # requests the engine had finished when the job was queued
    deadline: float  # ... and when it may start even if no request finishes
    key: tuple[str, str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.key = (self.schema, self.name, hashlib.sha256(self.text.encode()).hexdigest())


class BackgroundEncoder:
    """A queue of documents to add, drained by one daemon thread between requests.

    ``add`` adds records now (the engine's, with a neighbour context when a job asks for one);
    the engine wraps every request in :meth:`serving`, which is how the worker knows when it may run.
    """

    def __init__(self, add: Callable[..., list[str]], *, grace_s: float = DEFAULT_GRACE_S) -> None:
        self._add = add
        self.grace_s = grace_s
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._queued: set[tuple[str, str, str]] = set()  # keys queued or being encoded
        self._failed: set[tuple[str, str, str]] = set()  # keys the registry refused: not tried again
        self._active = 0  # requests being served now
        self._served = 0  # requests finished since start
        self._urgent = False  # join() asked for everything now
        self._running = 0
        self._worker: threading.Thread | None = None
        self._closed = False
        self.encoded = 0  # documents this queue has added
        _queues.add(self)

    # -- requests --------------------------------------------------------------------------------
    @contextmanager
    def serving(self) -> Iterator[None]:
        """Around one request: background work waits while any request is being served."""
        with self._cond:
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._served += 1
                self._cond.notify_all()

    # -- work ------------------------------------------------------------------------------------
    def submit(self, schema: str, system: str | None, records: list[DocumentRecord], *,
               replace_changed: bool = False, options: dict[str, Any] | None = None) -> int:
        """Queue ``records`` for ``schema``; returns how many were queued
        (a record already queued, or refused before, is not queued again). ``replace_changed``
        and ``options`` (a neighbour context) as :meth:`pc_rag.PromptCache.add_documents` takes them."""
        with self._cond:
            if self._closed:
                raise PromptCacheError("this engine's background queue is closed")
            deadline = time.monotonic() + self.grace_s
            queued = 0
            for record in records:
                job = _Job(schema, system, record.name, record.text, dict(record.metadata), replace_changed, dict(options or {}),
                           self._served, deadline)
                if job.key in self._queued or job.key in self._failed:
                    continue
                self._queue.append(job)
                self._queued.add(job.key)
                queued += 1
            if queued and self._worker is None:
                self._worker = threading.Thread(target=self._work, name="pc-rag-background-encode", daemon=True)
                self._worker.start()
            self._cond.notify_all()
        if queued:
            logger.debug("queued %d documents of %r for background encoding", queued, schema)
        return queued

    @property
    def pending(self) -> int:
        """Documents queued or being encoded."""
        with self._cond:
            return len(self._queue) + self._running

    def queued(self, schema: str) -> list[str]:
        """Names of collection ``schema``'s documents queued or being encoded, sorted."""
        with self._cond:
            return sorted({name for queued_schema, name, _ in self._queued if queued_schema == schema})

    def join(self, timeout: float | None = None) -> bool:
        """Encode everything queued now (still never while a request is being served) and wait for
        it; True when the queue is empty, False if ``timeout`` seconds passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._urgent = True
            self._cond.notify_all()
            try:
                while self._queue or self._running:
                    left = None if end is None else end - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
                return True
            finally:
                self._urgent = False

    def close(self, timeout: float | None = None) -> None:
        """Start no more documents (those queued are dropped) and wait up to ``timeout`` seconds
        for the one being encoded."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._closed = True
            dropped = len(self._queue)
            self._queue.clear()
            self._queued.clear()
            self._cond.notify_all()
            while self._running:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
        worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            # the thread ends before the interpreter does (torch's thread state is torn down with it)
            worker.join(None if end is None else max(0.0, end - time.monotonic()))
        if dropped:
            logger.info("%d documents queued for background encoding were dropped at close", dropped)

    def _ready(self, job: _Job) -> float | None:
        """None when ``job`` may start now, else how long to wait at most before asking again."""
        if self._active:
            return 1.0
        if self._urgent or self._served > job.served:
            return None
        left = job.deadline - time.monotonic()
        return None if left <= 0 else left

    def _work(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    wait = self._ready(self._queue[0]) if self._queue else 60.0
                    if wait is None:
                        break
                    self._cond.wait(wait)
                job = self._queue.popleft()
                self._running += 1
            try:
                self._add([DocumentRecord(job.name, job.text, job.metadata)], schema=job.schema, system=job.system,
                          progress=False, replace_changed=job.replace_changed, **job.options)
                self.encoded += 1
            except PromptCacheError as err:
                logger.warning("document %r of %r not encoded in the background: %s", job.name, job.schema, err)
                with self._cond:
                    self._failed.add(job.key)
            except Exception:  # noqa: BLE001 - the worker outlives one bad document; the request it came from was answered
                logger.exception("document %r of %r: background encoding failed", job.name, job.schema)
            finally:
                with self._cond:
                    self._running -= 1
                    self._queued.discard(job.key)
                    self._cond.notify_all()
