"""``pc-rag serve``: the engine behind an OpenAI-compatible HTTP API, for many callers and tenants.

    app.py      routes: chat and text completions, models, documents, health, metrics
    wire.py     OpenAI's request and reply formats, read into engine calls and written back
    tenants.py  API keys and the collections each may read and write
    metrics.py  Prometheus metrics

The server adds no serving logic of its own: every request becomes an ``engine.agenerate`` /
``astream`` call, scoped to its key's collections, and the engine's scheduler batches them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from .app import create_app
from .tenants import Tenants

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
SHUTDOWN_CLOSE_S = 2.0  # after uvicorn's deadline: the loop lets cancelled rows go within a step

__all__ = ["Tenants", "create_app", "serve"]


def serve(engine: Any, *, host: str = "127.0.0.1", port: int = 8000, tenants: Tenants | None = None,
          model_name: str | None = None, timeout_keep_alive: int = 5, body_timeout_s: float = 30.0,
          shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
    """Serve ``engine`` with uvicorn until interrupted. Without ``tenants`` the server is
    single-user: meant for localhost, and a warning says so when bound to another interface.
    Idle keep-alive connections close after ``timeout_keep_alive`` s; a body not received within
    ``body_timeout_s`` answers 408. On SIGTERM or Ctrl-C it stops accepting connections, lets the
    requests in flight finish for up to ``shutdown_timeout_s`` seconds, then cancels the rest
    (their rows are let go) and exits; a document being encoded is given what is left of that time."""
    import uvicorn

    if tenants is None and not _loopback(host):
        logger.warning("serving on %s without --api-keys: anyone who can reach this port reads and writes every collection", host)
    app = create_app(engine, tenants=tenants, model_name=model_name, body_timeout_s=body_timeout_s)

    @asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        yield
        # uvicorn has let the requests finish or cancelled them (their rows go at the loop's next
        # step); it then re-raises the signal, so what is left is done here, before that
        await asyncio.to_thread(_close, engine, app.state.server.backend, SHUTDOWN_CLOSE_S)

    app.router.lifespan_context = lifespan
    # h11: its ASGI spec version makes Starlette watch for disconnects while a stream waits on the model
    uvicorn.run(app, host=host, port=port, http="h11", timeout_keep_alive=timeout_keep_alive, log_level="info",
                timeout_graceful_shutdown=max(shutdown_timeout_s, 0.1))


def _close(engine: Any, backend: Any, seconds: float) -> None:
    """The scheduler's loop ended and the document being encoded given ``seconds`` in all."""
    deadline = time.monotonic() + seconds
    engine.scheduler.close(timeout=seconds)
    engine.background.close(timeout=max(deadline - time.monotonic(), 0.1))
    backend.close()
    print("pc-rag: engine closed", file=sys.stderr, flush=True)  # (uvicorn's log config leaves pc-rag's INFO lines out)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
