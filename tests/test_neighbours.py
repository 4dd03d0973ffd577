"""Neighbour context (pc_rag.prompt.neighbours): documents encoded behind the documents they are retrieved
with, keyed by that context, carried by persistence, the remote tier and encode_documents, and
prompt orders that follow it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pc_rag import PromptCache, PromptCacheError, build_prompt
from pc_rag.prompt.neighbours import DEFAULT_NEIGHBOURS, DocumentContext, NeighbourIndex, nearest, reorder

DOCS = {
    "eiffel": "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France.",
    "louvre": "The Louvre in Paris is the most visited art museum in the world, home of the Mona Lisa.",
    "fuji": "Mount Fuji is the highest mountain in Japan, about 3,776 metres tall, on Honshu island.",
    "amazon": "The Amazon river in South America is the largest river by discharge volume of water.",
}
QUESTION = "Which of these is in Paris?"


def tiny(make_tiny, tokenizer, arch: str) -> PromptCache:
    # mistral: a sliding window shorter than the documents and their context
    model = make_tiny(arch, seed=5, **({"sliding_window": 16} if arch == "mistral" else {}))
    return PromptCache(model, tokenizer, recompute=0, attention_temperature=1.0, attention_scale=1.0)


def add_chain(engine: PromptCache, **kwargs) -> None:
    """eiffel plain; louvre behind eiffel; fuji behind [eiffel, louvre]: the prompt
    eiffel, louvre, fuji places each exactly behind what it was encoded behind."""
    engine.add_documents([DOCS["eiffel"]], ids=["eiffel"], progress=False, **kwargs)
    engine.add_documents([DOCS["louvre"], DOCS["fuji"]], ids=["louvre", "fuji"], progress=False, context="neighbours",
                         neighbours={"louvre": ["eiffel"], "fuji": ["eiffel", "louvre"]}, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_a_document_behind_exactly_its_context_is_full_prefill(make_tiny, tokenizer, arch):
    engine = tiny(make_tiny, tokenizer, arch)
    add_chain(engine)
    prompt = build_prompt(QUESTION, ["eiffel", "louvre", "fuji"])
    plan = engine.plan(prompt)
    assert plan.modules == ["eiffel", "louvre", "fuji"]
    assert plan.moved is not None and not any(plan.moved)  # every document where, and behind what, it was encoded
    cached = engine.next_token_logits(prompt)
    full = engine.next_token_logits(prompt, use_cache=False)
    assert (cached - full).abs().max().item() <= 1e-4
    # the stored KV of fuji was encoded behind its context: its positions follow it
    schema = engine.schemas["docs"]
    assert schema.contexts["fuji"].names == ("eiffel", "louvre")
    assert schema.layout.modules["fuji"].positions[0] == schema.layout.document_start + len(schema.contexts["fuji"].token_ids)


def test_other_orders_still_plan_and_answer(make_tiny, tokenizer):
    engine = tiny(make_tiny, tokenizer, "llama")
    add_chain(engine)
    prompt = build_prompt(QUESTION, ["fuji", "eiffel"])
    plan = engine.plan(prompt)
    assert plan.moved is not None and any(plan.moved)  # fuji first: not behind its context, a moved module
    result = engine.generate(prompt, max_new_tokens=4)
    assert result.stats.cached_tokens > 0 and len(result.token_ids) > 0
    cached = engine.next_token_logits(prompt)
    assert torch.isfinite(cached).all()


def on_disk(make_tiny, tokenizer, folder) -> Any:
    """A maker of engines on one tiny model persisting to ``folder`` (recovery off: reuse is exact)."""
    model = make_tiny("llama", seed=5)
    return lambda: PromptCache(model, tokenizer, kv_dir=folder, recompute=0, attention_temperature=1.0, attention_scale=1.0)


def exact(engine: PromptCache, names: list[str]) -> float:
    prompt = build_prompt(QUESTION, names)
    return (engine.next_token_logits(prompt) - engine.next_token_logits(prompt, use_cache=False)).abs().max().item()


def test_entries_are_keyed_by_their_context_and_persist(make_tiny, tokenizer, tmp_path):
    engine = on_disk(make_tiny, tokenizer, tmp_path)

    first = engine()
    add_chain(first)
    keys = dict(first.schemas["docs"].keys)
    again = engine()
    add_chain(again)
    assert dict(again.schemas["docs"].keys) == keys and exact(again, ["eiffel", "louvre", "fuji"]) <= 1e-4
    stats = again.store_stats()
    assert stats["encoded"] == 0 and stats["hits_disk"] >= 4  # every entry read back from kv_dir
    # the same text behind another context is another entry: never the one encoded behind eiffel, louvre
    other = engine()
    other.add_documents([DOCS["louvre"]], ids=["louvre"], progress=False)
    other.add_documents([DOCS["eiffel"]], ids=["eiffel"], progress=False, context="neighbours", neighbours={"eiffel": ["louvre"]})
    before = other.forward.encoded
    other.add_documents([DOCS["fuji"]], ids=["fuji"], progress=False, context="neighbours", neighbours={"fuji": ["louvre", "eiffel"]})
    assert other.forward.encoded == before + 1
    assert other.schemas["docs"].keys["fuji"] != keys["fuji"]
    assert other.schemas["docs"].keys["louvre"] != keys["louvre"]  # plain here, behind eiffel there
    assert exact(other, ["louvre", "eiffel", "fuji"]) <= 1e-4
    # first sentences are a context of their own too
    sentences = engine()
    sentences.add_documents([DOCS["eiffel"], DOCS["louvre"], DOCS["fuji"]], ids=["eiffel", "louvre", "fuji"], progress=False,
                            context="neighbour_sentences", neighbours={"fuji": ["eiffel", "louvre"]})
    assert sentences.schemas["docs"].keys["fuji"] not in (keys["fuji"], other.schemas["docs"].keys["fuji"])
    assert sentences.schemas["docs"].contexts["fuji"].form == "neighbour_sentences"


def test_a_lost_entry_is_encoded_again_behind_its_context(make_tiny, tokenizer):
    engine = tiny(make_tiny, tokenizer, "llama")
    add_chain(engine)
    engine.store.clear_memory()  # no disk tier: every document is encoded again when a prompt needs it
    assert exact(engine, ["eiffel", "louvre", "fuji"]) <= 1e-4


def test_deleting_a_neighbour_takes_it_out_of_the_context_of_the_documents_behind_it(make_tiny, tokenizer):
    engine = tiny(make_tiny, tokenizer, "llama")
    add_chain(engine)
    old = dict(engine.schemas["docs"].keys)
    assert engine.delete_documents(["eiffel"]) == ["eiffel"]
    schema = engine.schemas["docs"]
    assert "louvre" not in schema.contexts and schema.contexts["fuji"].names == ("louvre",)
    assert schema.keys["fuji"] != old["fuji"] and old["fuji"] not in engine.store and old["louvre"] not in engine.store
    assert exact(engine, ["louvre", "fuji"]) <= 1e-4  # louvre now plain and first, fuji behind louvre


def test_a_document_placed_first_reads_its_plain_variant_exactly_with_no_extra_computed_token(make_tiny, tokenizer):
    engine = tiny(make_tiny, tokenizer, "llama")
    add_chain(engine)
    schema = engine.schemas["docs"]
    assert set(schema.plain) == {"louvre", "fuji"} and all(schema.plain[n] in engine.store for n in schema.plain)
    for names in (["louvre"], ["fuji", "eiffel"], ["louvre", "fuji"]):
        plan = engine.plan(build_prompt(QUESTION, names))
        first = next(s for s in plan.segments if s.owner == names[0])
        assert first.plain and first.key == schema.plain[names[0]] and first.source_position == first.position
        assert not plan.moved[plan.segments.index(first)]  # type: ignore[index]
    assert exact(engine, ["louvre"]) <= 1e-4 and exact(engine, ["fuji"]) <= 1e-4
    assert exact(engine, ["eiffel", "louvre", "fuji"]) <= 1e-4  # behind its context: the contextual variant still
    assert not any(s.plain for s in engine.plan(build_prompt(QUESTION, ["eiffel", "louvre", "fuji"])).segments)
    # with the default recovery a first document computes no token more than a plain collection's
    model = make_tiny("llama", seed=5)
    contextual, plain = PromptCache(model, tokenizer), PromptCache(model, tokenizer)
    add_chain(contextual)
    plain.add_documents([DOCS[n] for n in ("eiffel", "louvre", "fuji")], ids=["eiffel", "louvre", "fuji"], progress=False)
    for names in (["louvre"], ["fuji", "louvre"]):
        prompt = build_prompt(QUESTION, names)
        assert contextual.plan(prompt).computed_tokens == plain.plan(prompt).computed_tokens


def test_both_variants_live_in_memory_disk_and_after_a_loss(make_tiny, tokenizer, tmp_path):
    engine = on_disk(make_tiny, tokenizer, tmp_path)

    first = engine()
    add_chain(first)
    again = engine()
    add_chain(again)
    assert dict(again.schemas["docs"].plain) == dict(first.schemas["docs"].plain)
    assert again.store_stats()["encoded"] == 0  # both variants read back from kv_dir
    assert exact(again, ["louvre"]) <= 1e-4 and exact(again, ["eiffel", "louvre", "fuji"]) <= 1e-4
    lost = tiny(make_tiny, tokenizer, "llama")  # no disk tier: a variant the memory lost is encoded again, plain
    add_chain(lost)
    lost.store.clear_memory()
    assert exact(lost, ["fuji"]) <= 1e-4 and exact(lost, ["eiffel", "louvre", "fuji"]) <= 1e-4


def test_deleting_documents_deletes_their_plain_variants_and_a_dependent_left_alone_is_plain(make_tiny, tokenizer):
    engine = tiny(make_tiny, tokenizer, "llama")
    add_chain(engine)
    old = dict(engine.schemas["docs"].plain)
    engine.delete_documents(["eiffel"])
    schema = engine.schemas["docs"]
    # louvre lost its only neighbour: plain now, under its plain variant's key (nothing encoded again)
    assert "louvre" not in schema.plain and schema.keys["louvre"] == old["louvre"] and old["louvre"] in engine.store
    assert schema.plain["fuji"] == old["fuji"] and old["fuji"] in engine.store  # behind louvre still
    assert exact(engine, ["fuji"]) <= 1e-4
    engine.delete_documents(["fuji"])
    assert old["fuji"] not in engine.store and "fuji" not in engine.schemas["docs"].plain


def test_reorder_follows_the_nearest_neighbour_where_the_ranking_allows():
    def ctx(*names: str) -> DocumentContext:
        return DocumentContext(tuple(names), ())

    contexts = {"a": ctx("x", "b"), "b": ctx("a"), "c": ctx("b"), "d": ctx("zz")}
    # a wants b before it (granted: a ranks first); b wants a (a loop: refused); c wants b (taken by a)
    assert reorder(["a", "b", "c", "d"], contexts) == ["b", "a", "c", "d"]
    assert reorder(["c", "d"], contexts) == ["c", "d"]
    assert reorder(["a", "b", "a"], contexts) == ["a", "b", "a"]  # a duplicate is never dropped
    chain = {"fuji": ctx("eiffel", "louvre"), "louvre": ctx("eiffel")}
    assert reorder(["fuji", "louvre", "eiffel"], chain) == ["eiffel", "louvre", "fuji"]
    assert nearest(torch.eye(3).numpy(), torch.eye(3).numpy(), 2, exclude=[0, 1, 2]) == [[1, 2], [0, 2], [0, 1]]


def test_the_neighbour_index_embeds_a_text_once_and_a_replaced_text_again():
    embedded: list[str] = []

    def embed(texts: list[str]) -> Any:  # a bag of letters, unit length: texts sharing letters are near
        embedded.extend(texts)
        vectors = torch.zeros(len(texts), 26)
        for row, text in enumerate(texts):
            for char in text:
                vectors[row, ord(char) - ord("a")] += 1
        return torch.nn.functional.normalize(vectors, dim=1).numpy()

    index = NeighbourIndex(embed)
    index.add({"a": "aaab", "b": "bbbc", "c": "cccd"})
    index.add({"a": "aaab", "b": "bbbc"})  # held, same texts: nothing embedded again
    assert embedded == ["aaab", "bbbc", "cccd"]
    assert index.neighbours(["a"], 1) == {"a": ["b"]}
    index.add({"c": "aaaa"})  # "c" replaced under its name: embedded again, and now a's nearest
    assert embedded[3:] == ["aaaa"] and index.names.count("c") == 1
    assert index.neighbours(["a"], 2) == {"a": ["b", "c"]}  # the farthest first
    index.forget(["c"])
    assert index.neighbours(["a"], 2) == {"a": ["b"]}


def test_build_prompt_reorders_with_the_engine(make_tiny, tokenizer):
    engine = tiny(make_tiny, tokenizer, "llama")
    add_chain(engine)
    prompt = build_prompt(QUESTION, ["fuji", "louvre", "eiffel"], reorder=True, engine=engine)
    assert prompt == build_prompt(QUESTION, ["eiffel", "louvre", "fuji"])
    assert not any(engine.plan(prompt).moved)
    with pytest.raises(PromptCacheError, match="needs engine"):
        build_prompt(QUESTION, ["fuji"], reorder=True)


@pytest.mark.parametrize("kwargs,match", [
    ({"context": "neighbors"}, "unknown context"),
    ({"context": "neighbours", "neighbours": -1}, "neighbours must be"),
    ({"context": "neighbours", "neighbours": 1.5}, "neighbours must be"),
    ({"context": "neighbours", "neighbours": {"ghost": ["eiffel"]}}, "not among the documents added"),
    ({"context": "neighbours", "neighbours": {"louvre": ["ghost"]}}, "neither in collection"),
    ({"context": "neighbours", "neighbour_search": "chroma"}, "neighbour_search must be a callable"),
])
def test_bad_arguments_are_typed_errors(make_tiny, tokenizer, kwargs, match):
    engine = tiny(make_tiny, tokenizer, "llama")
    with pytest.raises(PromptCacheError, match=match):
        engine.add_documents([DOCS["louvre"]], ids=["louvre"], progress=False, **kwargs)
    assert "louvre" not in (engine.schemas["docs"].documents if "docs" in engine.schemas else {})


def test_the_retriever_encodes_behind_its_own_nearest_documents_and_adapters_reorder(make_tiny, tokenizer):
    from langchain_core.documents import Document
    from llama_index.core.schema import QueryBundle

    from pc_rag.integrations.langchain import PromptCacheRetriever as LangChainRetriever
    from pc_rag.integrations.llama_index import PromptCacheRetriever as LlamaIndexRetriever
    from pc_rag.retrievers import FaissModuleRetriever

    engine = tiny(make_tiny, tokenizer, "llama")
    retriever = FaissModuleRetriever(engine=engine)
    with pytest.raises(PromptCacheError, match="neighbours must be"):
        retriever.add(list(DOCS.values()), ids=list(DOCS), context="neighbours", neighbours=-2, progress=False)
    retriever.add(list(DOCS.values()), ids=list(DOCS), context="neighbours", neighbours=1, progress=False)
    contexts = engine.schemas["docs"].contexts
    for name, text in DOCS.items():
        nearest_hit = [h.module for h in retriever.search(text, k=2) if h.module != name][0]
        assert contexts[name].names == (nearest_hit,)
    ranked = [h.module for h in retriever.search("Paris museum tower", k=4)]
    expected = engine.reorder_documents(ranked)
    assert sorted(expected) == sorted(ranked)
    got = LangChainRetriever(retriever=retriever, k=4, reorder=True).invoke("Paris museum tower")
    assert [d.metadata["module"] for d in got] == expected and all(isinstance(d, Document) for d in got)
    assert [d.metadata["module"] for d in LangChainRetriever(retriever=retriever, k=4).invoke("Paris museum tower")] == ranked
    nodes = LlamaIndexRetriever(retriever, k=4, reorder=True).retrieve(QueryBundle("Paris museum tower"))
    assert [n.node.metadata["module"] for n in nodes] == expected


def test_the_faiss_index_encodes_behind_neighbours_by_default_and_context_none_as_before(make_tiny, tokenizer):
    from pc_rag.retrievers import FaissModuleRetriever

    engines = {}
    for context in ("default", None):
        engine = engines[context] = tiny(make_tiny, tokenizer, "llama")
        retriever = FaissModuleRetriever(engine=engine)
        retriever.add(list(DOCS.values()), ids=list(DOCS), progress=False, **({} if context == "default" else {"context": None}))
    with_context, alone = (engines[c].schemas["docs"] for c in ("default", None))
    assert set(with_context.contexts) == set(DOCS) and all(len(c.names) == DEFAULT_NEIGHBOURS for c in with_context.contexts.values())
    assert set(with_context.plain) == set(DOCS)
    assert not alone.contexts and not alone.plain
    # context=None is plain add_documents, key for key and token for token
    plain = tiny(make_tiny, tokenizer, "llama")
    plain.add_documents(list(DOCS.values()), ids=list(DOCS), progress=False)
    assert dict(alone.keys) == dict(plain.schemas["docs"].keys)
    prompt = build_prompt(QUESTION, ["louvre", "fuji", "amazon"])
    assert engines[None].generate(prompt, max_new_tokens=6).token_ids == plain.generate(prompt, max_new_tokens=6).token_ids
    # with context, the first document reads its plain copy: the same KV as the plain collection's
    assert with_context.plain["louvre"] == plain.schemas["docs"].keys["louvre"]


def test_the_remote_tier_carries_the_context(make_engine, redis_server):
    writer = make_engine(remote_store=redis_server.url)
    add_chain(writer)
    replica = make_engine(remote_store=redis_server.url)  # takes the records in at start
    assert replica.schemas["docs"].contexts["fuji"].names == ("eiffel", "louvre")
    assert dict(replica.schemas["docs"].keys) == dict(writer.schemas["docs"].keys)
    assert dict(replica.schemas["docs"].plain) == dict(writer.schemas["docs"].plain)
    assert exact(replica, ["eiffel", "louvre", "fuji"]) <= 1e-4 and exact(replica, ["louvre"]) <= 1e-4
    stats = replica.store_stats()
    assert stats["encoded"] == 0 and stats["hits_remote"] >= 4  # the contextual variants and a plain one


def test_the_engine_finds_neighbours_by_embedding_and_reencodes_a_collection(make_tiny, tokenizer):
    from pc_rag.retrievers import FaissModuleRetriever

    engine = tiny(make_tiny, tokenizer, "llama")
    engine.add_documents(list(DOCS.values())[:2], ids=list(DOCS)[:2], progress=False)  # plain, before any context
    engine.add_documents(list(DOCS.values())[2:], ids=list(DOCS)[2:], progress=False, context="neighbours", neighbours=3)
    contexts = engine.schemas["docs"].contexts
    assert set(contexts) == {"fuji", "amazon"} and all(len(contexts[n].names) == 3 for n in contexts)
    # the default embedder's nearest comes last, right before the document
    index = FaissModuleRetriever(engine=None)
    index.add(list(DOCS.values()), ids=list(DOCS), progress=False)
    assert contexts["fuji"].names[-1] == [h.module for h in index.search(DOCS["fuji"], k=2) if h.module != "fuji"][0]
    names = engine.reencode_documents(neighbours=1)
    assert sorted(names) == sorted(DOCS)
    assert {n: len(c.names) for n, c in engine.schemas["docs"].contexts.items()} == {n: 1 for n in DOCS}
    with pytest.raises(PromptCacheError, match="no document collection"):
        engine.reencode_documents(schema="nothing")


# -- neighbours from a store of the user's own (neighbour_search) ------------------------------------
OUTSIDE = {  # documents of the user's store that the collection does not hold
    "id.seine": "The Seine flows through Paris, past the Louvre and the Eiffel Tower, to the English Channel.",
    "id.alps": "The Alps are the highest mountain range in Europe, stretching across eight countries.",
}


def store_search(text: str) -> list[tuple[str, str]]:
    """A user's store, searched by text: the document itself first, then its nearest (fixed here)."""
    nearest = ["id.seine", "id.alps"] if "Paris" in text else ["id.alps", "id.seine"]
    own = [(n, t) for n, t in DOCS.items() if t == text]
    return own + [(n, OUTSIDE[n]) for n in nearest]


