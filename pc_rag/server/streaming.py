"""Streaming plumbing of the HTTP application: server-sent events, streamed choices merged as
they come, and work cancelled when its client disconnects (:mod:`pc_rag.server.app` uses them)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from .wire import Call


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class EventStream(StreamingResponse):
    """Server-sent events that run ``close`` however the response ends: sent whole, cut by a
    disconnect, or never started (a client gone before the first byte: the events' generator
    never runs, so its own ``finally`` could not be relied on)."""

    def __init__(self, events: AsyncIterator[str], close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._close = close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class StreamedChoice:
    """One streamed choice: its call, its stream, its first piece (awaited before the response
    starts) and when it came (``first_at``, ``time.perf_counter()``), and the text streamed so far."""

    def __init__(self, index: int, call: Call, stream: Any) -> None:
        self.index, self.call, self.stream = index, call, stream
        self.first: str | None = None
        self.first_at = 0.0
        self.texts: list[str] = []

    async def start(self) -> None:
        try:
            self.first = await self.stream.__anext__()
        except StopAsyncIteration:
            self.first = None
        self.first_at = time.perf_counter()


T = TypeVar("T")


async def merge_streams(sources: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of every source as they come (one source: in turn); a source's error is raised
    here, and leaving early stops them all."""
    if len(sources) == 1:
        async for item in sources[0]:
            yield item
        return
    queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()

    async def pump(source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                await queue.put((True, item))
        except Exception as exc:  # noqa: BLE001 - raised by the consumer below
            await queue.put((False, exc))
            return
        await queue.put((False, None))

    tasks = [asyncio.ensure_future(pump(source)) for source in sources]
    try:
        left = len(tasks)
        while left:
            ok, item = await queue.get()
            if ok:
                yield item
            elif item is None:
                left -= 1
            else:
                raise item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def prepend(first: str | None, stream: Any) -> AsyncIterator[str]:
    if first is not None:
        yield first
        async for piece in stream:
            yield piece


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """``work``'s result, or cancel it when the client goes away first (its rows are let go)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone
