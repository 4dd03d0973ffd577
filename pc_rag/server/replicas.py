"""``pc-rag serve --replicas N``: N engine replicas on Ray Serve over one Redis, behind the same HTTP API.

    HTTP -> Ray Serve proxy -> Ingress (create_app over a RayBackend: parsing, keys, metrics)
         -> DeploymentHandle, routed by AffinityRouter (pc_rag.server.routing)
         -> EngineReplica (a PromptCache with remote_store=REDIS: agenerate / astream)

Every replica shares module KV and documents through Redis (``remote_store``), so a replica that
joins or restarts starts from what the others stored; what differs between replicas is what each
holds in memory, and the router sends a request to the replica that holds most of the documents
it reads. A replica that dies while serving a request: the request is sent again, to another
replica (unless a streamed reply had already begun).
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from ..decode.request import Generation
from ..errors import PromptCacheError
from .backend import LocalBackend
from .routing import routing_stats

logger = logging.getLogger(__name__)

_REPLICA_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)
APP_NAME = "pc-rag"


def _replica_error(error: RayTaskError) -> BaseException:
    """What a replica raised, as it raised it: Ray's wrapper reads as the replica's traceback (its
    pid, address and file paths), which a client must never get as an error message; what is
    not the client's fault keeps that traceback in the server's log."""
    cause = error.cause
    if not isinstance(cause, PromptCacheError):
        logger.error("a replica failed: %s", error)
    return cause if isinstance(cause, Exception) else RuntimeError(f"a replica failed: {type(error).__name__}")


@serve.deployment
class EngineReplica:
    """One engine. ``options`` are ``PromptCache.from_pretrained`` keywords (``remote_store`` among them)."""

    def __init__(self, model: str | None, options: dict[str, Any]) -> None:
        from ..engine import PromptCache

        # another replica's documents reach this one within a second (deletions too)
        self.engine = PromptCache.from_pretrained(model, **{"remote_sync_interval_s": 1.0, **options})
        if options.get("compile"):  # before Ray Serve routes to this replica: no caller waits for a compilation
            self.engine.warm_up()
        self.local = LocalBackend(self.engine)  # what the ingress would run in-process, run here

    async def generate(self, call: dict[str, Any]) -> Generation:
        return self._signed(await self.local.generate(call))

    async def stream(self, call: dict[str, Any]) -> AsyncIterator[Any]:
        """The text pieces, then the Generation (cancelling the call lets the row go)."""
        stream = self.local.stream(call)
        try:
            async for piece in stream:
                yield piece
            yield self._signed(stream.result)
        finally:
            await stream.aclose()

    def _signed(self, result: Generation) -> Generation:
        """``result`` with this replica's name and its tier hits so far (``pc_rag.replica`` in replies)."""
        stats = self.engine.store_stats()
        result.stats.replica = {"id": serve.get_replica_context().replica_id.unique_id, "pid": os.getpid(),
                                **{k: stats[k] for k in ("hits_memory", "hits_disk", "hits_remote", "misses", "recomputed_tokens")}}
        return result

    async def add_documents(self, collection: str, texts: list[str], ids: list[str | None], metadatas: list[Any]) -> list[str]:
        return await self.local.add_documents(collection, texts, ids, metadatas)

    async def held(self, collection: str) -> tuple[dict[str, int], dict[str, dict[str, Any]]]:
        self.engine.sync_if_due()  # documents another replica added: listed here within a second
        return await self.local.held(collection)

    async def await_documents(self, collection: str, names: list[str], timeout: float) -> dict[str, str]:
        return await self.local.await_documents(collection, names, timeout)

    async def wait_for_documents(self, timeout: float) -> bool:
        return await self.local.wait_for_documents(timeout)

    async def delete_document(self, collection: str, name: str) -> bool:
        return await self.local.delete_document(collection, name)

    async def health(self) -> dict[str, Any]:
        return await self.local.health()

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Ray Serve for the router: the documents this replica holds in memory."""
        return routing_stats(self.engine)


class _ReplicaStream:
    """A replica's streamed reply as a backend :class:`~pc_rag.server.backend.Stream`; sent again
    to another replica when the first dies before any piece arrived."""

    def __init__(self, handle: Any, call: dict[str, Any]) -> None:
        self._handle, self._call = handle, call
        self._response: Any = None
        self._started = False
        self.result: Generation | None = None

    def __aiter__(self) -> "_ReplicaStream":
        return self

    async def __anext__(self) -> str:
        for attempt in range(2):
            if self._response is None:
                self._response = self._handle.options(stream=True).stream.remote(self._call)
            try:
                item = await self._response.__anext__()
            except _REPLICA_GONE:
                if self._started or attempt:
                    raise
                logger.warning("a replica died before answering: the request goes to another")
                self._response = None
                continue
            except RayTaskError as error:  # (after the above: a replica's death may come wrapped as one)
                raise _replica_error(error) from None
            self._started = True
            if isinstance(item, Generation):
                self.result = item
                raise StopAsyncIteration
            return item
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        if self._response is not None and self.result is None:
            self._response.cancel()


class RayBackend:
    """Engine replicas through a Ray Serve handle (the router picks the replica)."""

    def __init__(self, handle: Any, model: str | None) -> None:
        from ..model.loading import load_tokenizer
        from ..prompt.chat import chat_markers

        self.handle = handle
        self.tokenizer = load_tokenizer(model)  # a GGUF file's own vocabulary where the model is one
        self.markers = chat_markers(self.tokenizer)

    def render_chat(self, turns: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        from ..prompt.chat import render_chat

        return render_chat(self.tokenizer, self.markers, turns, tools)

    async def _call(self, method: str, *args: Any) -> Any:
        for attempt in range(2):
            try:
                return await getattr(self.handle, method).remote(*args)
            except _REPLICA_GONE:
                if attempt:
                    raise
                logger.warning("a replica died serving %s: sent again to another", method)
            except RayTaskError as error:  # (after the above: a replica's death may come wrapped as one)
                raise _replica_error(error) from None
        raise AssertionError("unreachable")

    async def generate(self, call: dict[str, Any]) -> Generation:
        return await self._call("generate", call)

    def stream(self, call: dict[str, Any]) -> _ReplicaStream:
        return _ReplicaStream(self.handle, call)

    async def add_documents(self, collection: str, texts: list[str], ids: list[str | None], metadatas: list[Any]) -> list[str]:
        return await self._call("add_documents", collection, texts, ids, metadatas)

    async def held(self, collection: str) -> tuple[dict[str, int], dict[str, dict[str, Any]]]:
        return await self._call("held", collection)

    async def await_documents(self, collection: str, names: list[str], timeout: float) -> dict[str, str]:
        return await self._call("await_documents", collection, names, timeout)

    async def wait_for_documents(self, timeout: float) -> bool:
        return await self._call("wait_for_documents", timeout)

    async def delete_document(self, collection: str, name: str) -> bool:
        return await self._call("delete_document", collection, name)

    async def health(self) -> dict[str, Any]:
        return await self._call("health")


def _ingress_app(model: str | None, model_name: str, keys_file: str | None, key_bounds: dict[str, int | None]) -> Any:
    """Built on the ingress replica (Ray Serve calls it there)."""
    from .app import create_app
    from .tenants import Tenants

    handle = serve.get_deployment_handle("EngineReplica", app_name=APP_NAME)
    tenants = Tenants.from_file(keys_file, **key_bounds) if keys_file else None
    return create_app(backend=RayBackend(handle, model), tenants=tenants, model_name=model_name)


def build(model: str | None, model_name: str, options: dict[str, Any], *, replicas: int, keys_file: str | None = None,
          key_bounds: dict[str, int | None] | None = None, router: str = "affinity") -> Any:
    """The Ray Serve application: ``replicas`` EngineReplicas and the HTTP ingress (which holds
    each key to its ``max_in_flight`` and ``max_tokens_per_minute`` across all replicas: every
    request passes through it; ``key_bounds``: their defaults, :class:`~pc_rag.server.tenants.Tenants`' keywords).
    ``router``: "affinity" (:class:`~pc_rag.server.routing.AffinityRouter`) or "default" (Ray
    Serve's power of two choices, for comparison)."""
    from ray.serve.config import RequestRouterConfig

    config = {"num_replicas": replicas, "max_ongoing_requests": max(4, int(options.get("max_running", 16)) * 2)}
    if router == "affinity":
        from .routing import AffinityRouter

        config["request_router_config"] = RequestRouterConfig(request_router_class=AffinityRouter, request_routing_stats_period_s=1.0)
    engines = EngineReplica.options(**config).bind(model, options)

    def ingress_app() -> Any:  # a plain function: Ray Serve calls it on the ingress replica
        return _ingress_app(model, model_name, keys_file, key_bounds or {})

    @serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0})  # parsing only: the replicas get the cores
    @serve.ingress(ingress_app)
    class Ingress:
        def __init__(self, engines: Any) -> None:  # bound so that the application deploys the replicas
            self.engines = engines

    return Ingress.bind(engines), engines


def run(model: str | None, model_name: str, options: dict[str, Any], *, replicas: int, host: str, port: int,
        keys_file: str | None = None, key_bounds: dict[str, int | None] | None = None, router: str = "affinity",
        blocking: bool = True) -> None:
    """Start Ray (the cluster ``RAY_ADDRESS`` names, or a local one) and the application."""
    import signal
    import sys

    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True)
    # SIGTERM (a service manager's stop) shuts the application and a local runtime down, as Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    serve.start(http_options={"host": host, "port": port})
    ingress, _ = build(model, model_name, options, replicas=replicas, keys_file=keys_file, key_bounds=key_bounds,
                       router=router)
    try:
        serve.run(ingress, name=APP_NAME, route_prefix="/", blocking=blocking)
    finally:
        if blocking:
            serve.shutdown()
            ray.shutdown()
