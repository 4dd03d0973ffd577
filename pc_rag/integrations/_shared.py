"""What the LangChain and LlamaIndex adapters share: the default engine and the reuse stats."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

from ..decode.request import Generation
from ..engine import PromptCache
from ..errors import PromptCacheError
from ..planner import scope
from ..prompt.documents import DEFAULT_SCHEMA, check_name, module_name, module_reference
from ..prompt.neighbours import DEFAULT_NEIGHBOURS, DocumentContext, NeighbourSearch, reorder
from ..prompt.pml import PML, is_pml_prompt

logger = logging.getLogger(__name__)

_engines: dict[tuple[str | None, str], PromptCache] = {}
_lock = threading.Lock()


def shared_engine(model: str | None = None, **model_kwargs: Any) -> PromptCache:
    """One engine per model (and ``from_pretrained`` arguments) per process: adapters built
    without ``engine=`` share it. Loading a model is the expensive part, and chains often build
    several LLM objects."""
    key = (model, repr(sorted(model_kwargs.items())))
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _engines[key] = PromptCache.from_pretrained(model, **model_kwargs)
        return engine


def model_name(engine: PromptCache) -> str:
    """The hub id, or the folder name of a local model (not its whole path)."""
    name = str(getattr(engine.model, "name_or_path", None) or getattr(engine.model.config, "_name_or_path", "") or "pc-rag")
    return os.path.basename(name.rstrip("/")) if os.path.isabs(name) else name


def generation_info(result: Generation, engine: PromptCache) -> dict[str, Any]:
    """Reuse statistics (``cached_tokens``, ``computed_tokens``, ``ttft_s``, ...) plus the finish reason."""
    info = result.stats.as_dict()
    info["finish_reason"] = result.finish_reason
    info["model_name"] = model_name(engine)
    return info


SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "use_cache", "seed",
                 "do_sample", "repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "stop_strings",
                 "generation_config", "json_schema", "presence_penalty", "frequency_penalty", "logit_bias")
_DEFAULTED = ("max_new_tokens", "temperature", "top_p", "top_k", "use_cache")  # fields every adapter has


def narrow(field: Sequence[str] | str | None, call: Sequence[str] | str | None) -> list[str] | None:
    """The collections a call may read: its own ``collections=`` within the adapter's field (None:
    no limit). A call can narrow what the adapter was built to read, never widen it."""
    allowed = [scope(x) for x in (field, call) if x is not None]
    if not allowed:
        return None
    return sorted(frozenset.intersection(*allowed))


def engine_kwargs(adapter: Any, kwargs: dict[str, Any], stop: list[str] | None, ignored: tuple[str, ...] = ()) -> dict[str, Any]:
    """``generate`` arguments: per-call ``kwargs`` over the adapter's fields; unknown names are an error.

    ``max_tokens`` (the LangChain/OpenAI name) is accepted for ``max_new_tokens``;
    ``collections`` narrows the adapter's (see :func:`narrow`).
    """
    kwargs = dict(kwargs)
    collections = narrow(getattr(adapter, "collections", None), kwargs.pop("collections", None))
    if "max_tokens" in kwargs:
        kwargs.setdefault("max_new_tokens", kwargs.pop("max_tokens"))
    # HuggingFacePipeline's output switches: pc-rag returns the completion alone, as they ask by default
    if kwargs.pop("skip_prompt", True) is not True or kwargs.pop("return_full_text", False) is not False:
        raise PromptCacheError("pc-rag returns the generated text without the prompt (skip_prompt=True, "
                               "return_full_text=False); prepend the prompt yourself if you need it")
    unknown = set(kwargs) - set(SAMPLING_KEYS) - set(ignored)
    if unknown:
        raise PromptCacheError(f"unknown generation arguments: {', '.join(sorted(unknown))} (known: {', '.join(SAMPLING_KEYS)})")
    params = {key: kwargs.get(key, getattr(adapter, key)) for key in _DEFAULTED}
    params["stop"] = stop
    if collections is not None:
        params["collections"] = collections
    for key in set(SAMPLING_KEYS) - set(_DEFAULTED):  # per call, else the adapter's field when it has one
        value = kwargs[key] if key in kwargs else getattr(adapter, key, None)
        if value is not None:
            params[key] = value
    return params


def check_document(result: Generation, engine: PromptCache, params: Mapping[str, Any]) -> None:
    """A constrained reply (``json_schema`` in ``params``) that the token budget ended before its
    document closed: a clear error, never half a document handed to a parser. Constrained
    decoding closes the document whenever the budget can hold it (:mod:`pc_rag.decode.constrained`), so
    this happens only when even the shortest document does not fit."""
    schema = params.get("json_schema")
    if schema is None or result.finish_reason != "length":
        return
    needed = engine.min_json_tokens(schema)
    raise PromptCacheError(
        f"the reply ended at its token budget (max_new_tokens={params.get('max_new_tokens')}, or the context window) "
        f"before its JSON document was complete: the shortest document of the schema takes "
        f"{needed if needed is not None else 'more than 512'} tokens; raise max_new_tokens (reply so far: {result.text!r:.80})")


def as_prompt(text: str, pml: bool) -> str:
    """What an adapter hands the engine: plain text, unless the adapter was built with ``pml=True``
    and the text is a PML prompt (a chain that sends markup says so; nothing it passes becomes
    markup otherwise)."""
    return PML(text) if pml and is_pml_prompt(text) else str(text)


def usage(result: Generation) -> dict[str, int]:
    """Token counts in the OpenAI shape that LlamaIndex's ``TokenCountingHandler`` reads from ``raw["usage"]``."""
    prompt = result.stats.cached_tokens + result.stats.computed_tokens
    completion = len(result.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "cached_tokens": result.stats.cached_tokens}


