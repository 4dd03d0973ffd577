"""LangChain adapters: an LLM, a chat model and a retriever over a :class:`~pc_rag.PromptCache`.

Thin by design: prompts go to the engine as plain text (in which module references and verbatim
document text are reused; PML only with ``pml=True``), and the engine's reuse statistics come back
in ``generation_info`` / ``response_metadata``.

Two ways to feed documents to a chain:

- ``format_modules`` (references): ``{"context": retriever | format_modules, "question":
  RunnablePassthrough()} | prompt | llm`` puts references to the retrieved modules into the
  prompt; the engine imports their KV and never re-tokenises their text.
- unchanged "stuff" chains (drop-in): document text formatted into the prompt is found by the
  engine's text index and its KV reused.
"""

from .chat_model import ChatPromptCache
from .llm import PromptCacheLLM
from .retriever import PromptCacheRetriever, format_modules
from .vectorstore import PromptCacheVectorStore, SentenceTransformerEmbeddings

__all__ = ["ChatPromptCache", "PromptCacheLLM", "PromptCacheRetriever", "PromptCacheVectorStore", "SentenceTransformerEmbeddings",
           "format_modules"]
