"""Load or recompute (pc_rag.kv.load_or_compute) against a real redis-server, directly and behind a proxy that
forwards at ~2 MB/s; and the remote tier's hygiene: uploads off the request path, no MULTI/EXEC,
no SCAN, one round trip for many lookups."""

from __future__ import annotations

import threading

import pytest
import torch

import pc_rag.kv.load_or_compute
from pc_rag import PromptCache, build_prompt
from pc_rag.kv.buffers import ModuleKV
from pc_rag.kv.load_or_compute import CostModel
from pc_rag.kv.remote import RemoteTier

from .conftest import SQUAD


@pytest.fixture
def measured_choice(monkeypatch):
    """The load-or-compute choice as it ships (conftest turns it off for tests that count hits)."""
    monkeypatch.setattr(pc_rag.kv.load_or_compute, "MIN_SAVING_S", 0.005)


def _passages() -> list[str]:
    import json

    data = json.loads(SQUAD.read_text())["data"]
    return [p["context"] for article in data for p in article["paragraphs"]][:4]


def test_the_cost_model_weighs_measured_loads_against_measured_prefill():
    costs = CostModel(min_saving_s=0.0)
    assert not costs.recompute("remote", 10**6, 100)  # nothing measured: load (and measure)
    costs.observe_load("remote", 0.001, 0.5, 10**6)  # 2 MB/s
    assert not costs.recompute("remote", 10**6, 100)  # no prefill rate yet: still load
    costs.observe_prefill(1000, 1.0)  # 1 ms per token
    assert costs.recompute("remote", 10**6, 100)  # 0.1 s of compute beats 0.5 s of transfer
    assert not costs.recompute("remote", 10**6, 1000)  # 1 s of compute does not
    assert abs(costs.snapshot()["remote_mb_per_s"] - 2.0) < 1e-6
    for _ in range(20):  # the tier speeds up: followed within a few loads
        costs.observe_load("remote", 0.001, 0.001, 10**6)
    assert not costs.recompute("remote", 10**6, 100)
    slow = CostModel(min_saving_s=1.0)
    slow.observe_load("remote", 0.0, 0.5, 10**6)
    slow.observe_prefill(1000, 0.001)
    assert not slow.recompute("remote", 10**6, 100)  # faster, but by less than the floor: keep loading


def test_a_tier_slower_than_prefill_at_every_size_is_not_even_asked():
    costs = CostModel(min_saving_s=0.0)
    assert not costs.never_load("remote", 46_000)  # nothing measured
    costs.observe_prefill(100, 0.1)
    costs.observe_prefill(1000, 0.55)  # 50 ms + 0.5 ms per token
    costs.observe_load("remote", 0.002, 0.5, 10**6)  # 2 MB/s: 23 ms per 46 KB token
    assert costs.never_load("remote", 46_000)
    fast = CostModel(min_saving_s=0.0)
    fast.observe_prefill(100, 0.1)
    fast.observe_prefill(1000, 0.55)
    fast.observe_load("remote", 0.0005, 0.001, 10**6)  # 1 GB/s: loading wins for long modules
    assert not fast.never_load("remote", 46_000)


def test_a_short_cached_prefix_is_computed_with_the_prompt(smollm):
    """A prompt whose only cached KV is a short prefix (the system prompt; its documents computed,
    e.g. behind a slow tier, or never registered) runs as full prefill does: from an empty cache,
    with the causal kernel, instead of over a cache that forces an explicit mask (1.27x slower)."""
    engine = PromptCache(smollm.model, smollm.tokenizer)
    engine.add_documents(_passages()[:1], progress=False)
    other = PromptCache(smollm.model, smollm.tokenizer)
    # a prompt laid out as the collection lays out its prompts, over documents this engine does not hold
    layout = other.plan(build_prompt("Who won?", other.add_documents(_passages()[1:], progress=False)))
    unregistered = smollm.tokenizer.decode(layout.input_ids)
    assert 0 < engine.plan(unregistered).cached_tokens < 40  # the planner reads the system prompt from the cache ...
    assert engine.generate(unregistered, max_new_tokens=1).stats.cached_tokens == 0  # ... it is computed with the rest
    assert torch.allclose(engine.next_token_logits(unregistered), engine.next_token_logits(unregistered, use_cache=False), atol=1e-4)
    held = engine.tokenizer.decode(engine.plan(build_prompt("Who won?", engine.schemas["docs"].documents)).input_ids)
    assert engine.generate(held, max_new_tokens=1).stats.cached_tokens > 100  # a prompt that reads a document still does


