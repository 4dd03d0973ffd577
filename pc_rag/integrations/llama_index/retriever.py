"""``PromptCacheRetriever``: nodes that are pre-encoded modules, over pc-rag's own index or any
LlamaIndex retriever; LlamaIndex's ``MetadataFilters`` as pc-rag filters (:func:`as_filter`)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.core.vector_stores.types import MetadataFilters

from ...engine import PromptCache
from ...errors import PromptCacheError
from ...prompt.documents import document_id, module_name, module_reference
from ...prompt.neighbours import DEFAULT_NEIGHBOURS, check_context
from ...retrievers.faiss_retriever import FaissModuleRetriever
from .._shared import (
    Encode,
    as_modules,
    check_encode,
    reordered,
    shared_engine,
    target_collection,
)

_OPERATORS = {"==": "$eq", "!=": "$ne", ">": "$gt", ">=": "$gte", "<": "$lt", "<=": "$lte", "in": "$in", "nin": "$nin"}


def as_filter(filters: Any) -> Any:
    """LlamaIndex's ``MetadataFilters`` as the filter :meth:`FaissModuleRetriever.search` takes
    (``==``, ``!=``, ``>``, ``>=``, ``<``, ``<=``, ``in``, ``nin``; ``and``/``or``, nested);
    anything else is passed on as it is (a dict of conditions or a callable)."""
    if not isinstance(filters, MetadataFilters):
        return filters
    parts = []
    for item in filters.filters:
        if isinstance(item, MetadataFilters):
            parts.append(as_filter(item))
            continue
        op = _OPERATORS.get(getattr(item.operator, "value", item.operator))
        if op is None:
            raise PromptCacheError(f"metadata filter on {item.key!r}: operator {item.operator!r} is not supported "
                                   f"(supported: {', '.join(_OPERATORS)})")
        parts.append({item.key: {op: item.value}})
    condition = getattr(filters.condition, "value", filters.condition) or "and"
    if condition not in ("and", "or"):
        raise PromptCacheError(f"metadata filters: condition {condition!r} is not supported (and, or)")
    return {f"${condition}": parts} if parts else None


class PromptCacheRetriever(BaseRetriever):
    """A LlamaIndex retriever whose nodes are pre-encoded modules, returning ``NodeWithScore``.

    Over pc-rag's own index (a :class:`~pc_rag.retrievers.FaissModuleRetriever`, the default:
    one over the shared default engine's documents), or over any LlamaIndex retriever the user
    already has: ``PromptCacheRetriever(index.as_retriever(similarity_top_k=4))`` for a
    ``VectorStoreIndex`` over any vector store. A node of a user's retriever becomes a module of
    ``collection`` named by its node id; one the engine has not encoded yet (or whose text changed
    under its id) is encoded ``encode="background"`` after the request (the default),
    ``"eager"`` before returning, or ``"off"`` never, and read as text until then; by default
    (``context="neighbours"``) each is encoded behind the ``neighbours`` nodes nearest to it by
    that retriever's own search, plus a plain copy a prompt reads where it comes first
    (``context=None``: alone).

    Nodes carry ``metadata["module"]`` and ``"schema"``; with ``references=True`` (default) the
    LLM rendering of a node the engine holds is a reference to its module, so the synthesizer's
    prompt imports the KV instead of the text. ``collections`` limits what is read; ``k`` and
    ``filter`` (LlamaIndex's ``MetadataFilters``, or the conditions of
    :func:`pc_rag.retrievers.metadata_filter`) apply to pc-rag's own index (a user's retriever
    keeps its own settings).
    """

    def __init__(self, retriever: Any = None, k: int = 4, *, engine: PromptCache | None = None, references: bool = True,
                 collections: Sequence[str] | None = None, collection: str | None = None, filter: Any = None,  # noqa: A002 - the name users know
                 encode: Encode = "background", reorder: bool = False, context: str | None = "neighbours",
                 neighbours: int = DEFAULT_NEIGHBOURS, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if engine is not None and not isinstance(engine, PromptCache):
            raise PromptCacheError(f"engine must be a pc_rag.PromptCache, got {type(engine).__name__}")
        if retriever is None:
            retriever = FaissModuleRetriever.from_engine(engine or shared_engine())
        if isinstance(retriever, FaissModuleRetriever):
            if engine is not None and retriever.engine is not None and retriever.engine is not engine:
                raise PromptCacheError("engine= is not the engine the FaissModuleRetriever is bound to")
            engine = engine or retriever.engine
        elif isinstance(retriever, BaseRetriever):
            if filter is not None or k != 4:
                raise PromptCacheError("k and filter apply to pc-rag's own index; set them on your retriever "
                                       "(e.g. index.as_retriever(similarity_top_k=4, filters=...))")
            engine = engine or shared_engine()
        else:
            raise PromptCacheError(f"retriever must be a LlamaIndex BaseRetriever or a pc_rag.retrievers.FaissModuleRetriever, "
                                   f"got {type(retriever).__name__}")
        if not isinstance(k, int) or k < 1:
            raise PromptCacheError(f"k must be a positive int, got {k!r}")
        self.retriever = retriever
        self.engine = engine
        self.k = k
        self.references = references
        self.collections = list(collections) if collections is not None else None
        self.collection = collection
        self.encode = check_encode(encode)
        # a user's retriever: each new node encoded behind its nearest nodes by that retriever
        # (searching by the node's text), a plain copy read where it comes first; None: alone
        self.context, self.neighbours = check_context(context, neighbours)
        # each node after the neighbour it was encoded behind, where the ranking allows (pc_rag.prompt.neighbours)
        self.reorder = bool(reorder)
        # metadata conditions, as FaissModuleRetriever.search takes them, or LlamaIndex's MetadataFilters
        self.filter = as_filter(filter)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        if isinstance(self.retriever, FaissModuleRetriever):
            hits = self.retriever.search(query_bundle.query_str, k=self.k, filter=self.filter, collections=self.collections)
            return self._ordered([self._node(hit.text, document_id(hit.module), hit.metadata, hit.module, hit.schema, True, hit.score)
                                  for hit in hits])
        return self._ordered(self._as_modules(self.retriever.retrieve(query_bundle)))

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        if isinstance(self.retriever, FaissModuleRetriever):
            return await asyncio.to_thread(self._retrieve, query_bundle)
        found = await self.retriever.aretrieve(query_bundle)
        return self._ordered(await asyncio.to_thread(self._as_modules, found))

    def _ordered(self, nodes: list[NodeWithScore]) -> list[NodeWithScore]:
        """``nodes`` as retrieved, or (``reorder=True``) each after the neighbour it was encoded behind."""
        if not self.reorder:
            return nodes
        return reordered(self.engine, nodes, lambda n: (n.node.metadata["schema"], n.node.metadata["module"]))

    def _as_modules(self, found: list[NodeWithScore]) -> list[NodeWithScore]:
        """A user's retriever's nodes, named as modules of the target collection (see :func:`as_modules`)."""
        collection = target_collection(self.collection, self.collections)
        hits = [(n.node.node_id, n.node.get_content(metadata_mode="none"), n.node.metadata) for n in found]
        modules = as_modules(self.engine, collection, hits, self.encode, self.context, self.neighbours, self._neighbour_search)
        return [self._node(text, node_id, metadata, name, collection, reference is not None, hit.score)
                for (node_id, text, metadata), (name, reference), hit in zip(hits, modules, found)]

    def _neighbour_search(self, text: str) -> list[tuple[str, str]]:
        """The user's nodes nearest to ``text``, nearest first, as ``(module name, text)``: its retriever's own search."""
        found = self.retriever.retrieve(QueryBundle(text))
        return [(module_name(n.node.node_id, content), content) for n in found if (content := n.node.get_content(metadata_mode="none"))]

    def _node(self, text: str, node_id: str, metadata: dict[str, Any], name: str, collection: str, held: bool,
              score: float | None) -> NodeWithScore:
        # "reference" is ours alone: one in a vector store's metadata was written by someone else
        metadata = {**{k: v for k, v in metadata.items() if k != "reference"}, "module": name, "schema": collection}
        reference = self.references and held
        node = TextNode(
            text=text,
            id_=node_id,
            metadata=metadata,
            # the LLM sees the reference (template below) and no metadata header; embedders see only the text
            excluded_llm_metadata_keys=[k for k in metadata if k != "module"] if reference else list(metadata),
            excluded_embed_metadata_keys=list(metadata),
        )
        if reference:
            # the template replaces the text only when the LLM rendering has metadata (``module``)
            node.text_template = module_reference(name, collection).replace("{", "{{").replace("}", "}}")
        return NodeWithScore(node=node, score=score)