T = TypeVar("T")
_DONE = object()


async def iterate_in_thread(items: Iterator[T]) -> AsyncIterator[T]:
    """Iterate a blocking iterator (a stream being decoded) on a worker thread, handing each item
    to the event loop as it comes: the loop never waits on a forward pass. Stopping early (the
    consumer breaks or is cancelled) stops the worker after its current item and closes the
    iterator there, so the request's buffer goes back to the pool."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    stop = threading.Event()

    def work() -> None:
        try:
            for item in items:
                loop.call_soon_threadsafe(queue.put_nowait, item)
                if stop.is_set():
                    break
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()
            loop.call_soon_threadsafe(queue.put_nowait, _DONE)

    worker = threading.Thread(target=work, name="pc-rag-stream", daemon=True)
    worker.start()
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


# -- hits of a user's own retriever as modules ------------------------------------------------------
Encode = Literal["background", "eager", "off"]
ENCODE_MODES: tuple[str, ...] = ("background", "eager", "off")


def check_encode(encode: Any) -> Encode:
    if encode not in ENCODE_MODES:
        raise PromptCacheError(f"encode must be one of {', '.join(map(repr, ENCODE_MODES))}, got {encode!r}")
    return encode  # type: ignore[no-any-return]


def target_collection(collection: str | None, allowed: Sequence[str] | None) -> str:
    """The collection a wrapped retriever's hits become modules of: ``collection`` (which must be
    one the request may read), else the request's only collection, else the default one."""
    if collection is not None:
        check_name(collection, "collection name")
        if allowed is not None and collection not in allowed:
            raise PromptCacheError(f"this request may read collections {', '.join(allowed) or '(none)'}; "
                                   f"the retriever stores its documents in {collection!r}")
        return collection
    if allowed is None:
        return DEFAULT_SCHEMA
    if len(allowed) == 1:
        return allowed[0]
    raise PromptCacheError(f"this request may read {len(allowed)} collections ({', '.join(allowed)}): give the retriever "
                           "collection= to say which one its documents belong to")


