"""A shared Redis written by someone else: every replica starts, serves the right answer and says
what it skipped, whatever the registry and the payloads hold (a real redis-server)."""

from __future__ import annotations

import json
import logging
import zlib

import pytest
import torch

from pc_rag import PromptCache, PromptCacheError, build_prompt
from pc_rag.kv.buffers import ModuleKV
from pc_rag.kv.records import serialize
from pc_rag.kv.remote import RemoteTier

DOCS = [
    "The cathedral bell was cast in 1822 and rings every hour.",
    "Lighthouse keepers logged the weather at dawn and at dusk.",
    "The river freezes most winters, and skaters cross it in January.",
    "A ferry carried mail across the strait twice a week.",
]
QUESTION = "When was it built?"
KEY = "operator-key-1"


def answers(engine: PromptCache, names: list[str]) -> list[list[int]]:
    return [engine.generate(build_prompt(QUESTION, [n]), max_new_tokens=6).token_ids for n in names]


@pytest.fixture
def local(make_engine):
    """What one process with no shared tier answers."""
    engine = make_engine()
    engine.add_documents(DOCS, ids=["bell", "keepers", "river", "ferry"], progress=False)
    return engine


def record(client, key: str) -> tuple[str, dict]:
    mac, _, body = client.get(key).decode().partition(" ")
    return mac, json.loads(body)


def test_bad_registry_records_are_skipped_and_the_good_ones_taken(make_engine, redis_server, local, caplog):
    writer = make_engine(remote_store=redis_server.url)
    writer.add_documents(DOCS[:2], ids=["bell", "keepers"], progress=False)
    tier, client = writer.remote, redis_server.client()
    log = tier.log._log_key("docs")
    client.rpush(log,
                 b"\xff\xfe not utf-8", "- not json", "- [1, 2, 3]",  # garbage, non-JSON, a JSON list
                 "- " + json.dumps({"op": "add", "name": "9-starts-with-a-digit", "text": "x"}),  # an invalid id
                 "- " + json.dumps({"op": "add", "name": "empty", "text": ""}),
                 "- " + json.dumps({"op": "add", "name": "listmeta", "text": "y", "metadata": [1]}),
                 "- " + json.dumps({"op": "explode"}))
    assert tier.log.publish_documents("docs", writer.schemas["docs"].system, [{"name": "river", "text": DOCS[2], "metadata": {}}])
    # a collection whose record is of the wrong type, a key of the wrong type, a bad collection name
    client.sadd(tier.link.prefix + "collections", "broken", "bad name!", "wrongtype")
    client.set(tier.log._meta_key("broken"), "- [1]")
    client.set(tier.log._meta_key("wrongtype"), "- " + json.dumps({"collection": "wrongtype", "kind": "documents", "system": None}))
    client.set(tier.log._log_key("wrongtype"), "a string, not a list")
    with caplog.at_level(logging.WARNING, logger="pc_rag.kv.remote"):
        replica = make_engine(remote_store=redis_server.url)  # starts: nothing raised
    assert sorted(replica.schemas["docs"].documents) == ["bell", "keepers", "river"]
    assert replica.remote.rejected >= 8 and "rejected" in caplog.text and "not JSON" in caplog.text
    assert answers(replica, ["bell", "keepers", "river"]) == answers(local, ["bell", "keepers", "river"])
    assert replica.store_stats()["encoded"] == 1  # river: published as a record alone, its KV encoded on first use
    # nothing advanced past what was read: a record appended later is taken at the next sync
    tier.log.publish_documents("docs", writer.schemas["docs"].system, [{"name": "ferry", "text": DOCS[3], "metadata": {}}])
    assert replica.sync_documents() == 1 and "ferry" in replica.schemas["docs"].documents


def test_thirty_thousand_records_are_read_in_pages(make_engine, redis_server):
    writer = make_engine(remote_store=redis_server.url)
    writer.add_documents(DOCS[:1], ids=["bell"], progress=False)
    system = writer.schemas["docs"].system
    records = [{"name": f"r{i}", "text": f"Record {i} is about topic {i % 97}.", "metadata": {"i": i}} for i in range(30_000)]
    for start in range(0, len(records), 5000):
        assert writer.remote.log.publish_documents("docs", system, records[start : start + 5000])
    replica = make_engine(remote_store=redis_server.url)
    held = replica.schemas["docs"].documents
    assert len(held) == 30_001 and held["r29999"].metadata == {"i": 29999}
    assert replica.remote.errors == 0  # no command ran into the KV tier's timeout
    assert replica.generate(build_prompt(QUESTION, ["r12345"]), max_new_tokens=2).stats.cached_tokens > 0


def swap(client, tier, source: str, target: str, *, rewrite: bool) -> None:
    """Copy entry ``source``'s record and chunks over entry ``target``'s (optionally claiming to be it)."""
    mac, body = record(client, source)
    for i in range(body["chunks"]):
        client.set(f"{target}:{i}", client.get(f"{source}:{i}"))
    if rewrite:  # what someone who can write to Redis but has no key can do
        _, own = record(client, target)
        body = {**body, "key": own["key"]}
    client.set(target, f"{mac} {json.dumps(body)}")


