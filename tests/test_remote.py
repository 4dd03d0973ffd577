"""The remote tier with a real redis-server: sharing between engines and processes, outages,
corrupt and foreign entries, chunking, and the registry that travels with the KV."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from pc_rag import PromptCache, build_prompt
from pc_rag.kv.buffers import ModuleKV
from pc_rag.kv.remote import RemoteTier

DOCS = [
    "The cathedral bell was cast in 1822 and rings every hour.",
    "Lighthouse keepers logged the weather at dawn and at dusk.",
    "The river freezes most winters, and skaters cross it in January.",
    "A ferry carried mail across the strait twice a week.",
    "The old mill ground wheat until the flood of 1910.",
]
QUESTION = "When was it built?"


def prompts(names: list[str]) -> list:
    return [build_prompt(QUESTION, [name]) for name in names]


def test_a_fresh_engine_serves_from_redis_without_encoding(make_engine, redis_server):
    writer = make_engine(remote_store=redis_server.url)
    names = writer.add_documents(DOCS[:3], progress=False)
    local = make_engine()  # no remote tier: the answers a single process gives
    local.add_documents(DOCS[:3], progress=False)
    replica = make_engine(remote_store=redis_server.url)  # took the document records in at start
    assert set(replica.schemas["docs"].documents) == set(names)
    for prompt in prompts(names):
        assert replica.generate(prompt, max_new_tokens=8).token_ids == local.generate(prompt, max_new_tokens=8).token_ids
    # drop-in: the documents' text in a plain prompt is found and reused too
    plain = replica.generate(DOCS[1] + "\n\n" + QUESTION, max_new_tokens=8)
    assert plain.stats.cached_tokens > 10
    stats = replica.store_stats()
    assert stats["encoded"] == 0 and stats["hits_remote"] >= 4 and stats["misses"] == 0


def test_documents_added_later_by_another_replica_are_found_on_demand(make_engine, redis_server):
    replica = make_engine(remote_store=redis_server.url)
    writer = make_engine(remote_store=redis_server.url)
    (name,) = writer.add_documents(DOCS[3:4], progress=False)
    result = replica.generate(build_prompt(QUESTION, [name]), max_new_tokens=4)  # unknown here: registry read again
    assert result.stats.cached_tokens > 0 and replica.store_stats()["encoded"] == 0
    assert replica.registry_sync.seen == {"docs": 1}  # a later read starts after the records already taken in
    assert replica.sync_documents() == 0


def test_pml_schemas_travel_too(make_engine, redis_server):
    from pathlib import Path

    from pc_rag import PML

    examples = Path(__file__).resolve().parents[1] / "examples"
    writer = make_engine(remote_store=redis_server.url)
    writer.add_schema((examples / "travel.xml").read_text(), progress=False)
    prompt = PML((examples / "travel_prompt.xml").read_text())
    replica = make_engine(remote_store=redis_server.url)
    assert "travel" in replica.schemas and replica.store_stats()["encoded"] == 0
    assert replica.generate(prompt, max_new_tokens=6).token_ids == writer.generate(prompt, max_new_tokens=6).token_ids
    assert replica.store_stats()["encoded"] == 0


def test_engines_of_another_model_share_the_redis_but_never_an_entry(make_engine, redis_server):
    llama = make_engine("llama", remote_store=redis_server.url)
    llama.add_documents(DOCS[:2], progress=False)
    qwen = make_engine("qwen2", remote_store=redis_server.url)
    assert "docs" not in qwen.schemas  # another fingerprint: another namespace
    qwen.add_documents(DOCS[:2], progress=False)
    assert qwen.store_stats()["encoded"] == 3 and qwen.store_stats()["hits_remote"] == 0


def kv_records(client, engine: PromptCache) -> list[str]:
    """The Redis keys of the engine's module records (``...:<collection>:kv:<digest>``, not their chunks)."""
    return [k.decode() for k in client.keys(engine.remote.link.prefix + "*:kv:*") if len(k.decode().rsplit(":", 1)[1]) == 64]


def record_body(client, record_key: str) -> dict:
    return json.loads(client.get(record_key).decode().partition(" ")[2])