def _held_text(engine: PromptCache, collection: str) -> Callable[[str], str | None]:
    """The text ``collection`` holds now under a name (None: not held; a PML schema holds none).
    Reads the registry's snapshot as it is: nothing per document of the collection per request."""
    schema = engine.schemas.get(collection)
    documents = schema.documents if schema is not None and schema.layout.documents else {}

    def text(name: str) -> str | None:
        record = documents.get(name)
        return record.text if record is not None else None

    return text


def as_modules(engine: PromptCache, collection: str, hits: Sequence[tuple[Any, str, Mapping[str, Any]]],
               encode: Encode, context: str | None = None, neighbours: int = DEFAULT_NEIGHBOURS,
               neighbour_search: NeighbourSearch | None = None) -> list[tuple[str, str | None]]:
    """``(module name, reference or None)`` for each hit ``(id, text, metadata)`` of a user's own
    retriever. A hit is named by its id (:func:`pc_rag.prompt.documents.module_name`), else by its text.
    The reference is set when ``collection`` holds exactly this text under that name (so an
    edited document is never served from its old KV); the others are encoded, ``"eager"`` now,
    ``"background"`` after the request (:mod:`pc_rag.background`), and read as text meanwhile,
    each behind its ``neighbours`` nearest documents by ``neighbour_search`` (the user's own
    store) when ``context`` is set. A document that cannot be encoded is logged and read as
    text: retrieval never fails for it."""
    names = [module_name(doc_id, text) for doc_id, text, _ in hits]
    held = _held_text(engine, collection)
    missing = {name: (text, dict(meta or {})) for name, (_, text, meta) in zip(names, hits) if text and held(name) != text}
    if missing and encode != "off":
        batches = [list(missing.items())]
        while batches:  # a document that cannot be encoded (too long, ...) leaves the others encoded
            batch = batches.pop()
            try:
                engine.add_documents([text for _, (text, _) in batch], ids=[name for name, _ in batch],
                                     metadatas=[meta for _, (_, meta) in batch], schema=collection, progress=False,
                                     replace_changed=True, background=encode == "background",
                                     **neighbour_options(context, neighbours, neighbour_search))
            except PromptCacheError as err:
                if len(batch) == 1:
                    logger.warning("retrieved document %r not stored in %r (read as text): %s", batch[0][0], collection, err)
                else:
                    batches.extend([batch[: len(batch) // 2], batch[len(batch) // 2 :]])
        if encode == "eager":
            held = _held_text(engine, collection)
    return [(name, module_reference(name, collection) if held(name) == text else None) for name, (_, text, _) in zip(names, hits)]


def neighbour_options(context: str | None, neighbours: int, search: NeighbourSearch | None) -> dict[str, Any]:
    """``add_documents`` arguments for documents of a user's store encoded behind their
    neighbours in that store (none without a context or a search)."""
    if context is None or search is None or not neighbours:
        return {}
    return {"context": context, "neighbours": neighbours, "neighbour_search": search}


def reordered(engine: PromptCache, items: Sequence[T], where: Callable[[T], tuple[str, str] | None]) -> list[T]:
    """``items`` (retrieved, best first) placed so that each document follows the neighbour it was
    encoded behind where the ranking allows (:func:`pc_rag.prompt.neighbours.reorder`); ``where`` gives
    an item's (collection, module), None for one the engine does not hold (it keeps its rank)."""
    keys = [where(item) for item in items]
    contexts: dict[Any, DocumentContext] = {}
    schemas = engine.registry.snapshot().schemas
    for key in keys:
        held = schemas.get(key[0]) if key is not None else None
        context = held.contexts.get(key[1]) if held is not None else None
        if context is not None:
            contexts[key] = DocumentContext(tuple((key[0], n) for n in context.names), context.token_ids, context.form)
    labels = [key if key is not None else ("", str(index)) for index, key in enumerate(keys)]
    if len(set(labels)) != len(labels):  # one document twice: the order stays as retrieved
        return list(items)
    position = {label: index for index, label in enumerate(labels)}
    return [items[position[label]] for label in reorder(labels, contexts)]
