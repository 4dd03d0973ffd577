"""Deleting documents: gone from every tier, every index and every replica; metadata filters."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from pc_rag import PromptCacheError, build_prompt, module_reference

DOCS = [
    "The cathedral bell was cast in 1822 and rings every hour.",
    "Lighthouse keepers logged the weather at dawn and at dusk.",
    "The river freezes most winters, and skaters cross it in January.",
]
QUESTION = "When was it built?"


def test_a_deleted_document_is_gone_from_every_tier_and_index(make_engine, redis_server, tmp_path):
    engine = make_engine(kv_dir=tmp_path / "kv", remote_store=redis_server.url)
    names = engine.add_documents(DOCS, ids=["bell", "keepers", "river"], progress=False)
    engine.add_documents([DOCS[0]], ids=["bell-again"], progress=False)  # the same text under a second id: one entry
    entry = engine.schemas["docs"].keys["bell"]
    kept = engine.schemas["docs"].keys["keepers"]
    client = redis_server.client()
    record = engine.remote._record_key(kept)
    assert client.exists(record) and list((tmp_path / "kv").rglob("*.safetensors"))
    assert engine.delete_documents(["keepers", "no-such-document"]) == ["keepers"]
    # the registry and the drop-in index: not importable, not matched
    assert "keepers" not in engine.schemas["docs"].documents
    with pytest.raises(PromptCacheError, match="unknown module <keepers/>"):
        engine.plan(build_prompt(QUESTION, ["keepers"]))
    with pytest.raises(PromptCacheError, match="unknown module 'keepers'"):
        engine.plan(module_reference("keepers"))
    assert engine.generate(f"{DOCS[1]}\n\n{QUESTION}", max_new_tokens=2).stats.modules == []
    # memory, disk, Redis (record and chunks)
    assert not engine.store.in_memory(kept) and kept not in engine.store
    assert not any(kept.split("/")[1] in p.name for p in (tmp_path / "kv").rglob("*"))
    assert not client.keys(record + "*")
    # an entry another id still uses stays
    assert engine.delete_documents("bell") == ["bell"] and entry in engine.store
    assert engine.generate(build_prompt(QUESTION, ["bell-again"]), max_new_tokens=2).stats.cached_tokens > 0
    # the name is free again, for another text
    assert engine.add_documents(["The keepers' log ended in 1931."], ids=["keepers"], progress=False) == ["keepers"]
    engine.add_schema('<schema name="kb"><module name="m">Some module text.</module></schema>', progress=False)
    with pytest.raises(PromptCacheError, match="PML schema"):
        engine.delete_documents(["m"], schema="kb")
    assert names == ["bell", "keepers", "river"]


REPLICA = textwrap.dedent("""
    import json, sys
    from pc_rag import PromptCache, PromptCacheError, build_prompt
    from pc_rag.retrievers import FaissModuleRetriever
    model, url, text = sys.argv[1], sys.argv[2], sys.argv[3]
    engine = PromptCache.from_pretrained(model, remote_store=url, remote_sync_interval_s=0, recompute=0,
                                         attention_temperature=1.0, attention_scale=1.0)

    def look():
        out = {}
        try:
            out["cached"] = engine.generate(build_prompt("When was it built?", ["keepers"]), max_new_tokens=2).stats.cached_tokens
        except PromptCacheError as err:
            out["cached"] = str(err)
        out["drop_in"] = engine.generate(text + "\\n\\nWhen was it built?", max_new_tokens=2).stats.modules
        out["held"] = sorted(engine.schemas["docs"].documents)
        return out

    before = look()
    print(json.dumps(before), flush=True)
    sys.stdin.readline()  # the other replica deletes now
    print(json.dumps({"after": look(), "stats": engine.store_stats()}), flush=True)
