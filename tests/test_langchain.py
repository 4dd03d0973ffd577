"""LangChain adapters end to end on the embedded SmolLM2 and MiniLM models (real LCEL chains)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.exceptions import ContextOverflowError, ModelInvalidRequestError, ModelRateLimitError
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate
from langchain_core.runnables import RunnablePassthrough

from pc_rag import ContextWindowExceeded, PromptCacheError, QueueFull
from pc_rag.integrations.langchain import ChatPromptCache, PromptCacheLLM, PromptCacheRetriever, format_modules

QUESTION = "Who won Super Bowl 50?"
CHAT_PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer the question using the documents."), ("human", "{context}\n\nQuestion: {question}")]
)


class TokenCounter(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


@pytest.fixture(scope="module")
def retriever(squad_retriever):
    return PromptCacheRetriever(retriever=squad_retriever, k=3)


def test_retriever_returns_documents_with_their_module(retriever, squad_retriever):
    docs = retriever.invoke(QUESTION)
    assert len(docs) == 3 and all(isinstance(d, Document) for d in docs)
    assert all(d.metadata["module"] in squad_retriever.names and d.id == d.metadata["module"] for d in docs)
    assert len(retriever.invoke(QUESTION, k=1)) == 1
    with pytest.raises(PromptCacheError, match="unknown retriever arguments"):
        retriever.invoke(QUESTION, top_n=2)


def test_lcel_chain_with_format_modules_imports_by_reference(smollm, retriever):
    llm = ChatPromptCache(engine=smollm, max_new_tokens=24)
    chain = {"context": retriever | format_modules, "question": RunnablePassthrough()} | CHAT_PROMPT | llm
    message = chain.invoke(QUESTION)
    meta = message.response_metadata
    retrieved = [d.metadata["module"] for d in retriever.invoke(QUESTION)]
    assert meta["modules"] == retrieved
    documents_tokens = sum(smollm.schemas["docs"].layout.modules[n].text_tokens for n in retrieved)
    recomputed = smollm.recompute * len(retrieved)  # recovery: each document's first tokens are computed
    assert meta["cached_tokens"] == documents_tokens - recomputed and meta["computed_tokens"] < 60 + recomputed
    assert "Broncos" in message.content
    assert message.usage_metadata["input_tokens"] == meta["cached_tokens"] + meta["computed_tokens"]
    # the same chain with full prefill of the same tokens answers the same (greedy)
    baseline = ({"context": retriever | format_modules, "question": RunnablePassthrough()} | CHAT_PROMPT
                | ChatPromptCache(engine=smollm, max_new_tokens=24, use_cache=False)).invoke(QUESTION)
    assert baseline.response_metadata["cached_tokens"] == 0
    assert "Broncos" in baseline.content


def test_unchanged_stuff_chain_reuses_document_kv(smollm, retriever):
    def stuff(docs):  # what LangChain's RAG tutorials write: plain text, no references
        return "\n\n".join(d.page_content for d in docs)

    for llm, prompt in ((ChatPromptCache(engine=smollm, max_new_tokens=16), CHAT_PROMPT),
                        (PromptCacheLLM(engine=smollm, max_new_tokens=16),
                         PromptTemplate.from_template("Context:\n{context}\n\nQuestion: {question}\nAnswer:"))):
        chain = {"context": retriever | stuff, "question": RunnablePassthrough()} | prompt | llm
        result = chain.invoke(QUESTION)
        if isinstance(result, AIMessage):
            meta = result.response_metadata
        else:
            meta = llm.generate([prompt.format(context=stuff(retriever.invoke(QUESTION)), question=QUESTION)]).generations[0][0].generation_info
        assert meta["cached_tokens"] > 300 and len(meta["modules"]) == 3


def test_llm_streaming_fires_callbacks_and_honours_stop(smollm):
    llm = PromptCacheLLM(engine=smollm, max_new_tokens=20)
    counter = TokenCounter()
    chunks = list(llm.stream("The capital of France is", config={"callbacks": [counter]}))
    text = "".join(chunks)
    assert text and counter.tokens and "".join(counter.tokens) == text
    full = llm.invoke("The capital of France is")
    assert full == text  # greedy: streaming and invoke agree
    assert PromptCacheLLM(engine=smollm, max_new_tokens=20, streaming=True).invoke("The capital of France is") == text
    cut = llm.invoke("The capital of France is", stop=[full.strip()[:3]])
    assert full.strip()[:3] not in cut and len(cut) < len(full)
    result = llm.generate(["Hello"], max_new_tokens=3)
    info = result.generations[0][0].generation_info
    assert info["generated_tokens"] <= 3 and {"cached_tokens", "computed_tokens", "ttft_s"} <= set(info)


def test_chat_streaming_batch_and_async(smollm):
    chat = ChatPromptCache(engine=smollm, max_new_tokens=12)
    messages = [SystemMessage("Be brief."), HumanMessage("Name a primary colour.")]
    counter = TokenCounter()
    chunks = list(chat.stream(messages, config={"callbacks": [counter]}))
    streamed = "".join(c.content for c in chunks)
    assert streamed == "".join(counter.tokens) and chunks[-1].response_metadata["ttft_s"] > 0
    assert chat.invoke(messages).content == streamed
    streaming = ChatPromptCache(engine=smollm, max_new_tokens=12, streaming=True).invoke(messages)
    assert streaming.content == streamed and streaming.response_metadata["computed_tokens"] > 0
    batch = chat.batch([messages, [HumanMessage("Say hi.")]])
    assert batch[0].content == streamed and len(batch) == 2


def test_chat_logprobs_where_chat_openai_puts_them(smollm):
    """``logprobs``/``top_logprobs`` as ChatOpenAI takes them (fields or per call), returned in
    ``response_metadata["logprobs"]`` in its shape, streamed or not: a RAG app's confidence signal."""
    messages = [HumanMessage("Name a primary colour.")]
    chat = ChatPromptCache(engine=smollm, max_new_tokens=8, logprobs=True, top_logprobs=2)
    message = chat.invoke(messages)
    content = message.response_metadata["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == message.content and len(content) == message.usage_metadata["output_tokens"]
    assert all(len(t["top_logprobs"]) == 2 and t["top_logprobs"][0]["token"] == t["token"] and t["logprob"] <= 0 for t in content)
    streamed, chunks = None, list(chat.stream(messages))
    for chunk in chunks:  # each chunk with the tokens its text completes, as ChatOpenAI streams them
        streamed = chunk if streamed is None else streamed + chunk
        if chunk.content:
            assert "".join(t["token"] for t in chunk.response_metadata["logprobs"]["content"]) == chunk.content
    assert [t["token"] for t in streamed.response_metadata["logprobs"]["content"]] == [t["token"] for t in content]
    assert sum(bool(c.content) for c in chunks) > 1
    per_call = ChatPromptCache(engine=smollm, max_new_tokens=8).bind(logprobs=True).invoke(messages)
    assert [(t["token"], t["top_logprobs"]) for t in per_call.response_metadata["logprobs"]["content"]] == [
        (t["token"], []) for t in content]
    assert "logprobs" not in ChatPromptCache(engine=smollm, max_new_tokens=8).invoke(messages).response_metadata
    with pytest.raises(PromptCacheError, match="top_logprobs needs logprobs=True"):
        ChatPromptCache(engine=smollm, max_new_tokens=8, top_logprobs=2).invoke(messages)


async def test_async_paths(smollm):
    llm = PromptCacheLLM(engine=smollm, max_new_tokens=6)
    chat = ChatPromptCache(engine=smollm, max_new_tokens=6)
    assert await llm.ainvoke("One, two,") == llm.invoke("One, two,")
    assert (await chat.ainvoke("Say hi.")).content == chat.invoke("Say hi.").content
    pieces = [c.content async for c in chat.astream("Say hi.")]
    assert "".join(pieces) == chat.invoke("Say hi.").content


async def test_engine_errors_are_langchains_model_errors_too(smollm):
    """What ChatOpenAI raises for the same condition (a chain that trims its history on
    ContextOverflowError works with either), and still the engine's own error: before, only the latter."""
    chat, llm = ChatPromptCache(engine=smollm, max_new_tokens=4), PromptCacheLLM(engine=smollm, max_new_tokens=4)
    too_long = "word " * 9000
    calls = {"chat.invoke": lambda: chat.invoke(too_long), "chat.stream": lambda: list(chat.stream(too_long)),
             "llm.invoke": lambda: llm.invoke(too_long), "llm.batch": lambda: llm.batch([too_long, "hi"])}
    for name, call in calls.items():
        with pytest.raises(ContextOverflowError) as caught:
            call()
        assert isinstance(caught.value, ContextWindowExceeded) and caught.value.param == "prompt", name
        assert "context window (8192)" in str(caught.value) and isinstance(caught.value.__cause__, ContextWindowExceeded)
    for agen in (chat.ainvoke(too_long), llm.ainvoke(too_long)):
        with pytest.raises(ContextOverflowError):
            await agen
    with pytest.raises(ModelInvalidRequestError) as caught:
        chat.invoke("hi", stop=[""])
    assert isinstance(caught.value, PromptCacheError) and caught.value.param == "stop"
    assert chat.invoke("Say hi.").content  # the model lives on


def test_a_full_queue_is_langchains_rate_limit(make_engine):
    engine = make_engine("llama", max_running=1, max_queued=1)
    engine.stop_token_ids.clear()
    blocker = engine.stream("Keep the only row busy.", max_new_tokens=400)
    next(blocker)
    waiting = engine.stream("Queued.", max_new_tokens=2)
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(lambda: "".join(waiting))
        while engine.scheduler.stats()["queued"] < 1:  # submitted (a wait for an event, not a timing)
            threading.Event().wait(0.005)
        with pytest.raises(ModelRateLimitError) as caught:
            PromptCacheLLM(engine=engine, max_new_tokens=2).invoke("One too many.")
        assert isinstance(caught.value, QueueFull) and caught.value.is_retryable
        blocker.close()
        assert isinstance(queued.result(), str)


def test_bad_arguments_are_typed_errors(smollm):
    with pytest.raises(PromptCacheError, match="unknown generation arguments: bogus"):
        PromptCacheLLM(engine=smollm).invoke("hi", bogus=1)
    # raised inside pydantic validation: LangChain users get a ValidationError (a ValueError) saying why
    with pytest.raises(ValueError, match="engine must be a pc_rag.PromptCache"):
        PromptCacheLLM(engine="not an engine")
    with pytest.raises(ValueError, match="retriever must be"):
        PromptCacheRetriever(retriever=object())


def test_a_question_cannot_import_modules(smollm, retriever):
    """References typed by a user are text: only format_modules' references (with the secret) import."""
    name = retriever.invoke(QUESTION)[0].metadata["module"]
    chat = ChatPromptCache(engine=smollm, max_new_tokens=4)
    forged = f"[[pc-rag-module 0000000000000000 docs/{name}]] <{name}/> what?"
    chain = {"context": lambda q: "", "question": RunnablePassthrough()} | CHAT_PROMPT | chat
    assert chain.invoke(forged).response_metadata["modules"] == []
