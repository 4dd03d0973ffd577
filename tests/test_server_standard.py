"""LangChain's standard chat-model suite for ``ChatOpenAI`` pointed at ``pc-rag serve``: a
LangChain app that talks to an OpenAI-compatible endpoint works against the server as against
the in-process ``ChatPromptCache`` (``test_langchain_standard.py``), with the same settings and xfails."""

from __future__ import annotations

import httpx
import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_openai import ChatOpenAI
from langchain_tests.integration_tests import ChatModelIntegrationTests

from .servers import MODEL
from .test_langchain_standard import EmbeddedModelSettings, squad_passages

_url: str | None = None


@pytest.fixture(scope="module", autouse=True)
def _server(pcrag_server):
    global _url
    _url = pcrag_server.url
    yield


class TestChatOpenAIAgainstServer(EmbeddedModelSettings, ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatOpenAI]:
        return ChatOpenAI

    @property
    def chat_model_params(self) -> dict:
        # the in-process suite's settings (greedy, no repeated 10-gram), sent as vLLM-style extra fields
        return {"model": MODEL, "base_url": f"{_url}/v1", "api_key": "unused", "max_tokens": 96, "stream_usage": True,
                "max_retries": 0, "extra_body": {"no_repeat_ngram_size": 10},
                # a client per model: langchain-openai's default async client is cached process-wide and
                # bound to the event loop of its first request, which pytest-asyncio closes after each test
                "http_async_client": httpx.AsyncClient(timeout=120)}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A question over a document the server holds: its text in the message is read from the cache."""
        model = self.chat_model_class(**self.chat_model_params)
        (passage,) = squad_passages()[:1]
        added = httpx.post(f"{_url}/v1/collections/docs/documents", json={"documents": [{"id": "standard-p0", "text": passage}]})
        assert added.status_code == 202
        # naming it in a request waits for its encoding
        httpx.post(f"{_url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "ok"}], "max_tokens": 1, "documents": ["standard-p0"]})
        question = [HumanMessage(passage + "\n\nWhere was Super Bowl 50 played?")]
        if stream:
            message = None
            for chunk in model.stream(question):
                message = chunk if message is None else message + chunk
        else:
            message = model.invoke(question)
        assert isinstance(message, AIMessage)
        assert message.usage_metadata["input_token_details"]["cache_read"] > 100
        return message
