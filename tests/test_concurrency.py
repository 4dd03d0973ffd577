"""Concurrent callers: threads sharing one engine get exactly the outputs of sequential calls."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pc_rag import build_prompt


def test_threads_reproduce_sequential_greedy_outputs(make_engine):
    engine = make_engine("llama")
    docs = [f"Document number {i} talks about topic {i * 7} in considerable detail here." for i in range(20)]
    names = engine.add_documents(docs, progress=False)
    prompts = [build_prompt(f"question {i}?", names[i : i + 3]) for i in range(12)]
    prompts += [f"Plain prompt quoting {docs[i]} and asking why?" for i in range(12)]
    sequential = [engine.generate(p, max_new_tokens=6) for p in prompts]
    stored = set(engine.store._memory)
    with ThreadPoolExecutor(8) as pool:
        parallel = list(pool.map(lambda p: engine.generate(p, max_new_tokens=6), prompts * 2))
    assert [r.token_ids for r in parallel] == [r.token_ids for r in sequential] * 2
    assert [r.stats.cached_tokens for r in parallel] == [r.stats.cached_tokens for r in sequential] * 2
    assert all(r.stats.cached_tokens > 0 for r in parallel)
    assert set(engine.store._memory) == stored  # nothing was encoded or stored again
