"""What the HTTP layer calls to serve a request: the engine in this process (:class:`LocalBackend`)
or engine replicas on Ray Serve (:class:`pc_rag.server.replicas.RayBackend`), behind one interface.

A generation is described by a :class:`Call` payload (plain data, so it crosses to a Ray replica
and the request router can read it); a backend returns :class:`~pc_rag.Generation` results and
streams whose ``result`` holds one once exhausted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from ..decode.request import Generation


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


def held(engine: Any, collection: str) -> tuple[dict[str, int], set[str]]:
    """``collection``'s documents encoded in ``engine`` (each name with its module's tokens: what a
    prompt that imports it counts), and the names queued for encoding."""
    schema = engine.registry.snapshot().schemas.get(collection)
    encoded = ({name: len(schema.layout.modules[name].token_ids) for name in schema.documents}
               if schema is not None and schema.layout.documents else {})
    return encoded, set(engine.background.queued(collection))


class LocalBackend:
    """The engine in this process: generations go through its scheduler (``agenerate``/``astream``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer  # names the tokens of log-probabilities

    def render_chat(self, turns: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return self.engine.render_chat(turns, tools)

    async def generate(self, call: dict[str, Any]) -> Generation:
        return await self.engine.agenerate(call["prompt"], collections=call["scope"], **call["params"])

    def stream(self, call: dict[str, Any]) -> Stream:
        return self.engine.astream(call["prompt"], collections=call["scope"], **call["params"])

    async def add_documents(self, collection: str, texts: list[str], ids: list[str | None], metadatas: list[Any]) -> list[str]:
        # background=True queues them once they are tokenised (a body of up to 8 MiB: off the event loop)
        return await asyncio.to_thread(self.engine.add_documents, texts, ids=ids, metadatas=metadatas, schema=collection,
                                       background=True, replace_changed=True, progress=False)

    async def held(self, collection: str) -> tuple[dict[str, int], set[str]]:
        return held(self.engine, collection)

    async def wait_for_documents(self, timeout: float) -> None:
        await asyncio.to_thread(self.engine.wait_for_documents, timeout)

    async def delete_document(self, collection: str, name: str) -> None:
        await asyncio.to_thread(self.engine.delete_documents, [name], schema=collection)

    async def health(self) -> dict[str, Any]:
        stats = self.engine.scheduler.stats()
        return {"running": stats["running"], "queued": stats["queued"], "compile": self.engine.forward.compile_mode}
