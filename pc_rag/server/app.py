"""The HTTP application: OpenAI's endpoints and the document endpoints over one engine.

Built on Starlette (the ASGI toolkit FastAPI is made of) and served by uvicorn. Starlette
rather than FastAPI because every body is read by hand here: size-limited and time-limited
before it is parsed, then validated by :mod:`pc_rag.server.wire`'s models so that errors come
back in OpenAI's shape (FastAPI's automatic validation answers 422 in its own).

Every generation goes through the engine's scheduler (``engine.agenerate``/``astream``), so
concurrent HTTP requests are its concurrent callers, batched together; the event loop never waits
on a forward pass. A client that disconnects cancels its request: its row is let go at the
scheduler's next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from pydantic import Field
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..background import IN_PROGRESS, QUEUED
from ..callers import gather_or_cancel
from ..decode.logprobs import chat_logprobs, completion_logprobs
from ..decode.request import Generation
from ..decode.sampling import SamplingParams
from ..errors import PromptCacheError
from ..integrations._shared import model_name as engine_model_name
from ..prompt.documents import DEFAULT_SCHEMA, SEPARATOR, check_name, module_reference
from .backend import LocalBackend, call_payload
from .metrics import CONTENT_TYPE, Metrics
from .quota import Quota, Slots
from .streaming import ClientGone, EventStream, StreamedChoice, merge_streams, prepend, sse, unless_disconnected
from .tenants import SINGLE_USER, Tenant, Tenants
from .wire import (
    ApiError,
    Call,
    ChatRequest,
    CompletionRequest,
    RequestBody,
    api_error,
    chat_call,
    chat_chunk,
    chat_response,
    choices,
    completion_calls,
    completion_chunk,
    completion_response,
    new_id,
    not_found,
    read_body,
    reply_message,
    usage,
    usage_chunk,
)

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024
BODY_TIMEOUT_S = 30.0
# a request naming documents still queued for encoding waits this long for them (moved to the front
# of the queue), then reads them as text; a key with DOCUMENT_WAITS_PER_KEY such waits in flight
# reads them as text at once, so no key's document traffic holds up its own requests for long
DOCUMENTS_WAIT_S = 10.0
DOCUMENT_WAITS_PER_KEY = 4


class _Document(RequestBody):
    id: str | None = None
    text: str
    metadata: dict[str, Any] | None = None


class _Documents(RequestBody):
    documents: list[_Document] = Field(min_length=1)


class Server:
    """A backend (the engine here, or replicas on Ray Serve) behind OpenAI's endpoints (see :func:`create_app`)."""

    def __init__(self, backend: Any, *, model_name: str, tenants: Tenants | None = None, engine: Any = None,
                 max_body_bytes: int = MAX_BODY_BYTES, body_timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.backend = backend
        self.tenants = tenants
        self.model = model_name
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.metrics = Metrics(engine)
        self.quota = Quota(self.metrics.tenant)  # generations each key has in flight, tokens it used
        self.metrics.watch_tokens(self.quota.spending, self.quota.holding)
        self.started = int(time.time())
        self.documents_wait_s = DOCUMENTS_WAIT_S
        self._document_waits: dict[str, int] = {}  # a key's requests waiting for queued documents now

    # -- the endpoints ----------------------------------------------------------------------------
    async def chat_completions(self, request: Request, tenant: Tenant) -> Response:
        slots = self.quota.take(tenant)  # before the body: a slow body holds its key's slot
        try:
            body: ChatRequest = read_body(ChatRequest, await self._body(request))
            self._check_model(body.model)
            references, imported = await self._references(body.documents, body.collection, tenant)
            call = chat_call(body, self.backend.render_chat, references, imported)
            request_id = new_id("chatcmpl")
            documents = body.documents or ()
            slots.grow(body.n)  # one per choice: each is a row of the scheduler
            calls = choices(call, body.n)
            slots.reserve(self._price(tenant, calls, body.n))  # of the key's minute, until it is charged what it used
            if call.stream:
                return await self._stream(request, request_id, calls, documents, slots, chat=True)
            results = await self._whole(request, slots, calls, body.n, documents)
            slots.charge(usage(results, body.n)["total_tokens"])
            return JSONResponse(chat_response(request_id, self.model, results, call.tools, self.backend.tokenizer))
        finally:
            slots.release()  # nothing after a stream's hand-over: the stream gives them back as it ends

    async def completions(self, request: Request, tenant: Tenant) -> Response:
        slots = self.quota.take(tenant)
        try:
            body: CompletionRequest = read_body(CompletionRequest, await self._body(request))
            self._check_model(body.model)
            calls = completion_calls(body)
            slots.grow(len(calls))  # one per prompt and choice: each is a row of the scheduler
            slots.reserve(self._price(tenant, calls, body.n))
            request_id = new_id("cmpl")
            if calls[0].stream:
                return await self._stream(request, request_id, calls, (), slots, chat=False)
            results = await self._whole(request, slots, calls, body.n)
            slots.charge(usage(results, body.n)["total_tokens"])
            return JSONResponse(completion_response(request_id, self.model, results, body.n, self.backend.tokenizer))
        finally:
            slots.release()

    async def models(self, request: Request, tenant: Tenant) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "created": self.started, "owned_by": "pc-rag"}]})

    async def add_documents(self, request: Request, tenant: Tenant) -> Response:
        collection = self._collection(request.path_params["collection"], tenant)
        body: _Documents = read_body(_Documents, await self._body(request))
        names = await self.backend.add_documents(collection, [d.text for d in body.documents], [d.id for d in body.documents],
                                                 [d.metadata for d in body.documents])
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "document", "status": "queued"} for name in names]},
                            status_code=202)

    async def list_documents(self, request: Request, tenant: Tenant) -> Response:
        collection = self._collection(request.path_params["collection"], tenant)
        encoded, pending = await self.backend.held(collection)
        if not encoded and not pending:
            raise not_found(f"collection {collection!r}")
        limit = _int_query(request, "limit", 100, 1, 1000)
        after = request.query_params.get("after")
        # a document whose new version waits is "queued" or "in_progress" (its old one serves until
        # then): a client that replaced a document and waits for "encoded" then waits for the new text
        statuses = {**{name: {"status": "encoded", "last_error": None} for name in encoded}, **pending}
        names = sorted(n for n in statuses if after is None or n > after)
        page = names[:limit]
        return JSONResponse({"object": "list", "data": [{"id": n, "object": "document", **statuses[n]} for n in page],
                             "has_more": len(names) > limit, "last_id": page[-1] if page else None})

    async def delete_document(self, request: Request, tenant: Tenant) -> Response:
        collection = self._collection(request.path_params["collection"], tenant)
        name = request.path_params["document"]
        # at once, whatever its status: queued, it leaves the queue; being encoded, it is deleted as that ends
        if not await self.backend.delete_document(collection, name):
            raise not_found(f"document {name!r} in collection {collection!r}")
        return JSONResponse({"id": name, "object": "document", "deleted": True})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.model, **await self.backend.health()})

    async def scrape(self, request: Request) -> Response:
        return Response(self.metrics.scrape(), media_type=CONTENT_TYPE)

    # -- generation -------------------------------------------------------------------------------
    async def _whole(self, request: Request, slots: Slots, calls: list[Call], n: int, documents: Sequence[str] = ()) -> list[Generation]:
        """Every call's Generation (a refused one cancels the rest); a client gone first is charged."""
        try:
            return await unless_disconnected(request, gather_or_cancel(*(self._generate(c, slots.tenant, documents) for c in calls)))
        except ClientGone:
            self._charge_departed(slots, calls)
            raise

    def _charge_departed(self, slots: Slots, calls: Sequence[Call], streamed: Sequence[int] | None = None) -> None:
        """A client gone before its reply finished is charged what the reply may have used: the
        price it holds (:meth:`_price`) for a whole reply it never saw, or, for a stream, that
        price's prompts and the tokens streamed to it (``streamed``, a count per call). Else a
        key could leave just before each reply's end and never be charged for its tokens per minute."""
        if not slots.tokens:  # a key without max_tokens_per_minute: nothing was priced
            return
        tokens = slots.tokens
        if streamed is not None:
            tokens += sum(streamed) - _budgets(calls)
        slots.charge(tokens)

    def _price(self, tenant: Tenant, calls: Sequence[Call], n: int) -> int:
        """What ``calls`` (``n`` choices of each prompt) may use of a key's tokens per minute: the
        tokens of each prompt as rendered and of the documents it imports (a module reference in
        the text stands for them, and counts as text too: a little over what the engine counts),
        and each generation's budget; 0 for a key without that bound (nothing is counted)."""
        if tenant.max_tokens_per_minute is None:
            return 0
        return sum(_count(self.backend.tokenizer, c.prompt) + c.imported_tokens for c in calls[::n]) + _budgets(calls)

    async def _generate(self, call: Call, tenant: Tenant, documents: Sequence[str] = ()) -> Generation:
        result = await self.backend.generate(call_payload(call.prompt, call.params, tenant.generation_scope, documents))
        self.metrics.generation(result)
        return result

    async def _stream(self, request: Request, request_id: str, calls: list[Call], documents: Sequence[str], slots: Slots, *,
                      chat: bool) -> Response:
        """Server-sent events of ``calls`` (one per choice, interleaved as they come). Each
        choice's first piece is awaited before the response starts, so a request refused at
        submission (queue full, too long, bad) still gets its status code; a client that leaves
        meanwhile (tired of waiting in the queue) lets its rows go at once. The stream holds
        ``slots`` until it ends."""
        scope = slots.tenant.generation_scope
        started = time.perf_counter()
        streamed = [StreamedChoice(i, call, self.backend.stream(call_payload(call.prompt, call.params, scope, documents)))
                    for i, call in enumerate(calls)]
        try:
            await unless_disconnected(request, gather_or_cancel(*(choice.start() for choice in streamed)))
        except BaseException as exc:
            for choice in streamed:
                await choice.stream.aclose()
            if isinstance(exc, ClientGone):  # charged like a stream cut before anything reached it
                self._charge_departed(slots, calls, [0 for _ in calls])
            raise
        for choice in streamed:  # observed now: a client that leaves mid-reply (perhaps tired of a slow first token) counts too
            self.metrics.first_token(choice.first_at - started)
        held = slots.hand_over()

        async def close() -> None:
            for choice in streamed:
                await choice.stream.aclose()  # a disconnect cancels the events: the rows are let go
            held.release()

        return EventStream(self._events(request_id, streamed, chat, held), close)

    async def _events(self, request_id: str, streamed: list["StreamedChoice"], chat: bool, slots: Slots) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        finished = False
        try:
            async for chunk in merge_streams([self._choice_chunks(request_id, choice, chat) for choice in streamed]):
                yield sse(chunk)
            results: list[Generation] = [choice.stream.result for choice in streamed]
            for result in results:
                self.metrics.generation(result, streamed=True)
            slots.charge(usage(results, len(results))["total_tokens"])
            finished = True
            if streamed[0].call.include_usage:
                yield sse(usage_chunk(request_id, self.model, kind, results))
        except Exception as exc:  # headers are sent: the error is the stream's last event
            yield sse(api_error(exc, chat=chat).body())  # _error logs what is not the client's fault
        finally:
            if not finished:  # its client left (or it failed): counted and charged for what it was sent
                sent = [_count(self.backend.tokenizer, "".join(c.texts)) for c in streamed]
                self.metrics.cut_short(sum(sent))
                self._charge_departed(slots, [c.call for c in streamed], sent)
        yield "data: [DONE]\n\n"

    async def _choice_chunks(self, request_id: str, choice: "StreamedChoice", chat: bool) -> AsyncIterator[dict[str, Any]]:
        """One choice's chunks: its text as it comes (each piece with the log-probabilities of the
        tokens it completes: LoggedPiece), then its finish (a reply that may be a tool call, whole)."""
        tokenizer, index, call = self.backend.tokenizer, choice.index, choice.call
        if chat:
            yield chat_chunk(request_id, self.model, {"role": "assistant", "content": ""}, index=index)
        sent = shown = 0  # log-probability entries and characters streamed so far
        async for piece in prepend(choice.first, choice.stream):
            choice.texts.append(piece)
            if call.tools:  # the reply may be a tool call: read it whole before anything is sent
                continue
            logged = getattr(piece, "logprobs", None)
            if chat:
                yield chat_chunk(request_id, self.model, {"content": str(piece)}, logprobs=chat_logprobs(logged, tokenizer), index=index)
            else:
                yield completion_chunk(request_id, self.model, str(piece), logprobs=completion_logprobs(logged, tokenizer, shown), index=index)
            sent += len(logged or ())
            shown += len(piece)
        result: Generation = choice.stream.result
        rest = None if result.logprobs is None else result.logprobs[sent:]  # those of tokens never shown (a stop sequence)
        if not chat:
            yield completion_chunk(request_id, self.model, "", result.finish_reason, completion_logprobs(rest, tokenizer, shown), index=index)
            return
        message, finish = reply_message(result, call.tools)
        if call.tools:
            delta = ({"tool_calls": [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]} if "tool_calls" in message
                     else {"content": message["content"]})
            yield chat_chunk(request_id, self.model, delta, index=index)
        yield chat_chunk(request_id, self.model, {}, finish, chat_logprobs(rest, tokenizer), index=index)

    # -- request parts ----------------------------------------------------------------------------
    async def _body(self, request: Request) -> bytes:
        """The body, refused past ``max_body_bytes`` (413) or ``body_timeout_s`` (408)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise ApiError(413, f"the body has {declared} bytes, more than this server takes ({self.max_body_bytes})")

        async def collect() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise ApiError(413, f"the body is larger than this server takes ({self.max_body_bytes} bytes)")
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            return await asyncio.wait_for(collect(), self.body_timeout_s)
        except TimeoutError:
            raise ApiError(408, f"the body did not arrive within {self.body_timeout_s:g} s") from None

    def _check_model(self, model: str) -> None:
        if model != self.model:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model!r}", param="model",
                           code="model_not_found")

    def _collection(self, name: str, tenant: Tenant) -> str:
        try:
            check_name(name, "collection name")
        except PromptCacheError:
            raise not_found(f"collection {name!r}") from None
        if not tenant.may_use(name):
            raise not_found(f"collection {name!r}")
        return name

    async def _references(self, ids: list[str] | None, collection: str | None, tenant: Tenant) -> tuple[list[str], int]:
        """What stands for the documents a request names (``documents``, in ``collection``: by
        default the key's only collection, or ``docs``), and the tokens they import: a module
        reference for each encoded one; a queued one is waited for (first in the queue, up to
        ``documents_wait_s``) and read as text if it is still not encoded. 404 for any it cannot see."""
        if not ids:
            return [], 0
        if collection is None:
            only = tenant.scope
            collection = only[0] if only is not None and len(only) == 1 else DEFAULT_SCHEMA
        collection = self._collection(collection, tenant)
        encoded, pending = await self.backend.held(collection)
        queued = [name for name in dict.fromkeys(ids) if name not in encoded and pending.get(name, {}).get("status") in (QUEUED, IN_PROGRESS)]
        for name in ids:
            if name not in encoded and name not in queued:
                failed = pending.get(name, {}).get("last_error")
                if failed is not None:
                    raise ApiError(400, f"document {name!r} of collection {collection!r} could not be encoded: {failed['message']}",
                                   param="documents", code="document_failed")
                raise not_found(f"document {name!r} in collection {collection!r}")
        texts = await self._wait_for(collection, queued, tenant) if queued else {}
        if any(name not in texts for name in queued):  # encoded meanwhile (or deleted: 404 below)
            encoded, _ = await self.backend.held(collection)
        parts, imported = [], 0
        for name in ids:
            if name in texts:
                parts.append(texts[name] + SEPARATOR)  # plain text: a forged reference in it is text like any other
            elif name in encoded:
                parts.append(module_reference(name, collection))
                imported += encoded[name]
            else:  # deleted while it was waited for
                raise not_found(f"document {name!r} in collection {collection!r}")
        return parts, imported

    async def _wait_for(self, collection: str, names: list[str], tenant: Tenant) -> dict[str, str]:
        """The texts of ``names`` (queued documents) not encoded within ``documents_wait_s``; a key
        already waiting on ``DOCUMENT_WAITS_PER_KEY`` requests does not wait at all."""
        waits = self._document_waits.get(tenant.name, 0)
        timeout = self.documents_wait_s if waits < DOCUMENT_WAITS_PER_KEY else 0.0
        self._document_waits[tenant.name] = waits + 1
        try:
            return await self.backend.await_documents(collection, names, timeout)
        finally:
            self._document_waits[tenant.name] -= 1
            if not self._document_waits[tenant.name]:
                del self._document_waits[tenant.name]


# -- plumbing -------------------------------------------------------------------------------------
def _int_query(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise ApiError(400, f"{name} must be an integer from {low} to {high}, got {raw!r}", param=name)
    return int(raw)


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _budgets(calls: Sequence[Call]) -> int:
    """The new tokens ``calls`` may generate in all (each its ``max_tokens``, or the default)."""
    return sum(c.params.get("max_tokens") or c.params.get("max_new_tokens") or SamplingParams.max_new_tokens for c in calls)


async def _no_route(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 404)
    message = f"no route {request.method} {request.url.path}" if status == 404 else f"{request.method} is not allowed on {request.url.path}"
    return JSONResponse(ApiError(status, message, code="not_found" if status == 404 else "method_not_allowed").body(), status_code=status)


Handler = Callable[[Request, Tenant], Coroutine[Any, Any, Response]]


def _endpoint(server: Server, name: str, handler: Handler) -> Callable[[Request], Coroutine[Any, Any, Response]]:
    """``handler`` with authentication, errors in OpenAI's shape, and the request counted."""

    async def run(request: Request) -> Response:
        try:
            tenant = SINGLE_USER if server.tenants is None else server.tenants.authenticate(request.headers.get("authorization"))
            response = await handler(request, tenant)
        except ClientGone:
            server.metrics.answered(name, 499)  # nginx's code for it: nobody reads this response
            return Response(status_code=499)
        except Exception as exc:
            error = api_error(exc, chat=name == "chat")
            response = JSONResponse(error.body(), status_code=error.status, headers=error.headers)
        server.metrics.answered(name, response.status_code)
        return response

    return run


def create_app(engine: Any = None, *, backend: Any = None, tenants: Tenants | None = None, model_name: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, body_timeout_s: float = BODY_TIMEOUT_S) -> Starlette:
    """An ASGI application serving ``engine`` (a :class:`~pc_rag.PromptCache` in this process) or
    ``backend`` (replicas: :class:`pc_rag.server.replicas.RayBackend`) in OpenAI's wire format
    (run it with uvicorn: ``pc-rag serve`` does). ``tenants``: API keys and their collections
    (None: single-user); ``model_name``: the id clients ask for (default: the model's name)."""
    if (engine is None) == (backend is None):
        raise PromptCacheError("create_app takes an engine or a backend")
    if backend is None:
        backend, model_name = LocalBackend(engine), model_name or engine_model_name(engine)
    server = Server(backend, model_name=model_name or "pc-rag", tenants=tenants, engine=engine, max_body_bytes=max_body_bytes,
                    body_timeout_s=body_timeout_s)
    documents = "/v1/collections/{collection}/documents"
    routes = [
        Route("/v1/chat/completions", _endpoint(server, "chat", server.chat_completions), methods=["POST"]),
        Route("/v1/completions", _endpoint(server, "completions", server.completions), methods=["POST"]),
        Route("/v1/models", _endpoint(server, "models", server.models), methods=["GET"]),
        Route(documents, _endpoint(server, "add_documents", server.add_documents), methods=["POST"]),
        Route(documents, _endpoint(server, "list_documents", server.list_documents), methods=["GET"]),
        Route(documents + "/{document}", _endpoint(server, "delete_document", server.delete_document), methods=["DELETE"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.scrape, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={404: _no_route, 405: _no_route})
    app.state.server = server
    return app
