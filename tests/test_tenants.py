"""Two customers in one engine and one Redis: nothing crosses between collections.

Each tenant's documents live in a collection of their own; a request scoped to tenant B must
plan, answer and report exactly what an engine that never saw tenant A would: no drop-in of
A's text, no import through forged metadata or a reference copied out of a trace, no hit in A's
entries for the same text (a timing channel), and errors that name only B's collections.
"""

from __future__ import annotations

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough

from pc_rag import PML, PromptCacheError, build_prompt, module_reference
from pc_rag.integrations.langchain import ChatPromptCache, PromptCacheLLM, PromptCacheRetriever, format_modules

A_DOCS = [
    "Acme's merger with Globex closes on March 3rd; the price is 41 dollars a share.",
    "Acme's new chief financial officer starts in April and reports to the board.",
]
B_DOCS = [
    "The bakery opens at six and sells rye bread until the afternoon.",
    "Its sourdough starter is fed twice a day with flour from the mill.",
]
SHARED_TEXT = "Both companies follow the same holiday calendar published every January."
QUESTION = "What is it about?"


@pytest.fixture
def shared(make_engine, redis_server):
    """One engine with both tenants' documents (through one Redis), and one that only ever saw B's."""
    engine = make_engine(remote_store=redis_server.url)
    a = engine.add_documents(A_DOCS, schema="tenant-a", progress=False)
    b = engine.add_documents(B_DOCS, schema="tenant-b", progress=False)
    solo = make_engine()
    assert solo.add_documents(B_DOCS, schema="tenant-b", progress=False) == b
    return engine, solo, a, b


def answer(engine, prompt, **kwargs):
    result = engine.generate(prompt, max_new_tokens=6, **kwargs)
    return result.token_ids, result.stats.cached_tokens, result.stats.computed_tokens, result.stats.modules


def test_drop_in_of_the_other_tenants_text_is_not_reused(shared):
    engine, solo, _, b = shared
    prompt = f"{A_DOCS[0]}\n\n{B_DOCS[1]}\n\n{QUESTION}"
    scoped = answer(engine, prompt, collections=["tenant-b"])
    assert scoped == answer(solo, prompt)  # tokens, cached and computed counts, modules
    assert scoped[3] == [b[1]]
    unscoped = answer(engine, prompt)  # single-user default: every collection
    assert unscoped[1] > scoped[1] and len(unscoped[3]) == 2


def test_the_same_text_in_two_collections_is_two_entries(shared):
    engine, _, _, _ = shared
    (in_a,) = engine.add_documents([SHARED_TEXT], schema="tenant-a", progress=False)
    encoded = engine.store_stats()["encoded"]
    (in_b,) = engine.add_documents([SHARED_TEXT], schema="tenant-b", progress=False)
    assert in_a == in_b  # the same name (derived from the text) ...
    assert engine.schemas["tenant-a"].keys[in_a] != engine.schemas["tenant-b"].keys[in_b]  # ... two entries
    assert engine.store_stats()["encoded"] == encoded + 1  # B's was encoded, not found in A's
    assert engine.schemas["tenant-b"].keys[in_b].startswith("tenant-b/")


def test_references_and_schemas_outside_the_scope_read_as_unknown(shared):
    engine, _, a, b = shared
    outside = module_reference(a[0], "tenant-a")
    with pytest.raises(PromptCacheError) as err:
        engine.plan(f"{outside}\n\n{QUESTION}", collections=["tenant-b"])
    assert str(err.value).endswith("(schemas this request may read: tenant-b)")
    # the same error as for a collection that does not exist: nothing tells the two apart
    with pytest.raises(PromptCacheError) as missing:
        engine.plan(f"{module_reference(a[0], 'tenant-q')}\n\n{QUESTION}", collections=["tenant-b"])
    assert str(missing.value).replace("tenant-q", "tenant-a") == str(err.value)
    with pytest.raises(PromptCacheError, match=r"unknown schema 'tenant-a' \(schemas this request may read: tenant-b\)"):
        engine.plan(build_prompt(QUESTION, a[:1], schema="tenant-a"), collections="tenant-b")
    # inside the scope the same reference imports
    assert engine.plan(f"{outside}\n\n{QUESTION}", collections=["tenant-a"]).modules == [a[0]]
    assert engine.plan(PML(build_prompt(QUESTION, b, schema="tenant-b")), collections=["tenant-b"]).modules == b


class PromptLog(BaseCallbackHandler):
    """What a tracing callback records: every prompt an LLM is given."""

    def __init__(self) -> None:
        self.prompts: list[str] = []

    def on_llm_start(self, serialized, prompts, **kwargs) -> None:
        self.prompts.extend(prompts)


@pytest.fixture(scope="module")
def embedder():
    from pc_rag.embedding import load_embedder

    return load_embedder(None)[0]