""")


def test_a_document_deleted_on_one_replica_is_gone_on_the_other(saved_model, redis_server, tmp_path):
    from pc_rag import PromptCache

    writer = PromptCache.from_pretrained(str(saved_model), remote_store=redis_server.url, recompute=0,
                                         attention_temperature=1.0, attention_scale=1.0)
    writer.add_documents(DOCS, ids=["bell", "keepers", "river"], progress=False)
    script = tmp_path / "replica.py"
    script.write_text(REPLICA)
    replica = subprocess.Popen([sys.executable, str(script), str(saved_model), redis_server.url, DOCS[1]],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        before = json.loads(replica.stdout.readline() or "{}")
        assert before["held"] == ["bell", "keepers", "river"] and before["cached"] > 0 and before["drop_in"] == ["keepers"]
        assert writer.delete_documents(["keepers"]) == ["keepers"]
        out, err = replica.communicate("go\n", timeout=300)
    finally:
        replica.kill()
    assert replica.returncode == 0, err[-2000:]
    after = json.loads(out.strip().splitlines()[-1])["after"]
    assert after["held"] == ["bell", "river"]
    assert "unknown module <keepers/>" in after["cached"] and after["drop_in"] == []
    # a fresh replica replays the log: added, then deleted
    fresh = PromptCache.from_pretrained(str(saved_model), remote_store=redis_server.url)
    assert sorted(fresh.schemas["docs"].documents) == ["bell", "river"]


@pytest.fixture(scope="module")
def embedder():
    from pc_rag.embedding import load_embedder

    return load_embedder(None)[0]


def test_retriever_delete_and_filters(make_engine, embedder, tmp_path):
    from pc_rag.integrations.langchain import PromptCacheRetriever
    from pc_rag.retrievers import FaissModuleRetriever

    engine = make_engine()
    index = FaissModuleRetriever(embedder, engine=engine)
    index.add(DOCS, ids=["bell", "keepers", "river"], metadatas=[{"year": 1822, "kind": "bell"}, {"year": 1890, "kind": "light"},
                                                                 {"year": 1990, "kind": "water"}], progress=False)
    index.add(["A bell foundry cast church bells."], ids=["foundry"], metadatas=[{"year": 1700}], schema="other", progress=False)
    assert [h.module for h in index.search("bell", k=4, filter={"kind": "bell"})] == ["bell"]
    assert {h.module for h in index.search("bell", k=4, filter={"year": {"$gte": 1850}})} == {"keepers", "river"}
    assert {h.module for h in index.search("bell", k=4, filter={"$or": [{"kind": {"$in": ["water"]}}, {"year": 1700}]})} == {"river", "foundry"}
    assert {h.module for h in index.search("bell", k=4, collections=["other"])} == {"foundry"}
    assert index.search("bell", filter={"kind": "none"}) == []
    with pytest.raises(PromptCacheError, match="unknown operator"):
        index.search("bell", filter={"year": {"$near": 3}})
    # LangChain users write search_kwargs
    lc = PromptCacheRetriever(retriever=index, search_kwargs={"k": 2, "filter": {"kind": {"$ne": "bell"}}}, collections=["docs"])
    assert {d.metadata["module"] for d in lc.invoke("bell")} == {"keepers", "river"}
    assert [d.metadata["module"] for d in lc.invoke("bell", filter={"kind": "water"})] == ["river"]
    # delete through the retriever: gone from the index and from the engine
    assert index.delete(["keepers"]) == ["keepers"] and "keepers" not in index.names
    assert "keepers" not in engine.schemas["docs"].documents
    # deleted through the engine: the bound index forgets it too
    engine.delete_documents(["river"])
    assert {h.module for h in index.search("river", k=4, collections=["docs"])} == {"bell"}
    loaded = FaissModuleRetriever.load(index.save(tmp_path / "idx"), embedding=embedder)
    assert sorted(loaded.names) == ["bell", "foundry"] and loaded.search("bell", k=1, collections="other")[0].module == "foundry"


def test_llama_index_retriever_takes_metadata_filters(make_engine, embedder):
    from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters

    from pc_rag.integrations.llama_index import PromptCacheRetriever
    from pc_rag.retrievers import FaissModuleRetriever

    index = FaissModuleRetriever(embedder, engine=make_engine())
    index.add(DOCS, ids=["bell", "keepers", "river"], metadatas=[{"year": 1822}, {"year": 1890}, {"year": 1990}], progress=False)
    filters = MetadataFilters(filters=[MetadataFilter(key="year", value=1822),
                                       MetadataFilter(key="year", value=1950, operator=FilterOperator.GT)], condition=FilterCondition.OR)
    nodes = PromptCacheRetriever(index, k=3, filter=filters).retrieve("bell")
    assert {n.node.metadata["module"] for n in nodes} == {"bell", "river"}
    with pytest.raises(PromptCacheError, match="not supported"):
        PromptCacheRetriever(index, filter=MetadataFilters(filters=[MetadataFilter(key="t", value="x", operator=FilterOperator.TEXT_MATCH)]))
