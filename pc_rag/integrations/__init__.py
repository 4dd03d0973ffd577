"""Thin adapters over :class:`pc_rag.PromptCache` for LangChain and LlamaIndex."""
