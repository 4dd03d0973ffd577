"""``FaissModuleRetriever``: semantic search whose hits are pre-encoded document modules.

A FAISS inner-product index over L2-normalised sentence-transformers embeddings (so scores are
cosine similarities). Each row is one document module of an engine's document schema; a hit
carries the module name a prompt imports, plus the text and metadata for display.
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..atomic import atomic_write
from ..embedding import embed_texts, load_embedder, normalised
from ..errors import PromptCacheError
from ..planner import scope
from ..prompt.documents import DEFAULT_SCHEMA, check_name, normalize
from ..prompt.neighbours import DEFAULT_NEIGHBOURS, check_context, nearest

if TYPE_CHECKING:
    from ..engine import PromptCache

logger = logging.getLogger(__name__)

_FORMAT = 2  # 2: stable ids, a collection per record


@dataclass(frozen=True)
class Hit:
    """One search result: the module to import, its cosine score, text and metadata."""

    module: str
    score: float
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    schema: str = DEFAULT_SCHEMA


def metadata_filter(spec: Mapping[str, Any] | Callable[[dict[str, Any]], bool] | None) -> Callable[[dict[str, Any]], bool]:
    """A predicate over a document's metadata from a filter as LangChain and Chroma users write
    it: ``{"key": value}`` (equal), ``{"key": {"$in": [...]}}`` with ``$eq``, ``$ne``, ``$in``,
    ``$nin``, ``$gt``, ``$gte``, ``$lt``, ``$lte``; ``{"$and": [...]}``, ``{"$or": [...]}``;
    or any callable taking the metadata dict. Anything else is a PromptCacheError."""
    if spec is None:
        return lambda metadata: True
    if callable(spec):
        return lambda metadata: bool(spec(metadata))  # type: ignore[operator]
    if not isinstance(spec, Mapping):
        raise PromptCacheError(f"filter must be a dict of metadata conditions or a callable, got {type(spec).__name__}")
    tests: list[Callable[[dict[str, Any]], bool]] = []
    for key, condition in spec.items():
        if key in ("$and", "$or"):
            if not isinstance(condition, (list, tuple)) or not condition:
                raise PromptCacheError(f"filter {key} takes a non-empty list of filters, got {condition!r}")
            tests.append(partial(_combined, all if key == "$and" else any, [metadata_filter(c) for c in condition]))
        elif isinstance(condition, Mapping):
            for op, operand in condition.items():
                tests.append(_condition(key, op, operand))
        else:
            tests.append(_condition(key, "$eq", condition))
    return lambda metadata: all(test(metadata) for test in tests)


def _combined(combine: Callable[[Any], bool], parts: list[Callable[[dict[str, Any]], bool]], metadata: dict[str, Any]) -> bool:
    return combine(part(metadata) for part in parts)


_MISSING = object()
_OPERATORS: dict[str, Callable[[Any, Any], bool]] = {
    "$eq": operator.eq, "$ne": operator.ne, "$gt": operator.gt, "$gte": operator.ge, "$lt": operator.lt, "$lte": operator.le,
    "$in": lambda value, options: value in options, "$nin": lambda value, options: value not in options,
}


def _condition(key: str, op: str, operand: Any) -> Callable[[dict[str, Any]], bool]:
    """One condition on metadata ``key``; a document without the key passes only ``$ne`` and ``$nin``."""
    compare = _OPERATORS.get(op)
    if compare is None:
        raise PromptCacheError(f"filter {key!r}: unknown operator {op!r} (known: {' '.join(_OPERATORS)})")
    if op in ("$in", "$nin") and not isinstance(operand, (list, tuple, set, frozenset)):
        raise PromptCacheError(f"filter {key!r}: {op} takes a list, got {operand!r}")

    def test(metadata: dict[str, Any]) -> bool:
        value = metadata.get(key, _MISSING)
        if value is _MISSING:
            return op in ("$ne", "$nin")
        try:
            return bool(compare(value, operand))
        except TypeError:  # not comparable (a str against a number): not a match
            return False

    return test


@dataclass
class _Record:
    schema: str
    name: str
    text: str
    metadata: dict[str, Any]


class FaissModuleRetriever:
    """Maps a query to the document modules most similar to it.

    Bound to an engine (``engine=`` or :meth:`from_engine`), :meth:`add` stores new documents in
    the engine (encoding their KV) and indexes them in one call, and documents the engine
    deletes (here or on another replica) leave the index; unbound, it only indexes. One index
    may hold several collections (``schema=`` on :meth:`add`); :meth:`search` reads the ones a
    request may read (``collections=``) and the documents whose metadata passes ``filter``.
    """

    def __init__(self, embedding: Any = None, *, engine: "PromptCache | None" = None, schema: str = DEFAULT_SCHEMA) -> None:
        import faiss

        self.embedder, self.embedding_name = load_embedder(embedding)
        if hasattr(self.embedder, "embed_query"):
            self.dimension = len(self.embedder.embed_query("dimension"))
        else:
            dimension = getattr(self.embedder, "get_embedding_dimension", None) or self.embedder.get_sentence_embedding_dimension
            self.dimension = int(dimension())
        # stable ids (IndexIDMap2): a deleted row leaves the others where they are
        self.index = faiss.IndexIDMap2(faiss.IndexFlatIP(self.dimension))
        self.engine = engine
        self.schema = schema
        self._records: dict[int, _Record] = {}  # id -> record, in insertion order
        self._ids: dict[tuple[str, str], int] = {}  # (schema, name) -> id
        self._next_id = 0
        self._lock = threading.Lock()
        if engine is not None:
            engine.registry.watch(self)

    @classmethod
    def from_engine(cls, engine: "PromptCache", *, schema: str = DEFAULT_SCHEMA, embedding: Any = None) -> "FaissModuleRetriever":
        """Index every document the engine holds in ``schema`` (an empty index if there are none yet)."""
        retriever = cls(embedding, engine=engine, schema=schema)
        held = engine.schemas.get(schema)
        if held is not None:
            if not held.layout.documents:
                raise PromptCacheError(f"schema {schema!r} is a PML schema, not a document collection")
            retriever._index_records(schema, [(r.name, r.text, r.metadata) for r in held.documents.values()], progress=True)
        return retriever

    def __len__(self) -> int:
        return len(self._records)

    @property
    def names(self) -> list[str]:
        """The module names indexed, in the order they were added."""
        return [r.name for r in self._records.values()]

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self._records.values()]

    @property
    def metadatas(self) -> list[dict[str, Any]]:
        return [r.metadata for r in self._records.values()]

    # -----------------------------------------------------------------------------------------
    def add(
        self,
        texts: Sequence[Any],
        *,
        ids: Sequence[str] | None = None,
        metadatas: Sequence[dict[str, Any] | None] | None = None,
        progress: bool = True,
        schema: str | None = None,
        replace_changed: bool = False,
        context: str | None = "neighbours",
        neighbours: int = DEFAULT_NEIGHBOURS,
    ) -> list[str]:
        """Add documents (str, LangChain Documents, LlamaIndex nodes) to collection ``schema``
        (default: the retriever's); returns their module names.

        Documents already indexed are skipped, so calling it again with a grown corpus only
        embeds (and, when bound to an engine, encodes) the new ones. A name that holds another
        text or metadata is an error, or, with ``replace_changed=True``, replaced (see
        :meth:`pc_rag.PromptCache.add_documents`). ``context="neighbours"`` (the default, bound to an
        engine): each new document is encoded behind its ``neighbours`` nearest documents of the
        collection by this index's embeddings, the ones a search returns with it, and plain for a
        prompt that places it first (:mod:`pc_rag.prompt.neighbours`); ``None``: each alone. An
        index with no engine encodes nothing, so ``context`` does not apply to it.
        """
        check_context(context, neighbours)
        schema = check_name(schema if schema is not None else self.schema, "schema name")
        records = normalize(texts, ids, metadatas)
        names = [record.name for record in records]
        embedded: dict[str, np.ndarray] = {}
        if self.engine is not None:
            chosen: dict[str, list[str]] | int = 0
            if context is not None and neighbours:
                chosen, embedded = self._neighbours(schema, {r.name: r.text for r in records}, neighbours)
            names = self.engine.add_documents(records, schema=schema, progress=progress, replace_changed=replace_changed,
                                              context=context if chosen else None, neighbours=chosen)
        elif replace_changed:
            with self._lock:
                held = {n: self._records[self._ids[(schema, n)]] for n in names if (schema, n) in self._ids}
            self.forget(schema, [r.name for r in records if r.name in held and (held[r.name].text, held[r.name].metadata) != (r.text, r.metadata)])
        self._index_records(schema, [(r.name, r.text, r.metadata) for r in records], progress, embedded)
        return names

    def _neighbours(self, schema: str, named: dict[str, str], k: int) -> tuple[dict[str, list[str]], dict[str, np.ndarray]]:
        """Each new document's ``k`` nearest documents of ``schema`` (held here or among ``named``)
        by this index's embeddings, the farthest first; and the new documents' vectors."""
        new = {n: t for n, t in named.items() if (schema, n) not in self._ids}
        vectors = self._embed(list(new.values())) if new else np.zeros((0, self.dimension), dtype=np.float32)
        with self._lock:
            held = [(row, r.name) for row, r in self._records.items() if r.schema == schema and r.name not in new]
            corpus = np.concatenate([np.stack([self.index.reconstruct(row) for row, _ in held]) if held else
                                     np.zeros((0, self.dimension), dtype=np.float32), vectors])
        names = [name for _, name in held] + list(new)
        found = nearest(vectors, corpus, k, exclude=list(range(len(held), len(names))))
        return {name: [names[i] for i in reversed(hits)] for name, hits in zip(new, found)}, dict(zip(new, vectors))

    def _index_records(self, schema: str, records: list[tuple[str, str, dict[str, Any]]], progress: bool,
                       embedded: Mapping[str, np.ndarray] | None = None) -> None:
        fresh: dict[str, tuple[str, dict[str, Any]]] = {}
        for name, text, meta in records:
            if (schema, name) not in self._ids and name not in fresh:
                fresh[name] = (text, dict(meta))
        if not fresh:
            return
        if embedded and all(name in embedded for name in fresh):  # embedded already to find their neighbours
            vectors = np.stack([embedded[name] for name in fresh])
        else:
            vectors = self._embed([text for text, _ in fresh.values()], progress and len(fresh) > 32)
        with self._lock:
            ids = np.arange(self._next_id, self._next_id + len(fresh), dtype=np.int64)
            self._next_id += len(fresh)
            self.index.add_with_ids(vectors, ids)
            for row, (name, (text, meta)) in zip(ids.tolist(), fresh.items()):
                self._records[row] = _Record(schema, name, text, meta)
                self._ids[(schema, name)] = row
        logger.info("indexed %d documents (%d in all)", len(fresh), len(self._records))

    def delete(self, names: str | Sequence[str], *, schema: str | None = None) -> list[str]:
        """Delete documents from collection ``schema`` (default: the retriever's): from this
        index and, when bound to an engine, everywhere the engine keeps them
        (:meth:`pc_rag.PromptCache.delete_documents`). Returns the names that were removed."""
        schema = check_name(schema if schema is not None else self.schema, "schema name")
        names = [check_name(n) for n in ([names] if isinstance(names, str) else names)]
        removed = set(self.engine.delete_documents(names, schema=schema)) if self.engine is not None else set()
        removed.update(self.forget(schema, names))
        return [n for n in names if n in removed]

    def forget(self, schema: str, names: Sequence[str]) -> list[str]:
        """Drop documents from this index only (the engine calls it for every deletion it makes
        or takes in from another replica); returns the names that were indexed."""
        with self._lock:
            rows = [self._ids.pop((schema, n)) for n in names if (schema, n) in self._ids]
            gone = [self._records.pop(row).name for row in rows]
            if rows:
                self.index.remove_ids(np.asarray(rows, dtype=np.int64))
        return gone

    def get(self, names: Sequence[str], *, schema: str | None = None) -> list[Hit]:
        """The documents of collection ``schema`` (default: the retriever's) with these names, in
        that order; names it does not hold are left out. Scores are 1.0."""
        schema = schema if schema is not None else self.schema
        with self._lock:
            records = [self._records[self._ids[(schema, n)]] for n in names if (schema, n) in self._ids]
        return [Hit(r.name, 1.0, r.text, dict(r.metadata), r.schema) for r in records]

    def _embed(self, texts: list[str], progress: bool = False) -> np.ndarray:
        return embed_texts(self.embedder, texts, progress).reshape(len(texts), self.dimension)

    def embed_query(self, query: str) -> np.ndarray:
        """The query's unit vector (``[1, dimension]``), as :meth:`search` compares it."""
        if not isinstance(query, str):
            raise PromptCacheError(f"query must be a str, got {type(query).__name__}")
        if hasattr(self.embedder, "embed_query"):
            return normalised(np.asarray([self.embedder.embed_query(query)], dtype=np.float32))
        return self._embed([query])

    def vectors(self, hits: Sequence[Hit]) -> np.ndarray:
        """The stored unit vectors of ``hits`` (``[len(hits), dimension]``; for maximal marginal relevance)."""
        with self._lock:
            return np.stack([self.index.reconstruct(self._ids[(h.schema, h.module)]) for h in hits]) if hits else \
                np.zeros((0, self.dimension), dtype=np.float32)

    def search(self, query: str, k: int = 4, *, filter: Mapping[str, Any] | Callable[[dict[str, Any]], bool] | None = None,  # noqa: A002 - LangChain's name
               collections: str | Sequence[str] | None = None) -> list[Hit]:
        """The ``k`` modules most similar to ``query``, best first, among the documents of
        ``collections`` (None: all this index holds) whose metadata passes ``filter`` (see
        :func:`metadata_filter`). Bound to an engine, its due sync runs first, so documents
        deleted on another replica have left the index (:meth:`forget`)."""
        if self.engine is not None:
            # deletions other replicas made reach this index through the engine's sync (registry.watch)
            self.engine.sync_if_due()
        # outside the lock: searches embed their queries side by side
        return self.search_by_vector(self.embed_query(query), k, filter=filter, collections=collections)

    def search_by_vector(self, vector: np.ndarray, k: int = 4, *, filter: Mapping[str, Any] | Callable[[dict[str, Any]], bool] | None = None,  # noqa: A002
                         collections: str | Sequence[str] | None = None) -> list[Hit]:
        """:meth:`search` for a query already embedded (a unit vector, ``[dimension]`` or ``[1, dimension]``)."""
        import faiss

        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise PromptCacheError(f"k must be a positive int, got {k!r}")
        vector = np.ascontiguousarray(np.asarray(vector, dtype=np.float32).reshape(1, -1))
        if vector.shape[1] != self.dimension:
            raise PromptCacheError(f"the query vector has {vector.shape[1]} dimensions, the index {self.dimension}")
        allowed = scope(collections)
        keep = metadata_filter(filter)
        with self._lock:
            if filter is None and allowed is None:
                rows = None
            else:
                rows = [row for row, r in self._records.items() if (allowed is None or r.schema in allowed) and keep(r.metadata)]
                if not rows:
                    return []
            total = len(self._records) if rows is None else len(rows)
            if not total:
                return []
            params = None if rows is None else faiss.SearchParameters(sel=faiss.IDSelectorBatch(np.asarray(rows, dtype=np.int64)))
            scores, found = self.index.search(vector, min(k, total), params=params)
            records = [(float(score), self._records.get(int(row))) for score, row in zip(scores[0], found[0]) if row >= 0]
        return [Hit(r.name, score, r.text, dict(r.metadata), r.schema) for score, r in records if r is not None]

    # -----------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write the index and its records to folder ``path`` (atomically, with a checksum).

        Without ``path``, the index goes beside the engine's module store
        (``<kv_dir>/index/<schema>``).
        """
        import faiss

        folder = Path(path) if path is not None else self._default_path()
        folder.mkdir(parents=True, exist_ok=True)
        with self._lock:
            index_bytes = faiss.serialize_index(self.index).tobytes()
            rows = list(self._records.items())
        try:
            records = json.dumps(
                {
                    "format": _FORMAT,
                    "embedding": self.embedding_name,
                    "dimension": self.dimension,
                    "schema": self.schema,
                    "index_sha256": hashlib.sha256(index_bytes).hexdigest(),
                    "records": [{"id": row, "schema": r.schema, "name": r.name, "text": r.text, "metadata": r.metadata} for row, r in rows],
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
        records = meta["records"]
        if index.ntotal != len(records) or index.d != retriever.dimension:
            raise PromptCacheError(f"the index in {folder} holds {index.ntotal} vectors for {len(records)} records")
        retriever.index = index
        for record in records:
            retriever._records[record["id"]] = _Record(record["schema"], record["name"], record["text"], record["metadata"])
            retriever._ids[(record["schema"], record["name"])] = record["id"]
        retriever._next_id = max(retriever._records, default=-1) + 1
        if engine is not None:
            missing = []
            for r in retriever._records.values():
                held = engine.schemas.get(r.schema)
                if held is None or r.name not in held.documents:
                    missing.append(r.name)
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
