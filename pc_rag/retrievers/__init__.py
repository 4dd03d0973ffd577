"""Retrievers that map search hits to pre-encoded document modules."""

from .faiss_retriever import DEFAULT_EMBEDDING, FaissModuleRetriever, Hit, load_embedder, metadata_filter

__all__ = ["DEFAULT_EMBEDDING", "FaissModuleRetriever", "Hit", "load_embedder", "metadata_filter"]
