"""What a forked child of a process that built engines starts with.

A process may fork after building an engine and serving requests: Python's default
``multiprocessing`` start method on Linux, gunicorn ``--preload``, Celery's prefork workers. Only
the forking thread goes on in the child. The scheduler's loop, the background encoder, the KV
store's writer and the readers' pool are gone there, yet the objects that started them say they
run; a lock another thread held at the fork stays held forever. So each object that owns threads
or locks says here what its child copy must renew (:func:`after_fork_in_child`,
:func:`renew_after_fork`), and ``os.register_at_fork`` runs it in the child before anything else
does: the child starts with fresh locks and no threads, and starts its own threads when it first
needs them. The C kernels' thread pool does the same in C (``thread_pool.c``, ``pthread_atfork``).

What the parent was doing at the fork (its callers' requests, its queued documents) is the parent's:
the child drops it rather than serve it twice.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_CALLS: list[weakref.WeakMethod | Callable[[], None]] = []  # run in a forked child, in registration order
_LOCKS: list[tuple[weakref.ref, tuple[str, ...]]] = []


def after_fork_in_child(call: Callable[[], None]) -> None:
    """Run ``call`` in every forked child: a bound method while its object lives, or a plain function."""
    _CALLS.append(weakref.WeakMethod(call) if hasattr(call, "__self__") else call)


def renew_after_fork(owner: object, *names: str) -> None:
    """In a forked child, ``owner``'s attributes ``names`` (a ``Lock``, ``RLock`` or ``Condition``) are
    replaced by new, unheld ones of the same kind."""
    _LOCKS.append((weakref.ref(owner), names))


def fresh_like(lock: Any) -> Any:
    """A new lock of ``lock``'s kind, not held."""
    if isinstance(lock, threading.Condition):
        return threading.Condition()
    if isinstance(lock, type(threading.RLock())):
        return threading.RLock()
    return threading.Lock()


def _in_child() -> None:
    live_locks = []
    for ref, names in _LOCKS:
        owner = ref()
        if owner is None:
            continue
        live_locks.append((ref, names))
        for name in names:
            setattr(owner, name, fresh_like(getattr(owner, name)))
    _LOCKS[:] = live_locks
    live_calls = []
    for entry in _CALLS:
        call = entry() if isinstance(entry, weakref.WeakMethod) else entry
        if call is None:
            continue
        live_calls.append(entry)
        try:
            call()
        except Exception:  # noqa: BLE001 - one part's failure must not stop the others' renewal
            logger.exception("renewing %r in a forked child failed", call)
    _CALLS[:] = live_calls


os.register_at_fork(after_in_child=_in_child)
