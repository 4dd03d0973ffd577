"""LangChain's own standard test suites, offline, on the embedded models.

``ChatModelIntegrationTests`` runs with tool calling, tool choice, structured output (constrained
decoding) and JSON mode on. langchain-tests has no suite for plain ``BaseLLM`` models; the LLM
adapter's behaviour is covered in ``test_ecosystem.py``.
"""

from __future__ import annotations

import json

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from pc_rag.integrations.langchain import ChatPromptCache, PromptCacheRetriever

from .conftest import SQUAD

_retriever = None


def squad_passages() -> list[str]:
    data = json.loads(SQUAD.read_text())
    return [p["context"] for a in data["data"] for p in a["paragraphs"]]


def squad_module_retriever():
    """A module retriever over SQuAD paragraphs, built once (the suites construct many retrievers)."""
    global _retriever
    if _retriever is None:
        from pc_rag.integrations._shared import shared_engine
        from pc_rag.retrievers import FaissModuleRetriever

        texts = squad_passages()[:6]
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


class EmbeddedModelSettings:
    """What the chat-model suite is told about pc-rag on the embedded model, in-process or behind
    ``pc-rag serve`` (``test_server_standard.py``), and the two tests the 135M model fails."""

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def structured_output_kwargs(self) -> dict:
        return {"method": "json_schema"}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    @pytest.mark.xfail(strict=True, reason="the model's choice, not a broken path: under tool_choice='auto' SmolLM2-135M "
                       "answers the weather question in text instead of calling get_weather (forced calls pass: test_tool_calling)")
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)  # type: ignore[misc]

    @pytest.mark.xfail(strict=True, reason="json_mode constrains to a JSON object and leaves its keys to the prompt "
                       "(as LangChain defines it); SmolLM2-135M closes the object before writing 'punchline' "
                       "(method='json_schema' passes: test_structured_output)")
    def test_json_mode(self, model: BaseChatModel) -> None:
        super().test_json_mode(model)  # type: ignore[misc]


class TestChatPromptCacheIntegration(EmbeddedModelSettings, ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatPromptCache]:
        return ChatPromptCache

    @property
    def chat_model_params(self) -> dict:
        # greedy; no repeated 10-gram keeps the 135M model from looping while it can still copy
        # names from the question into a call (a repetition penalty or a shorter n-gram stops it
        # copying 你好啊集团). 96 new tokens: a structured reply is steered shut before its budget
        # runs out (pc_rag.decode.constrained), and the 135M model's jokes run on to the budget, so
        # a larger one only makes each structured-output test longer (256: ~11 more minutes in all)
        return {"max_new_tokens": 96, "no_repeat_ngram_size": 10}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A question over a stored document: its text in the message is read from the cache."""
        model = self.chat_model_class(**self.chat_model_params)
        (passage,) = squad_passages()[:1]
        model.engine.add_documents([passage], progress=False)
        question = [HumanMessage(passage + "\n\nWhere was Super Bowl 50 played?")]
        if stream:
            message = None
            for chunk in model.stream(question):
                message = chunk if message is None else message + chunk
        else:
            message = model.invoke(question)
        assert isinstance(message, AIMessage)
        assert message.usage_metadata["input_token_details"]["cache_read"] > 100  # the passage's KV was reused
        return message


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