def test_neighbours_found_in_the_users_store_are_encoded_behind_now_or_in_the_background(make_tiny, tokenizer):
    for background in (False, True):
        engine = tiny(make_tiny, tokenizer, "llama")
        engine.add_documents([DOCS["louvre"]], ids=["louvre"], progress=False, context="neighbours", neighbours=2,
                             neighbour_search=store_search, background=background)
        assert engine.wait_for_documents(timeout=60)
        schema = engine.schemas["docs"]
        # the nearest right before it, never itself; the texts kept for the collection's replicas and deletions
        assert schema.contexts["louvre"].names == ("id.alps", "id.seine") and dict(schema.outside) == OUTSIDE
        assert "louvre" in schema.plain and exact(engine, ["louvre"]) <= 1e-4  # first: its plain variant


def test_a_failing_store_leaves_documents_plain_and_encoded(make_tiny, tokenizer, caplog):
    def broken(text: str) -> list[tuple[str, str]]:
        raise ConnectionError("vector store unreachable")

    engine = tiny(make_tiny, tokenizer, "llama")
    for search in (broken, lambda text: [("id.x", 42)]):  # unreachable; an answer that is not (name, text) pairs
        engine.add_documents([DOCS["fuji"]], ids=["fuji"], progress=False, context="neighbours", neighbours=2, neighbour_search=search)
        schema = engine.schemas["docs"]
        assert "fuji" in schema.documents and "fuji" not in schema.contexts and exact(engine, ["fuji"]) <= 1e-4
        engine.delete_documents(["fuji"])
    assert "encoded plain" in caplog.text


