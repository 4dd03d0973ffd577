"""Documents encoded beside the requests being served (``add_documents(background=True)``).

A retriever over a user's own vector store meets documents pc-rag has not encoded yet. Encoding
one costs what prefilling it costs, so doing it inside the request that found it would make that
request slower than full prefill. Instead the request reads the document as text, and the document
is queued here: one worker thread encodes it *after* that request (once a request has finished
since it was queued, or after ``grace_s``), one document at a time, in turns with the scheduler's
steps (:mod:`pc_rag.forward.turns`): all the model's time when nothing is served, a share of it
while requests run, so a service that is never idle still warms its cache,
and a request beside it is slowed by at most that share. The next request that retrieves the
document imports its KV.

Each document has a status, as OpenAI's vector-store files do: ``queued``, ``in_progress``,
``encoded`` (in the registry, not held here) or ``failed`` with its ``last_error``. A document
a request waits for moves to the front (:meth:`BackgroundEncoder.prioritise`); a document
deleted while queued leaves the queue at once (:meth:`BackgroundEncoder.remove`), and one deleted
while being encoded is deleted again as soon as its encoding ends.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from . import forks
from .errors import PromptCacheError
from .forward.turns import ModelTurns
from .prompt.documents import DocumentRecord

logger = logging.getLogger(__name__)

DEFAULT_GRACE_S = 2.0
BEHIND_POLL_S = 0.05  # how often a job nobody added asks whether its share allows it to start
QUEUED, IN_PROGRESS, FAILED = "queued", "in_progress", "failed"
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
    urgent: bool = False  # a request waits for it: first in the queue, and its passes do not wait for their share
    deleted: bool = False  # deleted while being encoded: deleted again once its encoding ends
    shared: bool = False  # recorded in the remote tier's shared queue (where another replica may delete it)
    behind: bool = False  # no caller added it (a learned passage): encoded only when no other job is queued
    key: tuple[str, str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.key = (self.schema, self.name, hashlib.sha256(self.text.encode()).hexdigest())


@dataclass(frozen=True)
class DocumentStatus:
    """A document this queue holds: ``queued``, ``in_progress`` or ``failed`` (with ``last_error``)."""

    status: str
    last_error: str | None = None
    code: str | None = None  # OpenAI's last_error code: "invalid_file" (refused: retrying will not help) or "server_error"


class BackgroundEncoder:
    """A queue of documents to add, drained by one daemon thread in turns with the scheduler.

    ``add`` adds records now (the engine's, with a neighbour context when a job asks for one);
    ``delete`` deletes documents by name (a document deleted while it was being encoded);
    ``turns`` shares the model with the scheduler. The engine wraps every period in which it
    serves requests in :meth:`serving`, which is how the worker knows that a request finished.
    """

    def __init__(self, add: Callable[..., list[str]], *, delete: Callable[..., Any] | None = None,
                 turns: ModelTurns | None = None, remote: Any = None, grace_s: float = DEFAULT_GRACE_S) -> None:
        self._add, self._delete = add, delete
        # the remote tier's shared queue (pc_rag.kv.replication): every replica lists and deletes what this one queued
        self._shared = remote.log if remote is not None else None
        self.turns = turns if turns is not None else ModelTurns()
        self.grace_s = grace_s
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._queued: set[tuple[str, str, str]] = set()  # keys queued or being encoded
        self._refused: set[tuple[str, str, str]] = set()  # keys the registry refused: not tried again
        self._failed: dict[tuple[str, str], DocumentStatus] = {}  # (schema, name) -> why its last encoding failed
        self._current: _Job | None = None  # the job being encoded
        self._served = 0  # serving periods ended since start
        self._urgent = False  # join() asked for everything now
        self._listeners: list[Callable[[], None]] = []  # called whenever a job ends or leaves
        self._worker: threading.Thread | None = None
        self._closed = False
        self.encoded = 0  # documents this queue has added
        _queues.add(self)
        forks.after_fork_in_child(self._after_fork)

    def _after_fork(self) -> None:
        """In a forked child (:mod:`pc_rag.forks`): the worker is gone and the queued documents are the
        parent's to encode; the child starts with an empty queue and starts a worker when it queues one."""
        self._cond = threading.Condition()
        self._queue.clear()
        self._queued.clear()
        self._current, self._worker, self._urgent = None, None, False

    # -- requests --------------------------------------------------------------------------------
    @contextmanager
    def serving(self) -> Iterator[None]:
        """Around a period in which the engine serves requests: documents take a share of the model."""
        with self.turns.serving():
            try:
                yield
            finally:
                with self._cond:
                    self._served += 1
                    self._cond.notify_all()

    # -- work ------------------------------------------------------------------------------------
    def submit(self, schema: str, system: str | None, records: list[DocumentRecord], *,
               replace_changed: bool = False, options: dict[str, Any] | None = None, behind: bool = False) -> int:
        """Queue ``records`` for ``schema``; returns how many were queued
        (a record already queued, or refused before, is not queued again). ``replace_changed``
        and ``options`` (a neighbour context) as :meth:`pc_rag.PromptCache.add_documents` takes them.
        ``behind``: the engine's own (:mod:`pc_rag.prompt.recurring`), encoded after every document a
        caller queued and not listed in the shared queue."""
        shared = {}  # recorded in the shared queue before the worker can look for them there
        if self._shared is not None and not self._closed and not behind:
            shared = {record.name: self._shared.queue_put(schema, record.name, record.text, QUEUED) for record in records}
        with self._cond:
            if self._closed:
                raise PromptCacheError("this engine's background queue is closed")
            deadline = time.monotonic() + self.grace_s
            queued, refused = 0, []
            for record in records:
                job = _Job(schema, system, record.name, record.text, dict(record.metadata), replace_changed, dict(options or {}),
                           self._served, deadline, behind=behind)
                if job.key in self._queued or job.key in self._refused:
                    refused.extend([record.name] if job.key in self._refused else [])
                    continue
                job.shared = shared.get(record.name, False)
                self._queue.append(job)
                self._queued.add(job.key)
                self._failed.pop((schema, record.name), None)
                queued += 1
            if queued and self._worker is None:
                self._worker = threading.Thread(target=self._work, name="pc-rag-background-encode", daemon=True)
                self._worker.start()
            self._cond.notify_all()
        if queued:
            logger.debug("queued %d documents of %r for background encoding", queued, schema)
        for name in refused if self._shared is not None else ():
            self._shared.queue_remove(schema, name)  # refused before: not queued, not listed as queued
        return queued

    @property
    def pending(self) -> int:
        """Documents queued or being encoded."""
        with self._cond:
            return len(self._queue) + (self._current is not None)

    def queued(self, schema: str) -> list[str]:
        """Names of collection ``schema``'s documents queued or being encoded, sorted."""
        with self._cond:
            return sorted({name for queued_schema, name, _ in self._queued if queued_schema == schema})

    def statuses(self, schema: str) -> dict[str, DocumentStatus]:
        """Collection ``schema``'s documents held here or, with a remote tier, by any replica (it reads
        Redis: not on an event loop): queued, being encoded, or failed (with why); a document
        encoded is in the registry instead."""
        shared = self._shared.queue_read(schema) if self._shared is not None else None
        with self._cond:
            if shared is not None:  # this replica's documents deleted through another: out of its queue too
                gone = [job for job in self._queue if job.schema == schema and job.shared and job.name not in shared]
                for job in gone:
                    self._queue.remove(job)
                    self._queued.discard(job.key)
            shared = shared or {}
            held = {name: DocumentStatus(e["status"], e["error"], e["code"]) for name, e in shared.items()}
            held.update((name, failed) for (s, name), failed in self._failed.items() if s == schema)
            held.update((job.name, DocumentStatus(QUEUED)) for job in self._queue if job.schema == schema)
            job = self._current
            if job is not None and job.schema == schema and not job.deleted:
                held[job.name] = DocumentStatus(IN_PROGRESS)
            return held

    def text(self, schema: str, name: str) -> str | None:
        """The newest text queued (or being encoded) for document ``name`` of ``schema`` here or, with a
        remote tier, by another replica (it reads Redis: not on an event loop); None if none is."""
        with self._cond:
            job = self._current
            for queued in reversed(self._queue):
                if (queued.schema, queued.name) == (schema, name):
                    return queued.text
            if job is not None and (job.schema, job.name) == (schema, name) and not job.deleted:
                return job.text
        entry = self._shared.queue_entry(schema, name) if self._shared is not None else None
        return entry["text"] if entry is not None and entry["status"] != FAILED else None

    def prioritise(self, schema: str, names: Iterable[str]) -> None:
        """A request waits for these documents: they move to the front of the queue, in the order given,
        and their turns do not wait for the background's share of the model."""
        order = {name: rank for rank, name in enumerate(dict.fromkeys(names))}
        with self._cond:
            front = sorted((job for job in self._queue if job.schema == schema and job.name in order), key=lambda job: order[job.name])
            if not front:
                return
            for job in front:
                job.urgent = True
                self._queue.remove(job)
            self._queue.extendleft(reversed(front))
            self._cond.notify_all()

    def remove(self, schema: str, names: Iterable[str]) -> list[str]:
        """Take documents out: queued ones leave the queue, one being encoded is deleted once its
        encoding ends, a failure is forgotten. Returns the names this queue held (sorted)."""
        wanted = set(names)
        with self._cond:
            dropped = [job for job in self._queue if job.schema == schema and job.name in wanted]
            for job in dropped:
                self._queue.remove(job)
                self._queued.discard(job.key)
            held = {job.name for job in dropped}
            job = self._current
            if job is not None and job.schema == schema and job.name in wanted:
                job.deleted = True
                held.add(job.name)
            held |= {name for name in wanted if self._failed.pop((schema, name), None) is not None}
            self._cond.notify_all()
        if self._shared is not None:  # another replica's queued document: it checks before it encodes
            held |= {name for name in wanted if self._shared.queue_remove(schema, name)}
        self._notify()
        return sorted(held)

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (on any thread; it must not block) whenever a document's encoding ends
        or it leaves the queue: how an asyncio waiter learns it without holding a thread."""
        with self._cond:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        with self._cond:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def join(self, timeout: float | None = None) -> bool:
        """Encode everything queued now and wait for it (its passes still take turns with the
        requests being served); True when the queue is empty, False if ``timeout`` seconds passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._urgent = True
            self._cond.notify_all()
            try:
                while self._queue or self._current is not None:
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
            while self._current is not None:
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
        if self._urgent or job.urgent or self._served > job.served:
            return None
        left = job.deadline - time.monotonic()
        return None if left <= 0 else left

    def _next(self) -> _Job | None:
        """The next job once it may start (None: the queue closed)."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                first = next((job for job in self._queue if not job.behind), self._queue[0] if self._queue else None)
                wait = self._ready(first) if first is not None else 60.0
                if wait is None and first.behind and not self._urgent and not self.turns.may_start(behind=True):
                    # its share not worked off: not taken yet (a worker waiting for its turn would hold
                    # back every caller's document queued meanwhile); asked again as steps pay it off
                    wait = BEHIND_POLL_S
                elif wait is None:
                    self._queue.remove(first)
                    job = first
                    self._current = job
                    return job
                self._cond.wait(wait)

    def _work(self) -> None:
        while (job := self._next()) is not None:
            try:
                if job.shared and self._shared.queue_holds(job.schema, job.name) is False:  # type: ignore[union-attr]
                    continue  # deleted through another replica while it was queued
                if self._shared is not None:  # (recorded now if it could not be when queued: removed once encoded)
                    job.shared = self._shared.queue_put(job.schema, job.name, job.text, IN_PROGRESS) or job.shared
                with self.turns.background(urgent=job.urgent or self._urgent, behind=job.behind):
                    if job.deleted:  # while it waited for its turn
                        continue
                    self._add([DocumentRecord(job.name, job.text, job.metadata)], schema=job.schema, system=job.system,
                              progress=False, replace_changed=job.replace_changed, **job.options)
                self.encoded += 1
                if job.shared and not job.deleted and self._shared.queue_remove(job.schema, job.name) is False:  # type: ignore[union-attr]
                    job.deleted = True  # deleted through another replica while it was encoded
                if job.deleted and self._delete is not None:  # deleted while it was encoded
                    self._delete([job.name], schema=job.schema)
            except PromptCacheError as err:
                logger.warning("document %r of %r not encoded in the background: %s", job.name, job.schema, err)
                self._failed_with(job, str(err), refused=True)
            except Exception as err:  # noqa: BLE001 - the worker outlives one bad document; the request it came from was answered
                logger.exception("document %r of %r: background encoding failed", job.name, job.schema)
                self._failed_with(job, f"encoding failed: {type(err).__name__}")
            finally:
                with self._cond:
                    self._current = None
                    self._queued.discard(job.key)
                    self._cond.notify_all()
                self._notify()

    def _failed_with(self, job: _Job, error: str, *, refused: bool = False) -> None:
        failed = DocumentStatus(FAILED, error, "invalid_file" if refused else "server_error")
        with self._cond:
            if refused:
                self._refused.add(job.key)
            if not job.deleted:
                self._failed[(job.schema, job.name)] = failed
        if not job.deleted and self._shared is not None:
            self._shared.queue_put(job.schema, job.name, job.text, FAILED, error, failed.code)

    def _notify(self) -> None:
        with self._cond:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener()
            except Exception:  # noqa: BLE001 - a waiter's wake-up that fails is that waiter's problem
                logger.debug("a background queue listener failed", exc_info=True)
