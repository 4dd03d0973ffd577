"""pc-rag's own index as a LangChain VectorStore: langchain-tests' standard suite, and what it adds
(KV stored, replaced and deleted with the documents; MMR; filters; relevance scores)."""

from __future__ import annotations

import itertools

import pytest
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_tests.integration_tests import VectorStoreIntegrationTests

from pc_rag import PromptCacheError
from pc_rag.integrations.langchain import PromptCacheVectorStore

_collections = itertools.count()


@pytest.fixture(scope="module")
def tiny_engine(make_tiny, tokenizer):
    from pc_rag import PromptCache

    return PromptCache(make_tiny("llama"), tokenizer, recompute=0, attention_temperature=1.0, attention_scale=1.0)


@pytest.fixture(scope="module")
def make_tiny(tokenizer):  # module-scoped twin of conftest's (the engine above lives for the module)
    import torch
    from transformers import AutoModelForCausalLM

    from tests.conftest import tiny_config

    def build(arch: str, seed: int = 0):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(tiny_config(arch, len(tokenizer)), dtype=torch.float32).eval()

    return build


class TestPromptCacheVectorStoreStandard(VectorStoreIntegrationTests):
    """LangChain's own conformance suite for vector stores, run as LangChain runs it."""

    @pytest.fixture
    def vectorstore(self, tiny_engine):
        # an empty store per test: a fresh collection of one engine (a real model, its KV stored)
        return PromptCacheVectorStore(self.get_embeddings(), engine=tiny_engine, collection=f"standard{next(_collections)}")


@pytest.fixture
def store(tiny_engine):
    return PromptCacheVectorStore(DeterministicFakeEmbedding(size=16), engine=tiny_engine, collection=f"own{next(_collections)}")


def test_documents_are_modules_whose_kv_follows_them(store, tiny_engine):
    ids = store.add_documents([Document(page_content="The sky over the harbour was grey all week.", metadata={"n": 1}, id="7f3a-uuid"),
                               Document(page_content="Tea is grown on the hills above the town.", metadata={"n": 2})])
    assert ids[0] == "7f3a-uuid" and len(ids[1]) == 36  # the given id, a UUID for the other
    held = tiny_engine.schemas[store.collection]
    names = list(held.documents)
    assert names == ["id.7f3a-uuid", f"id.{ids[1]}" if ids[1][0].isdigit() else ids[1]]
    old_key = held.keys["id.7f3a-uuid"]
    assert old_key in tiny_engine.store
    # the same id with another text: the module (and its KV) is replaced, never served stale
    store.add_documents([Document(page_content="The sky over the harbour cleared on Sunday.", metadata={"n": 1})], ids=["7f3a-uuid"])
    held = tiny_engine.schemas[store.collection]
    assert held.documents["id.7f3a-uuid"].text == "The sky over the harbour cleared on Sunday."
    assert held.keys["id.7f3a-uuid"] != old_key and old_key not in tiny_engine.store
    assert [d.page_content for d in store.get_by_ids(["7f3a-uuid"])] == ["The sky over the harbour cleared on Sunday."]
    store.delete(["7f3a-uuid"])
    assert "id.7f3a-uuid" not in tiny_engine.schemas[store.collection].documents and store.get_by_ids(["7f3a-uuid"]) == []


def test_search_types_filters_and_scores(store):
    texts = [f"Paragraph {i}: the {c} boat left the harbour at {i} o'clock." for i, c in enumerate(["red", "blue", "green", "white", "black"])]
    store.add_texts(texts, metadatas=[{"i": i, "even": i % 2 == 0} for i in range(5)], ids=[str(i) for i in range(5)])
    assert store.similarity_search(texts[3], k=1)[0].id == "3"
    assert {d.id for d in store.similarity_search(texts[3], k=5, filter={"even": True})} == {"0", "2", "4"}
    assert {d.id for d in store.similarity_search(texts[3], k=5, filter={"i": {"$gte": 3}})} == {"3", "4"}
    scored = store.similarity_search_with_relevance_scores(texts[2], k=2)
    assert scored[0][0].id == "2" and scored[0][1] == pytest.approx(1.0, abs=1e-5) and scored[1][1] < scored[0][1]
    mmr = store.max_marginal_relevance_search(texts[1], k=3, fetch_k=5)
    assert mmr[0].id == "1" and len({d.id for d in mmr}) == 3
    for search_type, kwargs in (("similarity", {"k": 2}), ("mmr", {"k": 2, "fetch_k": 4}),
                                ("similarity_score_threshold", {"k": 5, "score_threshold": 0.99})):
        found = store.as_retriever(search_type=search_type, search_kwargs=kwargs).invoke(texts[4])
        assert found[0].id == "4" and len(found) == (1 if search_type == "similarity_score_threshold" else 2)
    with pytest.raises(PromptCacheError, match="unknown search arguments"):
        store.similarity_search("x", k=1, where={"a": 1})
    with pytest.raises(PromptCacheError, match="needs the ids"):
        store.delete()


async def test_async_variants(store):
    ids = await store.aadd_texts(["An async document about lighthouses."], ids=["a1"])
    assert ids == ["a1"] and (await store.aget_by_ids(["a1"]))[0].page_content == "An async document about lighthouses."
    assert (await store.asimilarity_search("lighthouses", k=1))[0].id == "a1"
    await store.adelete(["a1"])
    assert await store.asimilarity_search("lighthouses", k=1) == []