@pytest.mark.parametrize("key", [None, KEY])
def test_a_swapped_payload_is_rejected_and_rebuilt(make_engine, redis_server, local, key, caplog):
    writer = make_engine(remote_store=redis_server.url, remote_key=key)
    names = writer.add_documents(DOCS[:2], ids=["bell", "keepers"], progress=False)  # the same token count: same shape
    keys = [writer.remote._record_key(writer.schemas["docs"].keys[n]) for n in names]
    swap(redis_server.client(), writer.remote, keys[0], keys[1], rewrite=key is not None)
    replica = make_engine(remote_store=redis_server.url, remote_key=key)
    with caplog.at_level(logging.WARNING):
        assert answers(replica, names) == answers(local, names)
    assert replica.remote.rejected == 1 and replica.store_stats()["encoded"] == 1
    assert ("MAC does not verify" if key else "written for another model") in caplog.text


def forge(client, tier, target: str, module: ModuleKV) -> None:
    """Put ``module`` under ``target`` with a record a careful forger would write (right key,
    fingerprint, size, checksum; no key to sign it with)."""
    blob = serialize(module)
    _, body = record(client, target)
    for i in range(body["chunks"]):
        client.delete(f"{target}:{i}")
    client.set(f"{target}:0", blob)
    client.set(target, "- " + json.dumps({**body, "chunks": 1, "bytes": len(blob), "crc32": zlib.crc32(blob)}))


@pytest.mark.parametrize("payload", ["another model", "wrong length", "wrong dtype"])
def test_a_well_formed_payload_that_is_not_this_module_is_rejected(make_engine, make_tiny, tokenizer, redis_server, local,
                                                                   payload, caplog):
    writer = make_engine(remote_store=redis_server.url)
    names = writer.add_documents(DOCS[:3], ids=["bell", "keepers", "river"], progress=False)
    entry = writer.schemas["docs"].keys["river"]
    module = writer.store.get(entry)
    if payload == "another model":  # one KV head instead of two
        other = PromptCache(make_tiny("llama", num_key_value_heads=1), tokenizer, recompute=0)
        forged = other.forward.encode(writer.schemas["docs"].layout.modules["river"].token_ids, module.positions.tolist())
    elif payload == "wrong length":
        forged = ModuleKV(module.kv[:, :, :, :-3].clone(), module.positions[:-3].clone())
    else:
        forged = ModuleKV(module.kv.to(torch.float16), module.positions.clone())
    forge(redis_server.client(), writer.remote, writer.remote._record_key(entry), forged)
    replica = make_engine(remote_store=redis_server.url)
    with caplog.at_level(logging.WARNING, logger="pc_rag.kv.store"):
        assert answers(replica, names) == answers(local, names)  # never served, never raised
    assert "discarding remote entry" in caplog.text and replica.store_stats()["encoded"] == 1
    third = make_engine(remote_store=redis_server.url)  # the rebuilt entry replaced it
    assert answers(third, names) == answers(local, names) and third.store_stats()["encoded"] == 0


def test_with_a_key_unauthenticated_records_are_skipped(make_engine, redis_server, local, caplog):
    stranger = make_engine(remote_store=redis_server.url)  # no key: its records are unsigned
    stranger.add_documents(DOCS[:2], ids=["bell", "keepers"], progress=False)
    with caplog.at_level(logging.WARNING, logger="pc_rag.kv.remote"):
        replica = make_engine(remote_store=redis_server.url, remote_key=KEY)
    assert "docs" not in replica.schemas and "not authenticated" in caplog.text
    # its own documents: the unsigned KV entries under the same keys are rejected and rebuilt, signed
    names = replica.add_documents(DOCS[:2], ids=["bell", "keepers"], progress=False)
    assert answers(replica, names) == answers(local, names)
    peer = make_engine(remote_store=redis_server.url, remote_key=KEY)
    assert sorted(peer.schemas["docs"].documents) == ["bell", "keepers"]
    assert answers(peer, names) == answers(local, names) and peer.store_stats()["encoded"] == 0


def test_key_rotation_accepts_the_previous_key(make_engine, redis_server, local, monkeypatch):
    old = make_engine(remote_store=redis_server.url, remote_key="old-key")
    names = old.add_documents(DOCS[:2], ids=["bell", "keepers"], progress=False)
    rotated = make_engine(remote_store=redis_server.url, remote_key=["new-key", "old-key"])
    assert answers(rotated, names) == answers(local, names) and rotated.store_stats()["encoded"] == 0
    monkeypatch.setenv("PC_RAG_REMOTE_KEY", "new-key")
    only_new = make_engine(remote_store=redis_server.url)  # the key from the environment
    assert only_new.remote.link.signer.enabled and "docs" not in only_new.schemas
    with pytest.raises(PromptCacheError, match="remote_key"):
        make_engine(remote_store=redis_server.url, remote_key=[])


