"""The registration half of :class:`pc_rag.PromptCache`'s public API: schemas, documents, and
the remote registry shared with other replicas. Every method hands its work to the
:class:`~pc_rag.registry.Registry` (or, for ``background=True``, to the background encoder)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from . import planner
from .background import BackgroundEncoder
from .errors import PromptCacheError
from .kv.remote import RemoteTier
from .kv.store import ModuleStore
from .prompt.documents import DEFAULT_SCHEMA, DocumentRecord, check_name, normalize
from .prompt.neighbours import DEFAULT_NEIGHBOURS, NeighbourIndex, NeighbourSearch, check_context, reorder, searched_neighbours
from .prompt.pml import PML
from .prompt.recurring import RecurringPassages, is_learned, learned_collection
from .registry import Registry
from .registry_snapshot import Schema
from .registry_sync import RegistrySync

logger = logging.getLogger(__name__)


class Registration:
    """Mixed into :class:`pc_rag.PromptCache`, which builds the parts named here."""

    registry: Registry
    background: BackgroundEncoder
    remote: RemoteTier | None
    registry_sync: RegistrySync | None
    store: ModuleStore
    remote_sync_interval_s: float | None
    _synced_at: float
    passages: RecurringPassages | None

    # -- registration ---------------------------------------------------------------------------
    def add_schema(self, pml: str, *, progress: bool = True) -> Schema:
        """Parse a schema and encode all its modules (loaded from ``kv_dir`` when present)."""
        return self.registry.add_schema(pml, progress=progress)

    def add_documents(self, texts: Sequence[Any], *, ids: Sequence[str] | None = None,
                      metadatas: Sequence[dict[str, Any] | None] | None = None, schema: str = DEFAULT_SCHEMA,
                      system: str | None = None, progress: bool = True, batch_tokens: int | None = None,
                      replace_changed: bool = False, background: bool = False, context: str | None = None,
                      neighbours: int | Mapping[str, Sequence[str]] = DEFAULT_NEIGHBOURS, embedding: Any = None,
                      neighbour_search: NeighbourSearch | None = None) -> list[str]:
        """Store documents as movable modules of the document schema ``schema``; return their names.

        ``texts`` holds strings, LangChain ``Document``s or LlamaIndex nodes. A document's name is
        its id (``ids``, or the Document/node id when that is a valid module name), otherwise one
        derived from its text, so adding the same text twice stores it once. Documents are
        encoded behind the schema's system prompt (``system``; fixed when the schema is created),
        several per forward pass (up to ``batch_tokens`` padded tokens; by default 512 on CPU,
        where a 2-core machine is compute-bound at batch 1 and padding only adds work, and 8192
        on accelerators), and persisted through ``kv_dir``. A prompt places the documents it
        imports one after another, right after the system turn and the user marker, at the
        positions full prefill would give them.

        An id that already holds another text is an error, unless ``replace_changed=True``: then
        the old document is deleted (:meth:`delete_documents`) and the new text stored under the id.

        ``background=True`` returns the names at once and encodes the documents later (after the
        request being served, then in turns with the requests, taking ``encode_share`` of the
        model while they run: :mod:`pc_rag.background`).
        Until a document is encoded, a prompt reads it as text. :meth:`wait_for_documents`
        waits for the queue.

        ``context="neighbours"`` encodes each new document behind the texts of the ``neighbours``
        documents it is most likely to be retrieved with (:mod:`pc_rag.prompt.neighbours`): the nearest
        ones of the collection (held, or added in this call) by ``embedding`` (a sentence-transformers
        model or its name, or a LangChain ``Embeddings``; default: the retriever's default model),
        the farthest first; ``"neighbour_sentences"`` behind their first sentences only. A prompt
        reads such a document more as full prefill would (encoding costs about ``neighbours + 1``
        times as much, once); storage does not grow. ``neighbours`` may instead map each new
        document's id to the ids it is to be encoded behind, in order (your own choice: what a
        retriever returns together). Documents added later are encoded against the collection
        as it is then; to encode a corpus that changed a lot against itself again, delete and
        add it again (:meth:`reencode_documents`). ``neighbour_search`` finds the neighbours in a
        store of your own instead (:data:`~pc_rag.prompt.neighbours.NeighbourSearch`: a vector
        store's similarity search by the document's text); a search that fails leaves the
        documents plain, never unencoded. With ``background=True`` the neighbours are found and
        encoded in the background too.
        """
        check_context(context, neighbours if isinstance(neighbours, int) else 0)
        if isinstance(schema, str) and is_learned(schema):  # what the engine learns from prompts (learn_passages=)
            raise PromptCacheError(f"invalid schema name {schema!r}: names starting with '_learned' hold learned passages")
        if context is not None and not isinstance(neighbours, (int, Mapping)):
            raise PromptCacheError(f"neighbours must be an int or a mapping of document ids to neighbour ids, got {type(neighbours).__name__}")
        if neighbour_search is not None and (not callable(neighbour_search) or not isinstance(neighbours, int)):
            raise PromptCacheError("neighbour_search must be a callable (text -> [(name, text), ...], nearest first), "
                                   "with neighbours= the number to keep")
        records = normalize(texts, ids, metadatas)
        options = {"context": context, "neighbours": neighbours, "embedding": embedding, "neighbour_search": neighbour_search}
        if background:
            check_name(schema, "schema name")
            self.registry.check_documents_fit(records, schema)  # refused now, not dropped later in the background
            self.background.submit(schema, system, records, replace_changed=replace_changed, options=options)
            return [record.name for record in records]
        return self._add_records(records, schema=schema, system=system, progress=progress, batch_tokens=batch_tokens,
                                 replace_changed=replace_changed, **options)

    # -- passages learned from plain prompts (pc_rag.prompt.recurring) ----------------------------
    def _with_learned(self, scope: frozenset[str] | None) -> frozenset[str] | None:
        """A request's scope with the collection of the passages learned under it."""
        return scope if scope is None or self.passages is None else scope | {learned_collection(scope)}

    def _learn_from(self, prompt: str, scope: frozenset[str] | None) -> None:
        """Count the passages ``prompt`` computes; queue those seen often enough as documents of the
        scope's learned collection (after every caller's). Never fails the request it came with."""
        if isinstance(prompt, PML) or self.passages is None:
            return
        collection = learned_collection(scope)
        view = planner.visible(self.registry.snapshot(), self._with_learned(scope))
        fresh = [text for text in self.passages.passages(prompt)
                 if not any(m.start == 0 and m.end == len(text) for m in view.index.find(text, view.schemas))]
        due = self.passages.sighted(collection, fresh)
        if not due:
            return
        try:
            queued = [record.name for record in normalize(due) if self.background.submit(collection, None, [record], behind=True)]
            if old := self.passages.keep(collection, queued):  # (one queued before and not encoded yet: not again)
                self.delete_documents(old, schema=collection)
        except PromptCacheError as err:  # a closed queue, a registry that refuses the collection
            logger.warning("passages of a prompt not learned: %s", err)
        else:
            logger.debug("learning %d passages into %r", len(queued), collection)

    def _add_records(self, records: list[DocumentRecord], *, context: str | None = None,
                     neighbours: int | Mapping[str, Sequence[str]] = DEFAULT_NEIGHBOURS, embedding: Any = None,
                     neighbour_search: NeighbourSearch | None = None, **kwargs: Any) -> list[str]:
        """:meth:`add_documents` now (the background encoder calls it too): with a neighbour
        context when one is asked for, else plain."""
        if context is not None and neighbours:
            return self._add_with_neighbours(records, context=context, neighbours=neighbours, embedding=embedding,
                                             neighbour_search=neighbour_search, **kwargs)
        return self.registry.add_documents(records, **kwargs)

    def _add_with_neighbours(self, records: list[DocumentRecord], *, schema: str, context: str,
                             neighbours: int | Mapping[str, Sequence[str]], embedding: Any,
                             neighbour_search: NeighbourSearch | None = None, **kwargs: Any) -> list[str]:
        """:meth:`add_documents` with a neighbour context: each new document's neighbours found
        (by embedding, by ``neighbour_search``, or as given), then the registry encodes it behind them."""
        check_name(schema, "schema name")
        named = {record.name: record.text for record in records}
        if neighbour_search is not None:
            chosen, texts = searched_neighbours(records, neighbours, neighbour_search)  # type: ignore[arg-type]
            return self.registry.add_documents(records, schema=schema, context=context, neighbours_of=chosen, context_texts=texts, **kwargs)
        if isinstance(neighbours, Mapping):
            unknown = [n for n in neighbours if n not in named]
            if unknown:
                raise PromptCacheError(f"neighbours names {unknown[0]!r}, which is not among the documents added")
            chosen = {n: list(v) for n, v in neighbours.items()}
        else:
            held = self.registry.snapshot().schemas.get(schema)
            index = self._neighbour_index(schema, embedding)
            documents = held.documents if held is not None and held.layout.documents else {}
            with index.lock:
                index.forget([n for n in index.names if n not in documents and n not in named])  # deleted since: never a neighbour
                index.add({n: r.text for n, r in documents.items() if n not in named})
                index.add(named)  # only texts new to it are embedded (a text replaced under its id: again)
                chosen = index.neighbours(list(named), neighbours)
        return self.registry.add_documents(records, schema=schema, context=context, neighbours_of=chosen, **kwargs)

    def _neighbour_index(self, schema: str, embedding: Any) -> NeighbourIndex:
        """The embeddings of collection ``schema``'s documents under ``embedding`` (kept per
        collection and embedding model; documents deleted leave it)."""
        from .embedding import embed_texts, load_embedder

        indexes = self.__dict__.setdefault("_neighbour_indexes", {})
        # a model given by name (or the default) is loaded once; a model object is its own key
        key = (schema, embedding if embedding is None or isinstance(embedding, str) else id(embedding))
        index = indexes.get(key)
        if index is None:
            model, _ = load_embedder(embedding)
            index = indexes[key] = NeighbourIndex(lambda texts: embed_texts(model, texts))
        return index

    def reorder_documents(self, names: Sequence[str], *, schema: str = DEFAULT_SCHEMA) -> list[str]:
        """``names`` (retrieved documents of ``schema``, best first) placed so that each follows the
        neighbour it was encoded behind where the ranking allows (:func:`pc_rag.prompt.neighbours.reorder`):
        ``build_prompt(question, names, reorder=True, engine=engine)`` does it for you."""
        held = self.registry.snapshot().schemas.get(schema)
        return reorder(list(names), held.contexts if held is not None else {})

    def reencode_documents(self, *, schema: str = DEFAULT_SCHEMA, context: str = "neighbours", neighbours: int = DEFAULT_NEIGHBOURS,
                           embedding: Any = None, progress: bool = True) -> list[str]:
        """Encode every document of collection ``schema`` again against the collection as it is
        now (after it changed a lot: documents added later found only the earlier ones as
        neighbours, and the early ones never saw the later): each one deleted and added again
        with ``context``/``neighbours``, ids, texts and metadata kept. Returns their names."""
        check_context(context, neighbours)
        held = self.registry.snapshot().schemas.get(schema)
        if held is None or not held.layout.documents:
            raise PromptCacheError(f"no document collection {schema!r}")
        records = list(held.documents.values())
        self.registry.delete_documents([r.name for r in records], schema=schema)
        return self.add_documents(records, schema=schema, context=context, neighbours=neighbours, embedding=embedding, progress=progress)

    def wait_for_documents(self, timeout: float | None = None) -> bool:
        """Encode the documents queued by ``add_documents(background=True)`` now (in turns with the
        requests being served) and wait for them; False if ``timeout`` seconds passed first."""
        return self.background.join(timeout)

    def delete_documents(self, names: str | Sequence[str], *, schema: str = DEFAULT_SCHEMA) -> list[str]:
        """Remove documents (by name, i.e. id) from collection ``schema`` everywhere they live: the
        registry and the drop-in index (no request planned from now on imports or matches them),
        memory, ``kv_dir``, the remote tier's KV and registry (other replicas drop them at their
        next sync), and every :class:`~pc_rag.retrievers.FaissModuleRetriever` bound to this
        engine; a document queued by ``add_documents(background=True)`` leaves the queue, this
        replica's or, with a remote tier, any replica's (one being encoded is deleted as its encoding ends). Returns the names removed; names the collection
        does not hold are ignored. A request planned before the call finishes on the KV it was planned with."""
        names = [names] if isinstance(names, str) else list(names)
        queued = self.background.remove(schema, names)
        removed = self.registry.delete_documents(names, schema=schema)
        if self.remote is not None and set(names) - set(queued) - set(removed) and self.sync_documents():
            removed += self.registry.delete_documents(names, schema=schema)  # encoded by another replica since this one's last sync
        return [name for name in dict.fromkeys(names) if name in queued or name in removed]

    def sync_documents(self) -> int:
        """Take in the documents, deletions and PML schemas that other processes published to the
        remote tier (run at start, when a prompt names a module or schema this process does not
        know, and before a request once ``remote_sync_interval_s`` has passed); their KV stays
        remote until a prompt needs it. Returns the number of documents and schemas changed here
        (0 without a remote tier)."""
        self._synced_at = time.monotonic()
        return self.registry_sync.sync() if self.registry_sync is not None else 0

    def remote_backlog(self) -> int:
        """Module entries and registry records the remote tier has not taken yet (the registry's
        are sent again first): 0 means everything this engine stored is shared. An encoding job
        checks it before reporting success."""
        if self.remote is None:
            return 0
        return (self.registry_sync.flush_unpublished() if self.registry_sync is not None else 0) + self.store.write_back()

    def sync_if_due(self) -> None:
        """:meth:`sync_documents` when ``remote_sync_interval_s`` has passed since the last one
        (before every request and retriever search): deletions and additions by other replicas
        reach this one within the interval. A sync another thread is running is not waited for."""
        interval = self.remote_sync_interval_s
        if self.remote is not None and interval is not None and time.monotonic() - self._synced_at >= interval:
            self._synced_at = time.monotonic()
            self.registry_sync.sync(wait=False)  # type: ignore[union-attr]
