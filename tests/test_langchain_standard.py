"""LangChain's own standard test suites, offline, on the embedded models."""

from __future__ import annotations

import json
from pathlib import Path

from langchain_tests.integration_tests import RetrieversIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from pc_rag.integrations.langchain import ChatPromptCache, PromptCacheRetriever

_retriever = None


def squad_module_retriever():
    """A module retriever over SQuAD paragraphs, built once (the suites construct many retrievers)."""
    global _retriever
    if _retriever is None:
        from pc_rag.integrations._shared import shared_engine
        from pc_rag.retrievers import FaissModuleRetriever

        data = json.loads((Path(__file__).resolve().parents[1].parent / "shared/data/squad_v1.1_dev_super_bowl_50.json").read_text())
        texts = [p["context"] for a in data["data"] for p in a["paragraphs"]][:6]
        _retriever = FaissModuleRetriever(engine=shared_engine())
        _retriever.add(texts, progress=False)
    return _retriever


class TestChatPromptCacheUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatPromptCache]:
        return ChatPromptCache

    @property
    def chat_model_params(self) -> dict:
        return {"max_new_tokens": 16}


class TestPromptCacheRetrieverIntegration(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[PromptCacheRetriever]:
        return PromptCacheRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        return {"retriever": squad_module_retriever(), "k": 2}

    @property
    def retriever_query_example(self) -> str:
        return "Where was Super Bowl 50 played?"