def corrupt(redis_server, engine: PromptCache, how: str) -> None:
    client = redis_server.client()
    records = kv_records(client, engine)
    assert records
    for record_key in records:
        if how == "bit flip":
            chunk = client.get(record_key + ":0")
            position = len(chunk) // 2
            client.setrange(record_key + ":0", position, bytes([chunk[position] ^ 0x01]))
        elif how == "foreign fingerprint":
            record = record_body(client, record_key)
            record["fingerprint"] = "0" * 32
            client.set(record_key, "- " + json.dumps(record))
        elif how == "missing chunk":
            client.delete(record_key + ":0")
        elif how == "truncated":
            chunk = client.get(record_key + ":0")
            client.set(record_key + ":0", chunk[: len(chunk) // 2])


@pytest.mark.parametrize("how", ["bit flip", "foreign fingerprint", "missing chunk", "truncated"])
def test_a_bad_entry_is_rejected_re_encoded_and_replaced(make_engine, redis_server, how, caplog):
    writer = make_engine(remote_store=redis_server.url)
    names = writer.add_documents(DOCS[:2], progress=False)
    expected = [writer.generate(p, max_new_tokens=6).token_ids for p in prompts(names)]
    corrupt(redis_server, writer, how)
    reader = make_engine(remote_store=redis_server.url)
    with caplog.at_level("WARNING", logger="pc_rag.kv.remote"):
        got = [reader.generate(p, max_new_tokens=6).token_ids for p in prompts(names)]
    assert got == expected
    assert "rejected" in caplog.text and "re-encoded" in caplog.text
    assert reader.store_stats()["hits_remote"] == 0 and reader.store_stats()["encoded"] == 3  # prefix + 2 documents
    # the re-encoded entries replaced the bad ones: a third engine reads them
    third = make_engine(remote_store=redis_server.url)
    assert [third.generate(p, max_new_tokens=6).token_ids for p in prompts(names)] == expected
    assert third.store_stats()["encoded"] == 0


def test_large_values_are_chunked_and_read_back_whole(redis_server):
    tier = RemoteTier(redis_server.url, "f" * 32, chunk_bytes=1000)
    module = ModuleKV(torch.randn(2, 2, 2, 37, 8), torch.arange(5, 42))
    key = "docs/" + "a" * 64
    assert tier.save(key, module, {"tokens": 37})
    client = redis_server.client()
    record_key = f"pcrag:{'f' * 32}:v3:docs:kv:{'a' * 64}"
    record = record_body(client, record_key)
    assert record["chunks"] > 5 and all(len(client.get(f"{record_key}:{i}")) <= 1000 for i in range(record["chunks"]))
    back = tier.load(key)
    assert torch.equal(back.kv, module.kv) and torch.equal(back.positions, module.positions)


def test_an_outage_mid_run_fails_no_request_and_hits_resume(make_engine, redis_server):
    names = None
    engine = make_engine(remote_store=redis_server.url)
    engine.remote.link.retry_s = 0.0  # try Redis again at every lookup (no waiting in a test)
    names = engine.add_documents(DOCS, progress=False)
    reference = make_engine()
    reference.add_documents(DOCS, progress=False)
    expected = [reference.generate(p, max_new_tokens=6).token_ids for p in prompts(names)]
    seen = {}
    for request in range(50):
        if request == 20:
            redis_server.stop()
            seen["before"] = engine.store_stats()
        if request == 35:
            redis_server.start()  # a restarted, empty Redis
            seen["during"] = engine.store_stats()
        engine.store.clear_memory()  # each request reads module KV from a tier, not from memory
        result = engine.generate(prompts(names)[request % 5], max_new_tokens=6)
        assert result.token_ids == expected[request % 5]
    after = engine.store_stats()
    assert seen["before"]["hits_remote"] >= 20
    assert seen["during"]["hits_remote"] == seen["before"]["hits_remote"]  # down: skipped
    assert seen["during"]["encoded"] > seen["before"]["encoded"]  # ... and the work done locally
    assert after["hits_remote"] > seen["during"]["hits_remote"]  # back: hits resume
    assert redis_server.client().dbsize() > 0  # what was encoded during the outage was written back


def test_redis_down_at_start_serves_locally(make_engine, redis_server):
    url = redis_server.url
    redis_server.stop()
    engine = make_engine(remote_store=url)
    names = engine.add_documents(DOCS[:2], progress=False)
    assert engine.generate(prompts(names)[0], max_new_tokens=4).stats.cached_tokens > 0
    assert engine.remote.errors >= 1


def test_a_slow_or_full_redis_is_skipped(make_engine, redis_server):
    engine = make_engine(remote_store=redis_server.url)
    engine.remote.link.retry_s = 0.0  # try Redis at every lookup (no waiting in a test)
    names = engine.add_documents(DOCS[:2], progress=False)
    engine.store.clear_memory()  # the next request reads module KV from Redis
    client = redis_server.client()
    # slow: every other client's commands wait 500 ms, ten times the tier's timeout
    client.client_pause(500, all=True)
    result = engine.generate(prompts(names)[0], max_new_tokens=4)
    assert result.stats.cached_tokens > 0 and engine.remote.errors >= 1
    assert engine.store_stats()["encoded"] > 3  # prefix + 2 documents, then the one asked for again, without Redis
    # full: writes refused (OOM); new documents are served anyway
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", "1")
    errors = engine.remote.errors
    more = engine.add_documents(DOCS[2:4], progress=False)
    assert engine.generate(prompts(more)[1], max_new_tokens=4).stats.cached_tokens > 0
    assert engine.remote.errors > errors


REPLICA = textwrap.dedent("""
    import json, sys
    from pc_rag import PromptCache, build_prompt
    import pc_rag.kv.load_or_compute
    pc_rag.kv.load_or_compute.MIN_SAVING_S = 3600.0  # count tier hits: a tiny model would rightly compute instead (conftest)
    model, url, role = sys.argv[1:4]
    docs = json.loads(sys.argv[4])
    engine = PromptCache.from_pretrained(model, remote_store=url, recompute=0, attention_temperature=1.0, attention_scale=1.0)
    if role == "encode":
        print(json.dumps({"names": engine.add_documents(docs, progress=False)}))
    else:
        names = sorted(engine.schemas["docs"].documents)
        answers = {n: engine.generate(build_prompt("When was it built?", [n]), max_new_tokens=6).token_ids for n in names}
        print(json.dumps({"answers": answers, "stats": engine.store_stats()}))
""")


def test_two_replica_processes_and_an_encoder_share_one_redis(saved_model, redis_server, tmp_path):
    script = tmp_path / "replica.py"
    script.write_text(REPLICA)

    def run(role: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), str(saved_model), redis_server.url, role, json.dumps(DOCS)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(process: subprocess.Popen) -> dict:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-2000:]
        return json.loads(out.strip().splitlines()[-1])

    names = result(run("encode"))["names"]
    replicas = [result(p) for p in [run("serve"), run("serve")]]  # started together
    single = PromptCache.from_pretrained(str(saved_model), recompute=0, attention_temperature=1.0, attention_scale=1.0)
    single.add_documents(DOCS, progress=False)
    expected = {n: single.generate(build_prompt(QUESTION, [n]), max_new_tokens=6).token_ids for n in sorted(names)}
    for replica in replicas:
        assert replica["stats"]["encoded"] == 0 and replica["stats"]["hits_remote"] == len(DOCS) + 1
        assert replica["answers"] == expected


def test_a_document_queued_on_one_replica_is_listed_read_and_deleted_on_another(make_engine, redis_server):
    """Before, a document was queued in the memory of the replica that took it: another replica
    listed nothing for it, could not delete it (its DELETE answered 404 and the document came back
    encoded), and a request there naming it got 404."""
    holder = make_engine(remote_store=redis_server.url)
    other = make_engine(remote_store=redis_server.url)
    holder.background.grace_s = 3600.0  # stays queued until asked for
    holder.add_documents(DOCS[:1], ids=["seed"], progress=False)
    holder.add_documents(DOCS[1:3], ids=["kept", "gone"], schema="docs", background=True)
    assert {n: s.status for n, s in other.background.statuses("docs").items()} == {"kept": "queued", "gone": "queued"}
    assert other.background.text("docs", "gone") == DOCS[2]  # what a request there reads while it waits
    assert other.delete_documents("gone") == ["gone"]  # the shared queue is the truth
    assert "gone" not in holder.background.statuses("docs") and holder.background.queued("docs") == ["kept"]
    assert holder.wait_for_documents(timeout=120)
    assert other.sync_documents() >= 1 and set(other.schemas["docs"].documents) == {"seed", "kept"}
    assert other.background.statuses("docs") == {}  # encoded: no longer in the shared queue
    # deleted through another replica while it was being encoded: deleted as that ends, everywhere
    add = holder.background._add  # noqa: SLF001 - the engine's own add, with the other replica's DELETE in the middle of it

    def add_while_deleted_elsewhere(records, **kwargs):
        assert other.delete_documents("late") == ["late"]
        return add(records, **kwargs)

    holder.background._add = add_while_deleted_elsewhere  # noqa: SLF001
    holder.add_documents(DOCS[3:4], ids=["late"], background=True)
    assert holder.wait_for_documents(timeout=120) and "late" not in holder.schemas["docs"].documents
    other.sync_documents()
    assert "late" not in other.schemas["docs"].documents