def test_a_store_neighbour_deleted_leaves_its_dependents_contexts_and_replicas_carry_the_texts(make_engine, redis_server):
    writer = make_engine(remote_store=redis_server.url)
    writer.add_documents([DOCS["louvre"], DOCS["fuji"]], ids=["louvre", "fuji"], progress=False, context="neighbours", neighbours=2,
                         neighbour_search=store_search)
    replica = make_engine(remote_store=redis_server.url)  # has no access to the user's store: the record carries the texts
    assert dict(replica.schemas["docs"].keys) == dict(writer.schemas["docs"].keys)
    assert dict(replica.schemas["docs"].outside) == OUTSIDE
    assert exact(replica, ["louvre"]) <= 1e-4 and replica.store_stats()["encoded"] == 0  # its plain variant, read remotely
    old = dict(writer.schemas["docs"].keys)
    assert writer.delete_documents(["id.seine"]) == []  # not a document of the collection: none removed ...
    schema = writer.schemas["docs"]
    # ... but gone from the contexts of the documents behind it, which are encoded behind the rest
    assert schema.contexts["louvre"].names == ("id.alps",) and schema.contexts["fuji"].names == ("id.alps",)
    assert "id.seine" not in schema.outside and schema.keys["louvre"] != old["louvre"] and old["louvre"] not in writer.store
    assert exact(writer, ["louvre"]) <= 1e-4
    replica.sync_documents()
    assert replica.schemas["docs"].contexts["louvre"].names == ("id.alps",)
