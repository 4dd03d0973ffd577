"""LlamaIndex adapters: a function-calling LLM and a retriever over a :class:`~pc_rag.PromptCache`.

The retriever's nodes render, for the LLM, as references to their pre-encoded modules (a node
``text_template``), so a query engine's synthesizer stuffs references, not text, into its
prompt; for embedding and display they are their plain text. Nodes from any other retriever
still benefit: their verbatim text is found by the engine's drop-in index.
"""

from .llm import PromptCacheLLM
from .retriever import PromptCacheRetriever, as_filter

__all__ = ["PromptCacheLLM", "PromptCacheRetriever", "as_filter"]