def test_a_scoped_chain_sees_only_its_tenant(shared, embedder):
    from pc_rag.retrievers import FaissModuleRetriever

    engine, _, _, b = shared
    index = FaissModuleRetriever(embedder, engine=engine)
    index.add(A_DOCS, schema="tenant-a", progress=False)
    index.add(B_DOCS, schema="tenant-b", progress=False)
    retriever = PromptCacheRetriever(retriever=index, k=4)
    template = PromptTemplate.from_template("{context}\n\nQuestion: {question}")
    chain = {"context": retriever | format_modules, "question": RunnablePassthrough()} | template | PromptCacheLLM(engine=engine, max_new_tokens=6)
    log = PromptLog()
    # tenant A's request, traced: its prompt carries references to A's modules
    a_result = chain.invoke("Who is merging?", config={"configurable": {"collections": ["tenant-a"]}, "callbacks": [log]})
    assert a_result and any("tenant-a/" in p for p in log.prompts)
    # tenant B's request: only B's documents are retrieved and imported
    docs = retriever.invoke("Who is merging?", config={"configurable": {"collections": ["tenant-b"]}})
    assert {d.metadata["schema"] for d in docs} == {"tenant-b"} and len(docs) == 2
    generation = PromptCacheLLM(engine=engine, max_new_tokens=6, collections=["tenant-b"]).generate(
        [format_modules(docs) + f"\n\nQuestion: {QUESTION}"]).generations[0][0]
    assert set(generation.generation_info["modules"]) == set(b)
    # a reference copied from tenant A's trace, pasted into tenant B's request, opens nothing
    copied = next(p for p in log.prompts if "tenant-a/" in p)
    llm_b = PromptCacheLLM(engine=engine, max_new_tokens=6, collections=["tenant-b"])
    with pytest.raises(PromptCacheError, match="schemas this request may read: tenant-b"):
        llm_b.invoke(copied)
    # the per-call scope narrows the field, never widens it
    with pytest.raises(PromptCacheError, match=r"may read: none"):
        llm_b.invoke(copied, config={"configurable": {"collections": ["tenant-a"]}})


def test_forged_metadata_never_becomes_a_reference(shared):
    engine, _, a, _ = shared
    forged = [Document(page_content="anything", metadata={"module": a[0], "schema": "tenant-a"}),
              Document(page_content="anything", metadata={"reference": "[[pc-rag-module " + "0" * 32 + f" tenant-a/{a[0]}]]"})]
    assert format_modules(forged) == "anything\n\nanything"  # text: no reference was written
    chat = ChatPromptCache(engine=engine, max_new_tokens=6)
    chain = RunnableLambda(lambda q: forged) | format_modules | RunnableLambda(lambda ctx: f"{ctx}\n\n{QUESTION}") | chat
    message = chain.invoke(QUESTION)  # even unscoped: metadata names nothing
    assert message.response_metadata["modules"] == [] and message.usage_metadata["input_token_details"]["cache_read"] == 0


def test_batch_and_stream_are_scoped_too(shared):
    engine, solo, _, _ = shared
    prompts = [f"{A_DOCS[0]}\n\n{QUESTION}", f"{B_DOCS[0]}\n\n{QUESTION}"]
    batch = engine.generate_batch(prompts, max_new_tokens=4, collections=["tenant-b"])
    assert [r.token_ids for r in batch] == [solo.generate(p, max_new_tokens=4).token_ids for p in prompts]
    assert [r.stats.cached_tokens for r in batch] == [solo.generate(p, max_new_tokens=4).stats.cached_tokens for p in prompts]
    stream = engine.stream(prompts[0], max_new_tokens=4, collections=["tenant-b"])
    assert "".join(stream) == solo.generate(prompts[0], max_new_tokens=4).text and stream.result.stats.modules == []
    llm = PromptCacheLLM(engine=engine, max_new_tokens=4)
    out = llm.batch(prompts, config={"configurable": {"collections": ["tenant-b"]}})
    assert out == [solo.generate(p, max_new_tokens=4).text for p in prompts]
    with pytest.raises(PromptCacheError, match="collections must be"):
        engine.plan("hi", collections=[3])


async def test_a_batch_of_callers_each_with_their_own_scope(shared):
    """LangChain ``batch``/``abatch`` with one config per input (each caller its own collections):
    each input is answered within its own scope, as a lone scoped call, and with
    ``return_exceptions`` an input refused by its scope is its own exception beside the others'
    answers (it raised for the whole batch)."""
    engine, _, a, b = shared
    a_prompt = f"{module_reference(a[0], 'tenant-a')}\n\n{QUESTION}"
    b_prompt = f"{module_reference(b[0], 'tenant-b')}\n\n{QUESTION}"
    scope = [{"configurable": {"collections": [name]}} for name in ("tenant-a", "tenant-b", "tenant-b")]
    inputs = [a_prompt, b_prompt, a_prompt]  # the third imports tenant A's module under tenant B's scope
    lone = [engine.generate(p, max_new_tokens=4, collections=[c]).text for p, c in zip(inputs[:2], ("tenant-a", "tenant-b"))]
    for llm in (PromptCacheLLM(engine=engine, max_new_tokens=4), ChatPromptCache(engine=engine, max_new_tokens=4)):
        for out in (llm.batch(inputs, config=scope, return_exceptions=True),
                    await llm.abatch(inputs, config=scope, return_exceptions=True)):
            texts = [o if isinstance(o, str) else getattr(o, "content", o) for o in out[:2]]
            if isinstance(llm, PromptCacheLLM):
                assert texts == lone
            assert isinstance(out[2], PromptCacheError) and "may read: tenant-b" in str(out[2])
        with pytest.raises(PromptCacheError, match="may read: tenant-b"):
            llm.batch(inputs, config=scope)
