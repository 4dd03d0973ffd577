"""Corpus encoding on a real local Ray runtime into a real redis-server, served by a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pc_rag import PromptCache, PromptCacheError, build_prompt

HOTPOT = Path(__file__).resolve().parent / "data" / "hotpotqa_dev_distractor_first21.jsonl"
QUESTION = "Who is it about?"


def hotpot_paragraphs(count: int) -> list[str]:
    paragraphs: list[str] = []
    for line in HOTPOT.read_text().splitlines():
        for title, sentences in json.loads(line)["context"]:
            text = f"{title}: {''.join(sentences).strip()}"
            if text not in paragraphs and len(text) < 1500:  # within the tiny model's 1024 positions
                paragraphs.append(text)
            if len(paragraphs) == count:
                return paragraphs
    raise AssertionError("not enough paragraphs")


SERVE = textwrap.dedent("""
    import json, sys
    from pc_rag import PromptCache, build_prompt
    import pc_rag.kv.load_or_compute
    pc_rag.kv.load_or_compute.MIN_SAVING_S = 3600.0  # count tier hits: a tiny model would rightly compute instead (conftest)
    model, url, names = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    engine = PromptCache.from_pretrained(model, remote_store=url)
    held = sorted(engine.schemas["docs"].documents)
    answers = {n: engine.generate(build_prompt("Who is it about?", [n]), max_new_tokens=6).token_ids for n in names}
    print(json.dumps({"held": held, "answers": answers, "stats": engine.store_stats()}))
""")


@pytest.fixture
def ray_runtime():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


def test_two_ray_workers_encode_a_corpus_a_fresh_process_serves_it(saved_model, redis_server, ray_runtime, tmp_path):
    from pc_rag.distributed import encode_documents

    texts = hotpot_paragraphs(200)
    ids = [f"p{i:03d}" for i in range(150)] + [None] * 50  # given ids and derived names both
    names = encode_documents(texts, model=str(saved_model), remote_store=redis_server.url, ids=ids,
                             metadatas=[{"n": i} for i in range(200)], num_workers=2, batch_size=25, progress=False)
    single = PromptCache.from_pretrained(str(saved_model))
    assert names == single.add_documents(texts, ids=ids, metadatas=[{"n": i} for i in range(200)], progress=False)
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    probe = names[:3] + names[-3:]
    done = subprocess.run([sys.executable, str(script), str(saved_model), redis_server.url, json.dumps(probe)], check=False,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    served = json.loads(done.stdout.strip().splitlines()[-1])
    assert served["held"] == sorted(names)
    assert served["stats"]["encoded"] == 0 and served["stats"]["hits_remote"] == len(probe) + 1
    assert served["answers"] == {n: single.generate(build_prompt(QUESTION, [n]), max_new_tokens=6).token_ids for n in probe}
    # the registry holds each document once, though two workers published batches side by side
    records = [json.loads(r.decode().partition(" ")[2]) for r in redis_server.client().lrange(f"pcrag:{single.fingerprint}:v3:docs:log", 0, -1)]
    assert sorted(r["name"] for r in records) == sorted(names)
    assert {r["name"]: r["metadata"]["n"] for r in records}["p007"] == 7


def test_bad_input_fails_before_any_worker_starts(redis_server):
    from pc_rag.distributed import encode_documents

    with pytest.raises(PromptCacheError, match="two different texts"):
        encode_documents(["a", "b"], ids=["x", "x"], remote_store=redis_server.url)
    with pytest.raises(PromptCacheError, match="empty"):
        encode_documents(["a", ""], remote_store=redis_server.url)
    for workers in (0, -1, 1.5):
        with pytest.raises(PromptCacheError, match="num_workers must be an int >= 1 or None"):
            encode_documents(["a"], remote_store=redis_server.url, num_workers=workers)


def test_an_unreachable_redis_fails_the_encoding_with_a_clear_error(saved_model, redis_server, ray_runtime):
    """Before: the actor's check read a tier never tried yet as available, the entries were kept
    for a write-back that died with the actor, and encode_documents returned the names."""
    from pc_rag.distributed import encode_documents

    url = redis_server.url
    redis_server.stop()
    with pytest.raises(PromptCacheError, match="not reachable"):
        encode_documents(hotpot_paragraphs(3), model=str(saved_model), remote_store=url, num_workers=1, progress=False)


def test_entries_redis_refuses_fail_the_encoding(saved_model, redis_server, ray_runtime):
    from pc_rag.distributed import encode_documents

    client = redis_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", "1")  # every write refused (OOM)
    with pytest.raises(PromptCacheError, match="could not be written"):
        encode_documents(hotpot_paragraphs(3), model=str(saved_model), remote_store=redis_server.url, num_workers=1, progress=False)


def test_encode_documents_carries_the_neighbour_context(saved_model, redis_server, ray_runtime):
    from pc_rag.distributed import encode_documents

    with pytest.raises(PromptCacheError, match="unknown context"):
        encode_documents(["a", "b"], remote_store=redis_server.url, context="nearby")
    texts = hotpot_paragraphs(8)
    names = encode_documents(texts, model=str(saved_model), remote_store=redis_server.url, num_workers=2, batch_size=4,
                             progress=False, context="neighbours", neighbours=2)
    replica = PromptCache.from_pretrained(str(saved_model), remote_store=redis_server.url)
    contexts = replica.schemas["docs"].contexts
    assert set(contexts) == set(names) and all(len(c.names) == 2 for c in contexts.values())
    # a document behind exactly its context (its neighbours were encoded by the other worker too)
    name = names[-1]
    prompt = build_prompt(QUESTION, [*contexts[name].names, name])
    result = replica.generate(prompt, max_new_tokens=4)
    assert replica.store_stats()["encoded"] == 0 and result.stats.cached_tokens > 0
    plan = replica.plan(prompt)
    own = [moved for segment, moved in zip(plan.segments, plan.moved) if segment.owner == name]
    assert own and not any(own)  # read as full prefill computes it: no recovery for it
