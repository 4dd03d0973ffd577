"""A bounded load test: 200 queries over 1,000 stored modules from 8 concurrent callers.

Callers add the documents they need and ask about them at the same time, as a RAG server's
workers would. The memory budget holds about a quarter of the corpus, so modules are evicted to
the disk tier and loaded back while other callers encode. Afterwards: no errors, every answer
equals the answer of a sequential replay, and the encoder ran exactly once per distinct module.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

from pc_rag import PromptCache, build_prompt

MODULES = 1000
QUERIES = 200
CALLERS = 8
OWN = 5  # each query owns 5 documents (200 x 5 covers the corpus once) ...
POPULAR = 2  # ... and imports 2 of 20 popular ones, which callers add concurrently


def _corpus() -> list[str]:
    words = ["harbour", "signal", "ledger", "orchard", "turbine", "glacier", "archive", "meadow", "furnace", "lantern"]
    return [
        f"Record {i}: the {words[i % 10]} at site {i * 37 % 1009} logged {i % 13} events and "
        f"{(i * 7) % 101} readings of the {words[(i // 10) % 10]} before shift {i % 3}."
        for i in range(MODULES)
    ]


def _queries(corpus: list[str]) -> list[tuple[list[str], str, bool]]:
    rng = random.Random(7)
    queries = []
    for q in range(QUERIES):
        texts = corpus[q * OWN : (q + 1) * OWN] + rng.sample(corpus[:20], POPULAR)
        texts = list(dict.fromkeys(texts))  # a popular document may also be one of the query's own
        queries.append((texts, f"What did record {q * OWN} log?", q % 2 == 0))
    return queries


def test_200_queries_8_callers_1000_modules_encode_each_once(make_tiny, tokenizer, tmp_path):
    corpus = _corpus()
    queries = _queries(corpus)
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head dim x fp32 bytes
    budget = MODULES * 40 * per_token // 4  # documents are ~40 tokens: a quarter of the corpus fits
    engine = PromptCache(make_tiny("llama"), tokenizer, kv_dir=tmp_path, memory_budget=budget, recompute=0)

    def serve(query: tuple[list[str], str, bool]):
        texts, question, by_reference = query
        names = engine.add_documents(texts, progress=False)
        # half the callers import by reference (build_prompt), half paste the text (drop-in)
        prompt = build_prompt(question, names) if by_reference else "\n\n".join(texts) + f"\n\nQuestion: {question}"
        return names, engine.generate(prompt, max_new_tokens=4)

    with ThreadPoolExecutor(CALLERS) as pool:
        served = list(pool.map(serve, queries))

    assert len(served) == QUERIES
    layout = engine.schemas["docs"].layout
    assert len(engine.schemas["docs"].documents) == MODULES
    # every module encoded exactly once (+1: the system prompt every document is encoded behind)
    assert engine.forward.encoded == MODULES + 1
    assert engine.store.disk_loads > 0, "the budget should have forced reloads from disk"
    assert engine.store.memory_bytes <= budget
    for (texts, _, by_reference), (names, result) in zip(queries, served):
        assert result.stats.modules == names if by_reference else set(result.stats.modules) == set(names)
        assert result.stats.cached_tokens >= sum(layout.modules[n].text_tokens for n in names) > 0

    # answers and stats equal those of the same queries replayed one at a time
    encoded = engine.forward.encoded
    replay = [serve(query) for query in queries]
    assert [r.token_ids for _, r in replay] == [r.token_ids for _, r in served]
    assert [r.stats.cached_tokens for _, r in replay] == [r.stats.cached_tokens for _, r in served]
    assert engine.forward.encoded == encoded  # the replay encoded nothing
