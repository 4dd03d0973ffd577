"""Concurrent callers: threads sharing one engine get exactly the outputs of sequential calls."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pc_rag import build_prompt, module_reference


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


def _chat_inputs(engine):
    from langchain_core.messages import HumanMessage

    docs = [f"Station {i} measured {i * 3} millimetres of rain during the storm last week." for i in range(16)]
    names = engine.add_documents(docs, progress=False)
    # module references: what format_modules puts into a chain's messages
    refs = [module_reference(n) for n in names]
    return [[HumanMessage(f"{refs[i]}\n\n{refs[i + 1]}\n\nHow much rain at station {i}?")] for i in range(15)]


def test_langchain_batch_with_8_workers_matches_sequential(make_engine):
    from pc_rag.integrations.langchain import ChatPromptCache

    engine = make_engine("llama")
    chat = ChatPromptCache(engine=engine, max_new_tokens=6)
    inputs = _chat_inputs(engine)
    sequential = [chat.invoke(m) for m in inputs]
    batched = chat.batch(inputs, config={"max_concurrency": 8})
    assert [m.content for m in batched] == [m.content for m in sequential]
    # stats belong to each call, not to whichever call finished last
    for got, want in zip(batched, sequential):
        for key in ("modules", "cached_tokens", "computed_tokens", "generated_tokens"):
            assert got.response_metadata[key] == want.response_metadata[key]
    assert len({tuple(m.response_metadata["modules"]) for m in batched}) == len(inputs)


async def test_langchain_abatch_under_asyncio_matches_sequential(make_engine):
    import asyncio

    from pc_rag.integrations.langchain import PromptCacheLLM

    engine = make_engine("llama")
    llm = PromptCacheLLM(engine=engine, max_new_tokens=6)
    prompts = [m[0].content for m in _chat_inputs(engine)]
    sequential = [llm.invoke(p) for p in prompts]
    batched, gathered = await asyncio.wait_for(
        asyncio.gather(llm.abatch(prompts, config={"max_concurrency": 8}), asyncio.gather(*(llm.ainvoke(p) for p in prompts))),
        timeout=120,  # a deadlock fails the test instead of hanging CI
    )
    assert batched == sequential and gathered == sequential