def test_prefill_time_is_a_fixed_cost_plus_a_cost_per_token_and_long_prompts_are_explored():
    costs = CostModel(min_saving_s=0.0)
    for _ in range(3):
        costs.observe_prefill(20, 0.12)  # a question: 100 ms of fixed cost, 1 ms per token
    assert costs.compute_s(4000) == pytest.approx(24.0)  # only short prefills seen: their ratio, overstated
    costs.observe_load("remote", 0.0, 20.0, 10**6)
    # 4,000 tokens, never prefilled near that size, estimated within 2x of the load: computed once to measure
    assert costs.recompute("remote", 10**6, 4000)
    costs.observe_prefill(4000, 4.1)
    assert costs.compute_s(4000) == pytest.approx(4.1, rel=1e-6)  # the fit: 0.1 s + 1 ms per token
    assert costs.compute_s(20) == pytest.approx(0.12, rel=1e-6)
    assert costs.recompute("remote", 10**6, 4000)  # now because it is faster (4.1 s against 20 s)
    assert not costs.recompute("remote", 10**5, 4000)  # a tenth of the bytes: 2 s, loaded


def test_behind_a_slow_redis_the_engine_computes_and_at_full_speed_it_loads(smollm, redis_server, slow_redis,
                                                                            measured_choice):
    model, tokenizer = smollm.model, smollm.tokenizer
    writer = PromptCache(model, tokenizer, remote_store=redis_server.url)
    passages = _passages()
    names = writer.add_documents(passages, progress=False)
    warm = build_prompt("What is this about?", names[:1])  # the first load measures the tier
    prompt = build_prompt("Who won Super Bowl 50?", names[1:])
    exact = writer.next_token_logits(prompt, use_cache=False)

    fast = PromptCache(model, tokenizer, remote_store=redis_server.url)
    fast.generate(warm, max_new_tokens=1)  # measures the prefill (its load raced the computation)
    fast.encoder.settle()
    warmed = fast.store_stats()
    fast.generate(prompt, max_new_tokens=1)
    stats = fast.store_stats()
    assert stats["recomputed_tokens"] == warmed["recomputed_tokens"] and stats["encoded"] == 0
    assert stats["hits_remote"] - warmed["hits_remote"] == len(passages) - 1  # every document of the prompt loaded

    slow = PromptCache(model, tokenizer, remote_store=slow_redis.url, remote_timeout_ms=2000)
    slow.generate(warm, max_new_tokens=1)
    assert slow.encoder.settle(60)
    loaded = slow.store_stats()["hits_remote"]
    assert slow.costs.snapshot()["remote_mb_per_s"] < 4  # it measured the proxy's ~2 MB/s
    result = slow.generate(prompt, max_new_tokens=1)
    stats = slow.store_stats()
    assert stats["hits_remote"] == loaded and stats["encoded"] == 0  # nothing more crossed the slow link
    assert stats["recomputed_tokens"] >= sum(len(tokenizer(p).input_ids) for p in passages[1:]) - 10
    assert result.stats.cached_tokens < 100  # the system prompt only: the documents were computed
    # every document computed in the prompt behind its exact context: the answer is full prefill's
    assert torch.allclose(slow.next_token_logits(prompt), exact, atol=1e-3)


def test_a_cold_replica_behind_a_slow_link_computes_at_once(smollm, redis_server, slow_redis, measured_choice):
    """A replica that just started times one prefill, and learns the link's speed from the first
    thing it reads (its collection's system prompt): its first request already computes the
    documents, exactly, rather than fetch them over the slow link."""
    model, tokenizer = smollm.model, smollm.tokenizer
    writer = PromptCache(model, tokenizer, remote_store=redis_server.url)
    prompt = build_prompt("Who won Super Bowl 50?", writer.add_documents(_passages(), progress=False))
    exact = writer.next_token_logits(prompt, use_cache=False)
    started = PromptCache(model, tokenizer, remote_store=slow_redis.url, remote_timeout_ms=5000)
    assert started.costs.snapshot()["remote_mb_per_s"] < 4 and started.costs.compute_s(1000) is not None
    loaded = started.store_stats()["hits_remote"]
    first = started.generate(prompt, max_new_tokens=1)
    assert first.stats.cached_tokens < 100 and started.store_stats()["hits_remote"] == loaded  # nothing crossed the link
    assert torch.allclose(started.next_token_logits(prompt), exact, atol=1e-3)


