"""Retrievers that map search hits to pre-encoded document modules."""

from ..embedding import DEFAULT_EMBEDDING, load_embedder
from .faiss_retriever import FaissModuleRetriever, Hit, metadata_filter

__all__ = ["DEFAULT_EMBEDDING", "FaissModuleRetriever", "Hit", "load_embedder", "metadata_filter"]
