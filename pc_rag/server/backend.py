"""What the HTTP layer calls to serve a request: the engine in this process (:class:`LocalBackend`)
or engine replicas on Ray Serve (:class:`pc_rag.server.replicas.RayBackend`), behind one interface.

A generation is described by a :class:`Call` payload (plain data, so it crosses to a Ray replica
and the request router can read it); a backend returns :class:`~pc_rag.Generation` results and
streams whose ``result`` holds one once exhausted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from functools import partial
from typing import Any, Protocol, TypeVar

from ..decode.request import Generation

DOCUMENT_THREADS = 4  # the document calls that may block at once (the rest wait their turn, not the event loop)
T = TypeVar("T")


class Stream(Protocol):
    """Text pieces of one generation; ``result`` once exhausted; ``aclose()`` lets its row go."""

    result: Generation | None

    def __aiter__(self) -> AsyncIterator[str]: ...
    async def __anext__(self) -> str: ...
    async def aclose(self) -> None: ...


def call_payload(prompt: str, params: dict[str, Any], scope: list[str] | None, documents: Sequence[str] = ()) -> dict[str, Any]:
    """One generation as plain data: the plain-text prompt, ``generate`` keywords, the caller's
    collections (None: all) and the documents it names (for routing)."""
    return {"prompt": prompt, "params": dict(params), "scope": scope, "documents": list(documents)}


def held(engine: Any, collection: str) -> tuple[dict[str, int], dict[str, dict[str, Any]]]:
    """``collection``'s documents encoded in ``engine`` (each name with its module's tokens: what a
    prompt that imports it counts), and those its background queue holds, each with its status as
    OpenAI's vector-store files give it (``{"status": "queued" | "in_progress" | "failed",
    "last_error": {"code", "message"} | None}``): plain data, so it crosses to a Ray replica."""
    schema = engine.registry.snapshot().schemas.get(collection)
    encoded = ({name: len(schema.layout.modules[name].token_ids) for name in schema.documents}
               if schema is not None and schema.layout.documents else {})
    pending = {name: {"status": held.status, "last_error": None if held.last_error is None else {"code": held.code, "message": held.last_error}}
               for name, held in engine.background.statuses(collection).items()}
    return encoded, pending


class LocalBackend:
    """The engine in this process: generations go through its scheduler (``agenerate``/``astream``);
    the document calls that block (tokenising a body, deleting from every tier) run on a small
    executor of their own, never on asyncio's default one, which carries every generation's
    submission: a slow document call cannot hold up another caller's chat."""

    def __init__(self, engine: Any, *, document_threads: int = DOCUMENT_THREADS) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer  # names the tokens of log-probabilities
        self._executor = ThreadPoolExecutor(document_threads, thread_name_prefix="pc-rag-documents")

    def render_chat(self, turns: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return self.engine.render_chat(turns, tools)

    async def generate(self, call: dict[str, Any]) -> Generation:
        return await self.engine.agenerate(call["prompt"], collections=call["scope"], **call["params"])

    def stream(self, call: dict[str, Any]) -> Stream:
        return self.engine.astream(call["prompt"], collections=call["scope"], **call["params"])

    async def _blocking(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, partial(function, *args, **kwargs))

    async def add_documents(self, collection: str, texts: list[str], ids: list[str | None], metadatas: list[Any]) -> list[str]:
        # background=True queues them once they are tokenised (a body of up to 8 MiB: off the event loop)
        return await self._blocking(self.engine.add_documents, texts, ids=ids, metadatas=metadatas, schema=collection,
                                    background=True, replace_changed=True, progress=False)

    async def held(self, collection: str) -> tuple[dict[str, int], dict[str, dict[str, Any]]]:
        return await self._blocking(held, self.engine, collection)  # with a remote tier it reads the shared queue

    async def await_documents(self, collection: str, names: list[str], timeout: float) -> dict[str, str]:
        """Wait up to ``timeout`` seconds for these queued documents alone (moved to the front of
        the queue) without holding a thread; returns the texts of those still not encoded (a
        request reads them as text), none for a document deleted meanwhile."""
        background = self.engine.background
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()

        def wake() -> None:
            loop.call_soon_threadsafe(changed.set)

        def waiting() -> list[str]:  # this replica's queue: another's documents are read as text at once
            queued = set(background.queued(collection))
            return [name for name in names if name in queued]

        background.add_listener(wake)
        try:
            background.prioritise(collection, names)
            deadline = loop.time() + timeout
            while (left := waiting()) and (remaining := deadline - loop.time()) > 0:
                changed.clear()
                if waiting():
                    with suppress(TimeoutError):
                        await asyncio.wait_for(changed.wait(), remaining)
        finally:
            background.remove_listener(wake)
        texts = {name: await self._blocking(background.text, collection, name) for name in left}
        return {name: text for name, text in texts.items() if text is not None}

    async def wait_for_documents(self, timeout: float) -> bool:
        """Every queued document encoded (a test's or a script's wait, not a request's)."""
        return await self._blocking(self.engine.wait_for_documents, timeout)

    async def delete_document(self, collection: str, name: str) -> bool:
        """Delete it now (queued: out of the queue); whether this collection held it."""
        return bool(await self._blocking(self.engine.delete_documents, [name], schema=collection))

    async def health(self) -> dict[str, Any]:
        stats = self.engine.scheduler.stats()
        return {"running": stats["running"], "queued": stats["queued"], "compile": self.engine.forward.compile_mode}

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