def test_loads_past_their_deadline_are_left_to_finish_into_memory(smollm, redis_server):
    """The race's mechanism (a tier not measured yet): reads not done by the deadline are handed
    back (the request computes those segments) and go on into memory (ModuleEncoder.settle)."""
    model, tokenizer = smollm.model, smollm.tokenizer
    writer = PromptCache(model, tokenizer, remote_store=redis_server.url)
    prompt = build_prompt("Who won Super Bowl 50?", writer.add_documents(_passages(), progress=False))
    reader = PromptCache(model, tokenizer, remote_store=redis_server.url)
    plan = reader.plan(prompt)
    keys = [s.key for s in plan.segments if s.cached and not reader.store.in_memory(s.key)]
    assert len(keys) == len(_passages())
    late = reader.encoder.prefetch([plan], keys, deadline=0.0)
    assert late == set(keys)  # nothing is read in no time: all handed back
    assert reader.encoder.settle(60)
    assert all(reader.store.in_memory(key) for key in keys)  # and every read landed


def test_a_lookup_never_waits_for_the_write_back_of_an_outage(make_engine, redis_server):
    url = redis_server.url
    redis_server.stop()
    engine = make_engine(remote_store=url)
    engine.remote.link.retry_s, engine.remote.link._down_until = 0.0, 0.0
    (name,) = engine.add_documents(["The lighthouse was lit in 1851."], progress=False)  # Redis away: pending
    assert engine.store.unshared()
    redis_server.start()
    released, order = threading.Event(), []
    real_save = engine.remote.save

    def held_save(*args, **kwargs):  # the real upload, after the lookup has returned
        released.wait(30)
        order.append("upload")
        return real_save(*args, **kwargs)

    engine.remote.save = held_save
    engine.generate(build_prompt("When?", [name]), max_new_tokens=2)
    order.append("request done")
    released.set()
    engine.store.settle(30)
    assert order[0] == "request done" and order.count("upload") == 2 and not engine.store.unshared()  # document, system prompt
    assert engine.remote.load(engine.schemas["docs"].keys[name]) is not None


def _commands(client) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): stats["calls"] for name, stats in client.info("commandstats").items()}


def test_multi_chunk_entries_are_written_without_a_transaction_and_deleted_without_a_scan(redis_server):
    tier = RemoteTier(redis_server.url, "f" * 32, chunk_bytes=1000)
    module = ModuleKV(torch.randn(2, 2, 2, 37, 8), torch.arange(37))
    key = "docs/" + "b" * 64
    client = redis_server.client()
    client.config_resetstat()
    assert tier.save(key, module, {})
    record_key = tier._record_key(key)
    assert client.exists(f"{record_key}:9")
    assert "multi" not in _commands(client) and "exec" not in _commands(client)
    assert torch.equal(tier.load(key).kv, module.kv)
    client.set(record_key, b"garbage")  # an unreadable record: its chunk count is unknown
    client.set("other-tenant:key", b"x")
    tier.discard(key)
    assert "scan" not in _commands(client)
    assert not client.keys(f"{record_key}*") and client.exists("other-tenant:key")
    assert tier.save(key, module, {})
    client.set(record_key, b"garbage")
    tier.delete_entries([key])
    assert "scan" not in _commands(client) and not client.keys(f"{record_key}*")


def test_encoding_looks_documents_up_in_one_round_trip(make_engine, redis_server):
    writer = make_engine(remote_store=redis_server.url)
    texts = [f"Entry {i}: the ferry sailed on day {i} of the season." for i in range(30)]
    writer.add_documents(texts[:10], progress=False)
    engine = make_engine(remote_store=redis_server.url, remote_sync=False)
    client = redis_server.client()
    before = client.info("stats")["total_reads_processed"]
    keys = [engine.encoder.key("docs", [i, i + 1], [0, 1], None) for i in range(50)]
    assert engine.store.contains_many(keys) == [False] * 50
    # one pipelined batch: the server read it in a few socket reads, not 50 round trips
    assert client.info("stats")["total_reads_processed"] - before <= 8
    encoded = engine.store_stats()["encoded"]
    engine.add_documents(texts, progress=False)
    assert engine.store_stats()["encoded"] - encoded == 20  # the 20 new ones (the rest and the system prompt: in Redis)
