"""``PromptCacheRetriever``: search hits as documents that name pre-encoded modules, and
``format_modules``, which writes them into a prompt as references."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Literal

from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.vectorstores import VectorStore
from pydantic import ConfigDict, Field

from ...engine import PromptCache
from ...errors import PromptCacheError
from ...prompt.documents import document_id, is_reference, module_name, module_reference
from ...prompt.neighbours import DEFAULT_NEIGHBOURS, MAX_NEIGHBOURS
from ...retrievers.faiss_retriever import FaissModuleRetriever
from .._shared import (
    as_modules,
    check_encode,
    narrow,
    reordered,
    shared_engine,
    target_collection,
)
from .base import scoped


class PromptCacheRetriever(BaseRetriever):
    """A LangChain retriever whose documents are pre-encoded modules.

    Over pc-rag's own index (a :class:`~pc_rag.retrievers.FaissModuleRetriever`, the default:
    one over the shared default engine's documents), or over any LangChain retriever the user
    already has: ``PromptCacheRetriever(retriever=chroma.as_retriever())`` or
    :meth:`from_vectorstore`. A hit of a user's retriever becomes a module of ``collection``,
    named by its id (else by its text); one the engine has not encoded yet (or whose text changed
    under its id) is encoded ``encode="background"`` after the request (the default: a first
    request is never slower than full prefill, the next reuses it), ``"eager"`` before returning,
    or ``"off"`` never, and read as text until then.

    Returned documents carry ``metadata["module"]``, ``"schema"`` and, for every document the
    engine holds, ``"reference"`` (a genuine module reference: what :func:`format_modules` puts
    into the prompt); pc-rag's index adds ``"score"``. ``collections`` limits what a request may
    read (per call: ``config={"configurable": {"collections": [...]}}``, which narrows it, never
    widens it).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: Any = Field(default=None, exclude=True)
    """A :class:`~pc_rag.retrievers.FaissModuleRetriever` or any LangChain ``BaseRetriever``;
    by default pc-rag's index over the shared default engine's documents."""
    engine: Any = Field(default=None, exclude=True)
    """The :class:`~pc_rag.PromptCache` whose store holds the modules: the FAISS index's own
    engine, else the shared default engine."""
    k: int = Field(default=4, ge=1)
    """pc-rag's index: how many documents to return (``search_kwargs["k"]`` and a per-call ``k`` win)."""
    search_kwargs: dict[str, Any] = Field(default_factory=dict)
    """pc-rag's index: ``k`` and ``filter`` (a dict of metadata conditions: ``{"source": "a"}``,
    ``{"year": {"$gte": 2020}}``, ``$in``/``$nin``/``$ne``/``$lt``..., ``$and``/``$or``; or a
    callable over the metadata). A user's retriever keeps its own search settings."""
    collections: list[str] | None = None
    """The collections this retriever's requests may read (None: all of them)."""
    collection: str | None = None
    """A user's retriever: the collection its hits become modules of (default: the request's only
    collection, else ``"docs"``)."""
    encode: Literal["background", "eager", "off"] = "background"
    """A user's retriever: when hits the engine has not encoded are encoded (see the class docstring)."""
    context: Literal["neighbours", "neighbour_sentences"] | None = "neighbours"
    """A user's retriever: each hit it returns is encoded behind the ``neighbours`` documents
    nearest to it in the same store (its vector store's similarity search by the hit's text,
    else the retriever itself), whole (``"neighbours"``) or their first sentences; a prompt that
    places it first reads a plain copy. ``None``: each hit encoded alone (pc_rag.prompt.neighbours)."""
    neighbours: int = Field(default=DEFAULT_NEIGHBOURS, ge=0, le=MAX_NEIGHBOURS)
    """How many neighbours a hit is encoded behind (0: none)."""
    reorder: bool = False
    """Place each returned document after the neighbour it was encoded behind where the ranking
    allows (documents added with ``context="neighbours"``; :func:`pc_rag.prompt.neighbours.reorder`),
    as LangChain's ``LongContextReorder`` reorders: more of the prompt reads as full prefill."""

    def model_post_init(self, context: Any) -> None:
        if self.engine is not None and not isinstance(self.engine, PromptCache):
            raise PromptCacheError(f"engine must be a pc_rag.PromptCache, got {type(self.engine).__name__}")
        if self.retriever is None:
            self.retriever = FaissModuleRetriever.from_engine(self.engine or shared_engine())
        if isinstance(self.retriever, FaissModuleRetriever):
            if self.engine is not None and self.retriever.engine is not None and self.retriever.engine is not self.engine:
                raise PromptCacheError("engine= is not the engine the FaissModuleRetriever is bound to")
            self.engine = self.engine or self.retriever.engine
            unknown = set(self.search_kwargs) - {"k", "filter"}
            if unknown:
                raise PromptCacheError(f"unknown search_kwargs: {', '.join(sorted(unknown))} (known: k, filter)")
        elif isinstance(self.retriever, BaseRetriever):
            if self.search_kwargs or "k" in self.model_fields_set:
                raise PromptCacheError("k and search_kwargs apply to pc-rag's own index; set them on your retriever "
                                       "(e.g. vectorstore.as_retriever(search_kwargs={'k': 4}))")
            self.engine = self.engine or shared_engine()
        else:
            raise PromptCacheError(f"retriever must be a LangChain BaseRetriever or a pc_rag.retrievers.FaissModuleRetriever, "
                                   f"got {type(self.retriever).__name__}")
        check_encode(self.encode)

    @classmethod
    def from_vectorstore(cls, vectorstore: VectorStore, *, engine: PromptCache | None = None, collection: str | None = None,
                         collections: list[str] | None = None, encode: Literal["background", "eager", "off"] = "background",
                         context: Literal["neighbours", "neighbour_sentences"] | None = "neighbours", neighbours: int = DEFAULT_NEIGHBOURS,
                         **search_kwargs: Any) -> "PromptCacheRetriever":
        """Over any LangChain ``VectorStore`` (Chroma, FAISS, Qdrant, pgvector, ...): ``search_kwargs``
        go to ``vectorstore.as_retriever`` as you would write them there (``search_type="mmr"``,
        ``search_kwargs={"k": 4, "filter": {...}}``); ``k``, ``filter`` and ``fetch_k`` given
        directly are put into its ``search_kwargs``. ``context``/``neighbours``: the hits' neighbour
        context, found in this vector store (see the fields)."""
        if not isinstance(vectorstore, VectorStore):
            raise PromptCacheError(f"from_vectorstore takes a LangChain VectorStore, got {type(vectorstore).__name__}")
        inner = dict(search_kwargs.pop("search_kwargs", None) or {})
        for key in ("k", "filter", "fetch_k", "lambda_mult", "score_threshold"):
            if key in search_kwargs:
                inner[key] = search_kwargs.pop(key)
        retriever = vectorstore.as_retriever(search_kwargs=inner, **search_kwargs)
        return cls(retriever=retriever, engine=engine, collection=collection, collections=collections, encode=encode,
                   context=context, neighbours=neighbours)

    def invoke(self, input: str, config: Any = None, **kwargs: Any) -> list[Document]:  # noqa: A002 - LangChain's name
        return super().invoke(input, config, **scoped(config, kwargs))

    async def ainvoke(self, input: str, config: Any = None, **kwargs: Any) -> list[Document]:  # noqa: A002
        return await super().ainvoke(input, config, **scoped(config, kwargs))

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        allowed = narrow(self.collections, kwargs.pop("collections", None))
        if isinstance(self.retriever, FaissModuleRetriever):
            return self._ordered(self._search_index(query, allowed, kwargs))
        collection = target_collection(self.collection, allowed)
        found = self.retriever.invoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)
        return self._ordered(self._as_modules(found, collection))

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        allowed = narrow(self.collections, kwargs.pop("collections", None))
        if isinstance(self.retriever, FaissModuleRetriever):
            return self._ordered(await asyncio.to_thread(self._search_index, query, allowed, kwargs))
        collection = target_collection(self.collection, allowed)
        found = await self.retriever.ainvoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)
        return self._ordered(await asyncio.to_thread(self._as_modules, found, collection))

    def _ordered(self, docs: list[Document]) -> list[Document]:
        """``docs`` as returned, or (``reorder=True``) each after the neighbour it was encoded behind."""
        if not self.reorder:
            return docs
        return reordered(self.engine, docs, lambda d: (d.metadata["schema"], d.metadata["module"]) if "reference" in d.metadata else None)

    def _as_modules(self, found: list[Document], collection: str) -> list[Document]:
        """A user's retriever's documents, named as modules of ``collection`` (see :func:`as_modules`)."""
        modules = as_modules(self.engine, collection, [(d.id, d.page_content, d.metadata) for d in found], self.encode,
                             self.context, self.neighbours, self._neighbour_search)
        out = []
        for doc, (name, reference) in zip(found, modules):
            # "reference" is ours alone: one in a vector store's metadata was written by someone else
            metadata = {key: value for key, value in (doc.metadata or {}).items() if key != "reference"}
            metadata.update(module=name, schema=collection)
            if reference is not None:
                metadata["reference"] = reference
            out.append(Document(page_content=doc.page_content, metadata=metadata, id=doc.id))
        return out

    def _neighbour_search(self, text: str) -> list[tuple[str, str]]:
        """The user's documents nearest to ``text``, nearest first, as ``(module name, text)``:
        its vector store's similarity search (under the retriever's filter), else its retriever."""
        store = getattr(self.retriever, "vectorstore", None)
        if isinstance(store, VectorStore):
            where = {"filter": self.retriever.search_kwargs["filter"]} if "filter" in (self.retriever.search_kwargs or {}) else {}
            found = store.similarity_search(text, k=self.neighbours + 1, **where)
        else:
            found = self.retriever.invoke(text)
        return [(module_name(d.id, d.page_content), d.page_content) for d in found]

    def _search_index(self, query: str, allowed: list[str] | None, kwargs: dict[str, Any]) -> list[Document]:
        unknown = set(kwargs) - {"k", "filter"}
        if unknown:
            raise PromptCacheError(f"unknown retriever arguments: {', '.join(sorted(unknown))} (known: k, filter, collections)")
        search = {"k": self.k, **self.search_kwargs, **kwargs}
        hits = self.retriever.search(query, k=search["k"], filter=search.get("filter"), collections=allowed)
        return [
            Document(
                page_content=hit.text,
                metadata={**hit.metadata, "module": hit.module, "schema": hit.schema, "score": hit.score,
                          "reference": module_reference(hit.module, hit.schema)},
                id=document_id(hit.module),
            )
            for hit in hits
        ]


def format_modules(docs: Sequence[Document]) -> str:
    """The retrieved documents as module references, one paragraph each, for a prompt template.

    Only a genuine reference becomes an import: ``metadata["reference"]`` as
    :class:`PromptCacheRetriever` sets it (a tag made with this process's secret for exactly
    that collection and module). Metadata is written by whoever wrote the documents (a vector
    store, another retriever, a user), so a ``metadata["module"]`` or ``"schema"`` alone names
    nothing: such documents, and those from other retrievers, are written as their text, which
    the engine still reuses if it holds that text verbatim (drop-in) in a collection the request
    may read.
    """
    parts = []
    for doc in docs:
        reference = (doc.metadata or {}).get("reference")
        parts.append(reference if is_reference(reference) else doc.page_content)
    return "\n\n".join(parts)