def test_an_older_format_is_neither_read_nor_overwritten(make_engine, redis_server, local):
    writer = make_engine(remote_store=redis_server.url)
    names = writer.add_documents(DOCS[:2], ids=["bell", "keepers"], progress=False)
    assert ":v3:" in writer.remote.link.prefix  # the payload format is part of the namespace
    client = redis_server.client()
    target = writer.remote._record_key(writer.schemas["docs"].keys["bell"])
    mac, body = record(client, target)
    client.set(target, f"{mac} {json.dumps({**body, 'format': 1})}")  # an entry claiming an older format
    replica = make_engine(remote_store=redis_server.url)
    assert answers(replica, names) == answers(local, names) and replica.store_stats()["encoded"] == 1


def test_write_back_after_an_outage_stores_what_put_stores(make_engine, redis_server):
    up = make_engine(remote_store=redis_server.url, store_dtype=torch.float16)
    (name,) = up.add_documents(DOCS[:1], ids=["bell"], progress=False)
    client = redis_server.client()
    entry = up.remote._record_key(up.schemas["docs"].keys[name])
    stored = {k: client.get(k) for k in (f"{entry}:0",)}
    url = redis_server.url
    redis_server.stop()
    down = make_engine(remote_store=url, store_dtype=torch.float16)
    down.remote.link.retry_s, down.remote.link._down_until = 0.0, 0.0  # try Redis at every lookup (no waiting in a test)
    down.add_documents(DOCS[:1], ids=["bell"], progress=False)  # encoded while Redis is away: pending
    redis_server.start()  # empty
    for _ in range(3):  # the next lookups write the pending entries back
        down.generate(build_prompt(QUESTION, [name]), max_new_tokens=2)
    assert not down.store.unshared()
    assert client.get(f"{entry}:0") == stored[f"{entry}:0"]  # byte for byte what put wrote
    assert RemoteTier(url, up.fingerprint).load(up.schemas["docs"].keys[name]).kv.dtype == torch.float16
    full = make_engine(remote_store=url)  # float32 entries: another namespace, never mixed
    assert full.fingerprint != up.fingerprint and "docs" not in full.schemas


def test_entries_can_expire(make_engine, redis_server):
    engine = make_engine(remote_store=redis_server.url, remote_ttl_s=600)
    engine.add_documents(DOCS[:1], ids=["bell"], progress=False)
    entry = engine.remote._record_key(engine.schemas["docs"].keys["bell"])
    assert 0 < redis_server.client().pttl(entry) <= 600_000 and 0 < redis_server.client().pttl(entry + ":0") <= 600_000
    with pytest.raises(PromptCacheError, match="remote_ttl_s"):
        make_engine(remote_store=redis_server.url, remote_ttl_s=0)


def test_a_redis_acl_confines_a_tenants_replica_to_its_collections(make_engine, redis_server, local):
    admin = make_engine(remote_store=redis_server.url)
    admin.add_documents(DOCS[2:], ids=["river", "ferry"], schema="globex", progress=False)
    client = redis_server.client()
    client.execute_command("ACL", "SETUSER", "acme", "on", ">acme-password", "~pcrag:*:v3:acme:*", "+@all", "-@dangerous")
    url = redis_server.url.replace("redis://", "redis://acme:acme-password@")
    tenant = make_engine(remote_store=url, remote_collections=["acme"])
    names = tenant.add_documents(DOCS[:2], ids=["bell", "keepers"], schema="acme", progress=False)
    assert tenant.remote.errors == 0 and not tenant.store.unshared() and not tenant.registry_sync.flush_unpublished()
    peer = make_engine(remote_store=url, remote_collections=["acme"])  # another replica of the same tenant
    assert sorted(peer.schemas) == ["acme"] and peer.store_stats()["encoded"] == 0
    expected = [local.generate(build_prompt(QUESTION, [n]), max_new_tokens=6).token_ids for n in names]
    assert [peer.generate(build_prompt(QUESTION, [n], schema="acme"), max_new_tokens=6).token_ids for n in names] == expected
    assert peer.store_stats()["encoded"] == 0 and peer.store_stats()["hits_remote"] == 3
    # the tenant's credentials cannot read another tenant's collection
    snooper = make_engine(remote_store=url, remote_collections=["globex"])
    assert "globex" not in snooper.schemas and snooper.remote.rejected >= 1


def test_a_log_begun_again_after_redis_comes_back_empty_is_read_from_its_start(make_engine, redis_server, local):
    writer = make_engine(remote_store=redis_server.url)
    writer.add_documents(DOCS[:3], ids=["bell", "keepers", "river"], progress=False)
    replica = make_engine(remote_store=redis_server.url)  # has read 3 entries of the log
    replica.remote.link.retry_s = 0.0
    redis_server.stop()
    redis_server.start()  # empty
    make_engine(remote_store=redis_server.url).add_documents(DOCS[3:], ids=["ferry"], progress=False)  # a log of one entry
    for _ in range(3):  # the replica's old connection may fail once before it reconnects
        if replica.sync_documents():
            break
    assert "ferry" in replica.schemas["docs"].documents
    assert answers(replica, ["ferry"]) == answers(local, ["ferry"])
