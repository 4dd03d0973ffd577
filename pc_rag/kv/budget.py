"""The KV buffers' memory budget: which buffers the scheduler holds, and whether more fit.

The scheduler never counts bytes. It tells the budget what it holds (:meth:`BufferBudget.hold`,
:meth:`BufferBudget.release`) and asks yes-or-no questions: may a cohort of new rows start beside
the running batch (:meth:`BufferBudget.admits`), may the running batch be rebuilt without its
finished rows (:meth:`BufferBudget.rebuild_fits`), could a request ever run (:meth:`BufferBudget.needs`).
A buffer's bytes follow the rule of whoever allocates it: one row's comes from the pool, rounded
to the pool's granularity (:meth:`BufferPool.capacity_for`); a batch's is rounded to the batch
granularity (:func:`batch_capacity`), with the vacant rows a compiled batch is padded with.

The pool's idle buffers are a cache, not a request's memory: they count against the budget, but
where only they stand in the way they are let go (a new buffer costs page faults, not a refusal).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .. import forks
from .buffers import BufferPool, KVBuffer, batch_capacity


class BufferBudget:
    """Bytes of KV buffers held at once, within ``limit`` (None: no bound).

    ``vacant(rows)``: the rows a batch of ``rows`` is padded with (a compiled step's fixed batch
    sizes: :func:`pc_rag.scheduler.vacant_rows`); counted in every batch it allocates.
    """

    def __init__(self, pool: BufferPool, kv_bytes_per_token: int, limit: int | None,
                 vacant: Callable[[int], int] = lambda rows: 0) -> None:
        self.pool, self.kv_bytes_per_token, self.limit, self.vacant = pool, kv_bytes_per_token, limit, vacant
        self.peak = 0  # the most bytes held at once (with the pool's idle buffers)
        self._held: dict[int, tuple[KVBuffer, bool]] = {}  # id -> (buffer, from the pool)
        self._lock = threading.Lock()  # held is read by stats() on callers' threads
        forks.renew_after_fork(self, "_lock")

    # -- what a buffer costs --------------------------------------------------------------------
    def bytes_for(self, rows: int, entries: int) -> int:
        """A new buffer's bytes: one row's from the pool, a batch's rounded to the batch granularity."""
        if rows == 1:
            return self.pool.capacity_for(entries) * self.kv_bytes_per_token
        return rows * batch_capacity(entries) * self.kv_bytes_per_token

    def batch_bytes(self, rows: int, entries: int) -> int:
        """A running batch's buffer bytes: ``rows`` and its vacant rows."""
        return self.bytes_for(rows + self.vacant(rows), entries)

    def needs(self, rows: int, entries: int) -> int:
        """The most a request of ``rows`` admitted alone holds at once: its own buffer and, when
        its batch is padded with vacant rows, the padded copy it is moved into."""
        own = self.bytes_for(rows, entries)
        return own + (self.batch_bytes(rows, entries) if self.vacant(rows) else 0)

    # -- what is held ---------------------------------------------------------------------------
    def hold(self, buffer: KVBuffer, *, pooled: bool = False) -> None:
        """``buffer`` is held (``pooled``: it came from the pool, and goes back there when released)."""
        with self._lock:
            self._held[id(buffer)] = (buffer, pooled)
        self.track()

    def release(self, buffer: KVBuffer) -> None:
        """``buffer`` is let go: back to the pool if it came from there. Releasing twice, or a
        buffer never held, does nothing."""
        with self._lock:
            _, pooled = self._held.pop(id(buffer), (None, False))
        if pooled:
            self.pool.release(buffer)

    def let_go_of_all(self) -> None:
        """Nothing held any more (a forked child: the parent's rows are not the child's to serve)."""
        with self._lock:
            self._held.clear()

    def held(self) -> list[KVBuffer]:
        with self._lock:
            return [buffer for buffer, _ in self._held.values()]

    def held_bytes(self, *, idle: bool = True) -> int:
        """Bytes of the buffers held and (``idle``) of the pool's idle ones, kept for reuse."""
        held = sum(buffer.storage.nbytes for buffer in self.held())
        return held + (self.pool.idle_bytes if idle else 0)

    def track(self, extra: int = 0) -> None:
        """The peak, with ``extra`` bytes about to be let go counted as held too."""
        self.peak = max(self.peak, self.held_bytes() + extra)

    # -- the questions --------------------------------------------------------------------------
    def room_for(self, needed: int) -> bool:
        """Whether ``needed`` more bytes fit beside what is held; the pool's idle buffers are let
        go where only they stand in the way."""
        if self.limit is None or self.held_bytes() + needed <= self.limit:
            return True
        if self.held_bytes(idle=False) + needed > self.limit:
            return False
        self.pool.drop_idle()
        return True

    def admits(self, rows: int, entries: int, merged: tuple[int, int] | None) -> bool:
        """Whether a cohort of ``rows`` new rows of up to ``entries`` entries may start: its own
        buffer and, while it is merged into a running batch, the merged batch of ``merged`` (rows,
        entries) too (both held while it is built); with no batch running, its padded copy."""
        if self.limit is None:
            return True
        if merged is None:
            return self.room_for(self.needs(rows, entries))
        return self.room_for(self.bytes_for(rows, entries) + self.batch_bytes(*merged))

    def rebuild_fits(self, rows: int, entries: int) -> bool:
        """Whether a batch of ``rows`` rows and ``entries`` entries may be built beside what is held."""
        return self.limit is None or self.room_for(self.batch_bytes(rows, entries))
