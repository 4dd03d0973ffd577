"""The scheduler (pc_rag.scheduler): many callers at once, each seeing a lone call.

One loop owns the model; threads and asyncio tasks submit and wait. These tests hold it to the
promise: outputs equal lone calls whatever else runs, rows are really batched, a late arrival is
served before the long runners finish, callers that leave free their rows, one request's failure
touches no other, and the queue and memory bounds answer as documented.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pc_rag import PromptCacheError, QueueFull, build_prompt
from pc_rag.prompt.tools import call_schema

from .conftest import staggered

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                                                          "required": ["city"], "additionalProperties": False}}}]


@pytest.fixture
def engine(make_engine):
    engine = make_engine("llama")
    docs = [f"Harbour {i} handles {i * 11} ships a day and lies {i * 3} km from the old town." for i in range(12)]
    engine.names = engine.add_documents(docs, progress=False)  # type: ignore[attr-defined]
    return engine


def mixed_requests(engine) -> list[tuple[str, dict]]:
    """Greedy, sampled (seeded), JSON-constrained, forced tool call and stop-string requests over shared documents."""
    names = engine.names
    out: list[tuple[str, dict]] = []
    for i in range(16):
        prompt = build_prompt(f"How many ships at harbour {i % 12}?", names[i % 6 : i % 6 + 3])
        kind = i % 5
        if kind == 0:
            out.append((prompt, {"max_new_tokens": 10 + i}))
        elif kind == 1:
            out.append((prompt, {"max_new_tokens": 8, "temperature": 0.9, "top_p": 0.95, "seed": i}))
        elif kind == 2:
            out.append((prompt, {"max_new_tokens": 60, "json_schema": SCHEMA}))
        elif kind == 3:
            out.append((prompt, {"max_new_tokens": 60, "json_schema": call_schema(TOOLS, "get_weather")}))
        else:
            out.append((prompt, {"max_new_tokens": 12, "stop": ["e"]}))
    return out


def check_same(got, want, kwargs):
    assert got.token_ids == want.token_ids and got.text == want.text and got.finish_reason == want.finish_reason
    assert (got.stats.cached_tokens, got.stats.computed_tokens, got.stats.modules) == \
        (want.stats.cached_tokens, want.stats.computed_tokens, want.stats.modules)
    if "json_schema" in kwargs:
        json.loads(got.text)  # constrained output parses
    assert got.stats.queue_s >= 0 and got.stats.ttft_s >= got.stats.queue_s


def test_16_threads_of_mixed_requests_each_see_a_lone_call(engine):
    requests = mixed_requests(engine)
    alone = [engine.generate(p, **kw) for p, kw in requests]
    steps_before = engine.scheduler.stats()["steps"]
    start = threading.Barrier(len(requests))

    def call(item):
        prompt, kwargs = item
        start.wait()  # all at once
        return engine.generate(prompt, **kwargs)

    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(call, requests))
    for got, want, (_, kwargs) in zip(together, alone, requests):
        check_same(got, want, kwargs)
    stats = engine.scheduler.stats()
    # batched: far fewer decode steps than the lone calls' tokens, and steps with many rows
    assert stats["steps"] - steps_before < sum(len(r.token_ids) for r in alone) / 2
    assert max(engine.scheduler._stats.step_rows) >= 4
    assert stats["running"] == 0 and stats["buffer_bytes"] == 0


async def test_16_asyncio_tasks_of_mixed_requests_each_see_a_lone_call(engine):
    requests = mixed_requests(engine)
    alone = [engine.generate(p, **kw) for p, kw in requests]
    together = await asyncio.wait_for(asyncio.gather(*(engine.agenerate(p, **kw) for p, kw in requests)), timeout=300)
    for got, want, (_, kwargs) in zip(together, alone, requests):
        check_same(got, want, kwargs)
    pieces = [piece async for piece in engine.astream(requests[0][0], **requests[0][1])]
    assert "".join(pieces) == alone[0].text


def test_generate_batch_and_next_token_logits_go_through_the_same_loop(engine):
    prompts = [p for p, _ in mixed_requests(engine)[:6]]
    lone = [engine.generate(p, max_new_tokens=8) for p in prompts]
    with ThreadPoolExecutor(3) as pool:
        batch = pool.submit(engine.generate_batch, prompts, max_new_tokens=8)
        logits = pool.submit(engine.next_token_logits, prompts[0])
        single = pool.submit(engine.generate, prompts[1], max_new_tokens=8)
        assert [r.token_ids for r in batch.result()] == [r.token_ids for r in lone]
        assert int(logits.result().argmax()) == lone[0].token_ids[0]
        assert single.result().token_ids == lone[1].token_ids


def test_a_late_arrival_gets_its_answer_before_the_long_runners_finish(engine):
    engine.stop_token_ids.clear()  # the long runners run their whole budget
    names = engine.names
    finished: list[str] = []
    started = threading.Barrier(5)

    def long(i):
        stream = engine.stream(build_prompt(f"Tell me about harbour {i}.", names[i : i + 2]), max_new_tokens=300)
        next(stream)
        started.wait()
        for _ in stream:
            pass
        finished.append(f"long-{i}")
        return stream.result

    with ThreadPoolExecutor(4) as pool:
        runners = [pool.submit(long, i) for i in range(4)]
        started.wait()  # every long runner is decoding
        late = engine.generate(build_prompt("Which harbour is closest?", names[5:7]), max_new_tokens=4)
        finished.append("late")
        results = [r.result() for r in runners]
    assert finished[0] == "late", finished
    assert late.stats.generated_tokens == 4 and all(r.stats.generated_tokens == 300 for r in results)
    alone = engine.generate(build_prompt("Which harbour is closest?", names[5:7]), max_new_tokens=4)
    assert late.token_ids == alone.token_ids


def test_a_batch_is_rebuilt_without_its_finished_rows_only_when_steps_remain_to_pay_for_it(make_engine):
    """When half a batch's rows have finished, the rest are rebuilt into a smaller batch: a copy of
    their KV that later steps pay back by reading fewer rows. For rows with a step or two left it
    never does (on the 2-core CPU 0.11 s for 4 rows of ~1K entries, against ~50 ms a step
    saved), and 8 callers arriving in two cohorts paid it for their last step."""
    engine = make_engine("llama")
    engine.stop_token_ids.clear()
    prompts = [f"Caller {i} asks about the harbour at dawn." for i in range(6)]
    lone = [engine.generate(p, max_new_tokens=40).token_ids for p in prompts]
    # two prompts and a token the first emits (first at step j >= 1) that the second never does
    pair, stop, j = next(((a, b), t, lone[a].index(t)) for a in range(6) for b in range(6) if a != b
                         for t in lone[a][1:20] if t not in lone[b] and lone[a].index(t) >= 1)
    engine.stop_token_ids.add(stop)
    for steps_after, rebuilt in ((2, 0), (30, 1)):  # what the second row has left when the first stops
        before = engine.scheduler.stats()["merges"]
        first, second = engine.generate_batch([prompts[pair[0]], prompts[pair[1]]], max_new_tokens=j + 1 + steps_after)
        assert first.token_ids == lone[pair[0]][:j] and second.token_ids == lone[pair[1]][: j + 1 + steps_after]
        assert engine.scheduler.stats()["merges"] - before == rebuilt, steps_after


def test_a_compiled_engine_runs_every_step_compiled_when_callers_join(make_engine):
    """compile=True under concurrent RAG callers: rows copy the modules they import alike (a step
    over shared parts runs eagerly, and the schema's system prompt is shared by every RAG batch),
    and a newcomer joining a running row rebuilds the batch without reserved rows (a compiled
    step runs only over a buffer its views span). So every decode step, before and after the
    join, runs compiled, and the tokens equal lone eager calls. Sharing, every batched step ran
    eagerly; with rows reserved, the joined batch's did; before that, a compiled step seen first
    over an unreserved buffer of the same shape failed the joined batch outright."""
    engine, eager = make_engine("llama", compile=True), make_engine("llama")
    for e in (engine, eager):
        e.stop_token_ids.clear()
        names = e.add_documents([f"Harbour {i} handles {i * 11} ships a day." for i in range(4)], ids=[f"h{i}" for i in range(4)],
                                progress=False)
    prompts = [build_prompt("Tell me about the harbours.", names[:3]), build_prompt("Which harbour is busiest?", names[1:])]
    lone = [eager.generate(p, max_new_tokens=40).token_ids for p in prompts]
    assert [g.token_ids for g in engine.generate_batch(prompts, max_new_tokens=40)] == lone  # compiles the 2-row step
    assert engine.forward.compiled_steps == engine.scheduler.stats()["steps"] == 39
    compiled, steps = engine.forward.compiled_steps, engine.scheduler.stats()["steps"]
    stream = engine.stream(prompts[0], max_new_tokens=40)
    next(stream)  # decoding alone
    late = engine.generate(prompts[1], max_new_tokens=40)  # joins it
    for _ in stream:
        pass
    assert [stream.result.token_ids, late.token_ids] == lone
    stats = engine.scheduler.stats()
    assert stats["merges"] >= 1 and stats["failed"] == 0
    assert engine.forward.compiled_steps - compiled == stats["steps"] - steps < 2 * 39  # every step compiled, rows together


def test_a_compiled_engine_steps_a_few_batch_sizes_and_newcomers_join_its_vacant_rows(make_engine):
    """Under compile a batch is padded with vacant rows to a power of two rows (at most
    ``max_running``): the compiled step, a CUDA graph per shape under "reduce-overhead", sees
    1, 2, 4 and 8 rows as callers arrive one at a time, not every count from 1 to 7, and a
    newcomer takes a vacant row in place instead of rebuilding the batch. Tokens equal lone
    eager calls. Before, every arrival rebuilt the batch with exactly its rows."""
    engine, eager = make_engine("llama", compile=True), make_engine("llama")
    for e in (engine, eager):
        e.stop_token_ids.clear()
        names = e.add_documents([f"Harbour {i} handles {i * 11} ships a day." for i in range(8)], ids=[f"h{i}" for i in range(8)],
                                progress=False)
    prompts = [build_prompt(f"Which harbour is number {i}?", names[i : i + 2]) for i in range(7)]
    lone = [eager.generate(p, max_new_tokens=60).token_ids for p in prompts]
    torch._dynamo.reset()
    # each arrives while the ones before it decode
    assert [result.token_ids for result in staggered(engine, prompts, max_new_tokens=60)] == lone
    assert {rows for rows, _ in engine.forward.compiled_shapes} == {1, 2, 4, 8}
    stats = engine.scheduler.stats()
    assert stats["in_place"] == 3, stats  # the 2nd, 3rd (to 4 rows) and 5th (to 8) rebuild; the 4th, 6th and 7th join
    assert engine.forward.compiled_steps == stats["steps"]
    three = [g.token_ids for g in engine.generate_batch(prompts[:3], max_new_tokens=8)]
    assert three == [g.token_ids for g in eager.generate_batch(prompts[:3], max_new_tokens=8)]
    assert {rows for rows, _ in engine.forward.compiled_shapes} == {1, 2, 4, 8}  # three prompts: a batch of 4
    assert engine.scheduler.stats()["failed"] == 0


def test_a_compiled_batch_with_vacant_rows_keeps_its_shape_when_a_row_finishes(make_engine):
    """9 callers fill a compiled batch of 16 rows (7 vacant). When one finishes, the batch keeps
    its rows and the next newcomer takes a free row in place. Counting vacant rows as finished
    ones, the batch was rebuilt down to 8 rows at once and back up to 16 for the newcomer: two
    copies and two shapes (CUDA graphs) for one request."""
    engine = make_engine("llama", compile=True)
    engine.stop_token_ids.clear()
    prompts = [f"Caller {i} asks a question about harbours." for i in range(10)]
    torch._dynamo.reset()
    streams = []
    for i, prompt in enumerate(prompts[:9]):
        streams.append(engine.stream(prompt, max_new_tokens=24 if i == 0 else 400))
        next(streams[-1])
    list(streams[0])  # the first caller finishes; the other 8 decode on
    finished_at = engine.scheduler.stats()["steps"]
    while engine.scheduler.stats()["steps"] < finished_at + 2:  # the loop has seen it finish (a wait for an event, not a timing)
        threading.Event().wait(0.001)
    before = engine.scheduler.stats()
    late = engine.stream(prompts[9], max_new_tokens=4)
    next(late)
    after = engine.scheduler.stats()
    assert after["merges"] == before["merges"] and after["in_place"] == before["in_place"] + 1
    assert {rows for rows, _ in engine.forward.compiled_shapes} == {1, 2, 4, 8, 16}
    for stream in [late, *streams[1:]]:
        stream.close()


@pytest.mark.parametrize("weights", ["float32", "int4"])
def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(make_engine, weights):
    """Each chunk rides on the running row's decode step where that step runs as tensor ops; where it runs in C
    (blocks on the kernels) the chunk runs in a pass of its own, then the C step (measured faster)."""
    engine = make_engine("llama", max_step_tokens=64, weights=weights)
    assert engine.forward.decodes_in_c == (weights == "int4")
    engine.stop_token_ids.clear()
    long_prompt = "A long question. " + " ".join(f"word{i}" for i in range(120)) + " What is it?"
    alone = engine.generate(long_prompt, max_new_tokens=5)
    ready = threading.Event()

    def runner():
        stream = engine.stream("A short prompt that keeps decoding.", max_new_tokens=400)
        next(stream)
        ready.set()
        return "".join(stream)

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(runner)
        ready.wait()
        before = engine.scheduler.stats()
        chunked = engine.generate(long_prompt, max_new_tokens=5)
        after = engine.scheduler.stats()
        running.result()
    chunks = after["chunks"] - before["chunks"]
    assert chunks >= alone.stats.computed_tokens // 64
    # the runner decodes throughout: every chunk shared a forward pass with its decode step, or none did (the C step's)
    assert after["fused"] - before["fused"] == (0 if engine.forward.decodes_in_c else chunks)
    assert chunked.token_ids == alone.token_ids


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),
    ("mistral", {"sliding_window": 24}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1}),  # one layer slides, one does not
    ("llama4", {}),  # experts, a layer without RoPE
])
def test_a_prefill_chunk_rides_on_the_decode_step_exactly(make_engine, make_tiny, tokenizer, arch, overrides):
    """One packed forward pass runs the running rows' decode step and a newcomer's prefill chunk,
    each over its own cache (the newcomer reading the documents it shares with them in place):
    the chunk's logits are its lone prefill's, and every row's tokens its lone call's."""
    from pc_rag import PromptCache
    from pc_rag.decode import layout
    from pc_rag.decode.loop import RunningBatch
    from pc_rag.decode.sampling import SamplingParams
    from pc_rag.prefill.passes import chunks_of, new_tokens

    from .test_batch_layout import running_alone, step

    engine = PromptCache(make_tiny(arch, **overrides), tokenizer, recompute=0, attention_temperature=1.0, attention_scale=1.0)
    assert engine.spec.mixed_window == (arch == "qwen2")
    engine.stop_token_ids.clear()
    names = engine.add_documents([f"Harbour {i} handles {i * 11} ships a day, {i * 3} km from town." for i in range(6)],
                                 progress=False)
    running = [(build_prompt("Tell me about the harbours.", names[:3]), 40), (build_prompt("And harbour 4?", names[3:5]), 30)]
    newcomer = (build_prompt("Which harbour handles " + " ".join(f"w{i}" for i in range(30)) + "?", names[1:3]), 12)
    lone = [engine.generate(p, max_new_tokens=n) for p, n in [*running, newcomer]]
    out: dict[int, list[int]] = {}
    batch = layout.combine([(running_alone(engine, *running[0]), [0]), (running_alone(engine, *running[1]), [0])], reserve=1)
    step(batch, out)

    plans = engine._prepare([newcomer[0]], True)
    requests = engine._ticket(plans, SamplingParams(max_new_tokens=newcomer[1]), True, 0.0, share=True).requests
    assembled, _ = engine._assemble_plain(plans, newcomer[1], True, True, layout.held(batch))
    assert assembled.rows.shared is not None  # the documents the running rows hold, read in place
    chunks = chunks_of(assembled.rows, assembled.inputs, 16)
    assert len(chunks) >= 2
    passes = engine.forward.passes
    for chunk in chunks:
        batch.take()
        logits = batch.feed(alongside=new_tokens(assembled.rows, chunk, engine.spec))
    assert engine.forward.passes - passes == len(chunks)  # one pass per step, the chunk inside it
    alone = engine._prefill(plans, newcomer[1], True, True, layout.held(batch))
    torch.testing.assert_close(logits, alone.logits, rtol=1e-4, atol=1e-4)
    fresh = RunningBatch(engine.forward, assembled.rows, requests, logits, engine.spec)
    batch = layout.combine([(batch, [0, 1]), (fresh, [0])])
    while not step(batch, out):
        pass
    assert [out.get(id(r)) for r in batch.requests] == [r.token_ids for r in lone]


def test_an_abandoned_stream_frees_its_row_at_the_next_step(engine):
    engine.stop_token_ids.clear()
    names = engine.names
    keeper = engine.stream(build_prompt("Keep going.", names[:2]), max_new_tokens=400)
    leaver = engine.stream(build_prompt("Stop soon.", names[2:4]), max_new_tokens=400)
    next(keeper), next(leaver)
    assert engine.scheduler.running == 2
    leaver.close()
    # two requests one after the other after the close: the second is admitted at a step that
    # began after the close was seen (the first may share the step the close arrived in)
    for _ in range(2):
        engine.generate("After the close.", max_new_tokens=1)
    assert engine.scheduler.running == 1
    assert engine.scheduler.stats()["cancelled"] >= 1
    keeper.close()


async def test_a_cancelled_task_frees_its_row(engine):
    engine.stop_token_ids.clear()
    names = engine.names
    first_piece = asyncio.Event()

    async def leaver():
        async for _ in engine.astream(build_prompt("Stop soon.", names[2:4]), max_new_tokens=400):
            first_piece.set()

    task = asyncio.create_task(leaver())
    keeper = engine.astream(build_prompt("Keep going.", names[:2]), max_new_tokens=400)
    await keeper.__anext__()
    await asyncio.wait_for(first_piece.wait(), timeout=60)
    assert engine.scheduler.running == 2
    await _cancel_and_count_rows(engine, task)
    await keeper.aclose()


def test_a_stream_whose_event_loop_is_gone_fails_nobody_else(engine):
    """An async stream read once and dropped (no ``aclose``) by an event loop that then ends: its
    row stops, and the others decode on. (Waking a closed loop raised inside the scheduler's
    step, which failed every request running beside it.)"""
    engine.stop_token_ids.clear()
    names = engine.names
    keeper_prompt = build_prompt("Keep going.", names[:2])
    keeper_alone = engine.generate(keeper_prompt, max_new_tokens=200)
    keeper = engine.stream(keeper_prompt, max_new_tokens=200)
    next(keeper)

    async def read_once_and_leave() -> None:
        stream = engine.astream(build_prompt("Stop soon.", names[2:4]), max_new_tokens=400)
        await stream.__anext__()
        assert engine.scheduler.running == 2
        leaked.append(stream)  # still referenced: only its loop goes away

    leaked: list = []
    asyncio.run(read_once_and_leave())  # the loop closes with the stream unfinished
    for _ in keeper:
        pass
    assert keeper.result.token_ids == keeper_alone.token_ids
    for _ in range(2):  # as above: a request admitted at a step after the leaver's row was let go
        engine.generate("After the loop.", max_new_tokens=1)
    assert engine.scheduler.running == 0
    assert engine.scheduler.stats()["failed"] == 0


def test_an_async_stream_dropped_unfinished_frees_its_row(engine):
    """``break`` out of ``async for`` over a stream and drop it (no ``aclose``): its row stops at
    the next step instead of decoding its whole budget for nobody."""
    engine.stop_token_ids.clear()
    names = engine.names
    keeper = engine.stream(build_prompt("Keep going.", names[:2]), max_new_tokens=400)
    next(keeper)

    async def break_out() -> None:
        async for _ in engine.astream(build_prompt("Stop soon.", names[2:4]), max_new_tokens=400):
            assert engine.scheduler.running == 2
            break

    asyncio.run(break_out())
    gc.collect()
    for _ in range(2):  # as above: a request admitted at a step after the dropped stream's row was let go
        engine.generate("After the drop.", max_new_tokens=1)
    assert engine.scheduler.running == 1
    assert engine.scheduler.stats()["cancelled"] == 1
    keeper.close()


async def _cancel_and_count_rows(engine, task: asyncio.Task) -> None:
    """Cancel ``task`` (one of two running rows) and check that its row is gone."""
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(2):  # the second is admitted at a step that began after the cancel was seen
        await engine.agenerate("After the cancel.", max_new_tokens=1)
    assert engine.scheduler.running == 1


async def test_cancelled_llama_index_and_langchain_calls_free_their_rows(engine):
    """LlamaIndex's acomplete/achat/astructured_predict and LangChain's ainvoke run on the engine's
    asyncio path: a task cancelled mid-answer frees its row (on a worker thread, LlamaIndex's decoded
    on to its 400th token)."""
    from llama_index.core.llms import ChatMessage
    from llama_index.core.prompts import PromptTemplate
    from pydantic import BaseModel

    from pc_rag.integrations.langchain import ChatPromptCache
    from pc_rag.integrations.llama_index import PromptCacheLLM

    class Story(BaseModel):
        text: str

    engine.stop_token_ids.clear()
    llm = PromptCacheLLM(engine=engine, max_new_tokens=400)
    keeper = engine.astream(build_prompt("Keep going.", engine.names[:2]), max_new_tokens=400)
    await keeper.__anext__()
    chat = ChatPromptCache(engine=engine, max_new_tokens=400)
    for call in (lambda: llm.acomplete("Stop soon, please."), lambda: llm.achat([ChatMessage(role="user", content="Stop soon.")]),
                 lambda: chat.ainvoke("Stop soon."), lambda: llm.astructured_predict(Story, PromptTemplate("Stop soon."))):
        task = asyncio.create_task(call())
        while engine.scheduler.running < 2:  # its row admitted beside the keeper's (a condition, not a timing)
            await asyncio.sleep(0.01)
        await _cancel_and_count_rows(engine, task)
    assert (await llm.acomplete("A short one.", max_new_tokens=2)).text == llm.complete("A short one.", max_new_tokens=2).text
    await keeper.aclose()


async def test_a_task_cancelled_before_its_submission_lands_never_runs(make_engine):
    """A task cancelled while its request is still being planned or waits for room in a full queue
    (on a worker thread): the request never takes a row. (It was queued once the thread finished
    and decoded its whole budget for nobody.)"""
    engine = make_engine("llama", max_running=1, max_queued=1, queue_timeout_s=120)
    engine.stop_token_ids.clear()
    admitted = engine.scheduler.stats()["admitted"]
    blocker = engine.astream("Keep the only row busy.", max_new_tokens=400)
    await blocker.__anext__()
    queued = asyncio.create_task(engine.agenerate("Queued.", max_new_tokens=2))
    while engine.scheduler.stats()["queued"] < 1:  # the queue is full (a wait for an event, not a timing)
        await asyncio.sleep(0.005)
    late = asyncio.create_task(engine.agenerate("Waits for room.", max_new_tokens=300))
    while engine.scheduler.stats()["awaiting_room"] < 1:  # planned on a worker thread, waiting for room
        await asyncio.sleep(0.005)
    late.cancel()
    with pytest.raises(asyncio.CancelledError):
        await late
    await blocker.aclose()
    await queued
    for _ in range(2):
        await engine.agenerate("After the cancel.", max_new_tokens=1)
    stats = engine.scheduler.stats()
    assert stats["admitted"] - admitted == 4  # the blocker, the queued one and these two
    assert (stats["running"], stats["queued"], stats["awaiting_room"]) == (0, 0, 0)


async def test_a_refused_prompt_lets_the_prompts_beside_it_go(engine):
    """LangChain's agenerate over several prompts: when one is refused (too long), the others stop
    too, rather than decode their budget for nobody."""
    from pc_rag.integrations.langchain import PromptCacheLLM

    engine.stop_token_ids.clear()
    llm = PromptCacheLLM(engine=engine, max_new_tokens=400)
    with pytest.raises(PromptCacheError, match="context window"):
        await llm.agenerate(["Keep going.", "word " * 1100])
    for _ in range(2):  # the second is admitted at a step that began after the cancel was seen
        await engine.agenerate("After the refusal.", max_new_tokens=1)
    assert engine.scheduler.running == 0


def outcomes_of(call, arguments) -> list:
    """``call`` on each argument, each on its own thread at once: its result, or the exception it raised."""
    arguments = list(arguments)
    with ThreadPoolExecutor(len(arguments)) as pool:
        futures = [pool.submit(call, argument) for argument in arguments]
        outcomes = []
        for future in futures:
            try:
                outcomes.append(future.result())
            except Exception as err:  # noqa: BLE001
                outcomes.append(err)
    return outcomes


def four_greedy_and_a_seeded_fifth(engine, prompts, new_tokens: int) -> list:
    """``prompts[0..3]`` greedy and ``prompts[0]`` sampled with seed 13 (the row the tests below
    break), five callers at once: their outcomes."""
    start = threading.Barrier(5)

    def call(i):
        start.wait()
        if i == 4:
            return engine.generate(prompts[0], max_new_tokens=new_tokens, temperature=0.8, seed=13)
        return engine.generate(prompts[i], max_new_tokens=new_tokens)

    return outcomes_of(call, range(5))


def test_a_failing_request_leaves_the_others_unchanged(engine):
    """A module whose stored KV is gone and cannot be encoded again fails at prefill, inside the
    loop; the requests batched with it are prefilled again without it and answer as alone.

    The fault is injected (the encoder refuses that one entry): every real tier degrades to
    computing instead of failing, by design, so a real part offers no failure to provoke."""
    names = engine.names
    good = [build_prompt(f"How far is harbour {i}?", names[i : i + 2]) for i in range(4)]
    alone = [engine.generate(p, max_new_tokens=6) for p in good]
    bad = build_prompt("And this one?", [names[10]])
    plan = engine.plan(bad)
    # the store loses the document's KV and its encoder cannot run it: the next fetch fails
    key = next(s.key for s in plan.segments if s.owner == names[10])
    engine.store._memory.pop(key, None)
    original = engine.encoder.fetch

    def broken(schema, name, wanted, **kwargs):
        if wanted == key:
            raise RuntimeError("the document's KV cannot be rebuilt")
        return original(schema, name, wanted, **kwargs)

    engine.encoder.fetch = broken
    start = threading.Barrier(5)

    def call(prompt):
        start.wait()
        return engine.generate(prompt, max_new_tokens=6)

    outcomes = outcomes_of(call, [*good[:2], bad, *good[2:]])
    assert isinstance(outcomes[2], Exception) and "cannot be rebuilt" in str(outcomes[2]), outcomes
    assert [getattr(o, "token_ids", o) for o in outcomes[:2] + outcomes[3:]] == [r.token_ids for r in alone]
    engine.encoder.fetch = original
    assert engine.generate(good[0], max_new_tokens=6).token_ids == alone[0].token_ids  # the loop lives on


def test_a_vanishing_temperature_samples_the_top_token_beside_others(engine):
    """A temperature so small that logits divided by it overflow (a valid, finite number) samples
    the top token, its limit, and leaves the rows decoding beside it alone. (Dividing first made
    the probabilities NaN: the sampler raised and the whole step, every caller's, failed.)"""
    names = engine.names
    prompts = [build_prompt(f"How far is harbour {i}?", names[i : i + 2]) for i in range(3)]
    alone = [engine.generate(p, max_new_tokens=6) for p in prompts]
    start = threading.Barrier(3)

    def call(i):
        start.wait()
        if i == 1:
            return engine.generate(prompts[i], max_new_tokens=6, temperature=1e-300, seed=5)
        return engine.generate(prompts[i], max_new_tokens=6)

    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(call, range(3)))
    assert [g.token_ids for g in got] == [a.token_ids for a in alone]


def test_a_row_that_fails_while_decoding_fails_alone(engine, monkeypatch):
    """A row whose sampler raises mid-answer fails its own caller; the rows decoding in the same
    steps answer as alone, and the loop lives on. The fault is injected into one request's sampler
    (picked by its seed), as the tests above inject theirs into the encoder and the packed pass."""
    from pc_rag.decode.sampling import Sampler

    names = engine.names
    prompts = [build_prompt(f"How far is harbour {i}?", names[i : i + 2]) for i in range(4)]
    alone = [engine.generate(p, max_new_tokens=8) for p in prompts]
    original = Sampler.__call__
    calls = {"n": 0}

    def broken(self, logits):
        if self.params.seed == 13:
            calls["n"] += 1
            if calls["n"] == 3:  # a few tokens in, while the others decode
                raise RuntimeError("this row's sampler broke")
        return original(self, logits)

    monkeypatch.setattr(Sampler, "__call__", broken)
    outcomes = four_greedy_and_a_seeded_fifth(engine, prompts, 8)
    assert isinstance(outcomes[4], RuntimeError) and "sampler broke" in str(outcomes[4]), outcomes
    assert [getattr(o, "token_ids", o) for o in outcomes[:4]] == [a.token_ids for a in alone]
    assert engine.scheduler.stats()["failed"] == 1
    # a batch fails whole when one of its rows does: its other rows stop with it
    calls["n"] = 0
    with pytest.raises(RuntimeError, match="sampler broke"):
        engine.generate_batch(prompts[:3], max_new_tokens=8, temperature=0.8, seed=13)
    assert engine.scheduler.stats()["failed"] == 1 + 3
    monkeypatch.setattr(Sampler, "__call__", original)
    assert engine.generate(prompts[1], max_new_tokens=8).token_ids == alone[1].token_ids  # the loop lives on


def test_a_row_that_fails_as_it_finishes_fails_alone(engine, monkeypatch):
    """A request whose detokeniser raises as it flushes its last text fails its own caller; the
    rows that finish in the same steps answer as alone. (The flush ran unguarded: the whole step
    failed, and every caller in it with it.) The fault is injected into one request's close,
    picked by its seed, as the test above injects one into a sampler."""
    from pc_rag.decode.request import RequestState

    names = engine.names
    prompts = [build_prompt(f"How far is harbour {i}?", names[i : i + 2]) for i in range(4)]
    alone = [engine.generate(p, max_new_tokens=6) for p in prompts]
    original = RequestState.close

    def broken(self):
        if self.sampler.params.seed == 13:
            raise RuntimeError("this row's detokeniser broke")
        return original(self)

    monkeypatch.setattr(RequestState, "close", broken)
    outcomes = four_greedy_and_a_seeded_fifth(engine, prompts, 6)
    assert isinstance(outcomes[4], RuntimeError) and "detokeniser broke" in str(outcomes[4]), outcomes
    assert [getattr(o, "token_ids", o) for o in outcomes[:4]] == [a.token_ids for a in alone]
    assert engine.scheduler.stats()["failed"] == 1


def test_a_step_that_fails_outside_any_row_fails_its_requests_and_the_loop_lives_on(engine, monkeypatch):
    """A decode step that raises outside any one row fails the requests it serves, with a typed
    error; even when dropping the step's state fails too (its KV buffer will not go back to the
    pool), the next request is served. (A failure while failing the step ended the loop thread:
    every later caller waited forever.) Both faults are injected, once each."""
    from pc_rag.decode.loop import RunningBatch

    prompt = build_prompt("How far is harbour 3?", engine.names[3:5])
    alone = engine.generate(prompt, max_new_tokens=6)
    feed, release = RunningBatch.feed, type(engine.buffers).release
    faults = {"feed": 1, "release": 1}

    def broken_feed(self, alongside=None):
        if faults["feed"]:
            faults["feed"] -= 1
            raise RuntimeError("the decode step broke")
        return feed(self, alongside)

    def broken_release(self, buffer):
        if faults["release"]:
            faults["release"] -= 1
            raise RuntimeError("the pool broke")
        return release(self, buffer)

    monkeypatch.setattr(RunningBatch, "feed", broken_feed)
    monkeypatch.setattr(type(engine.buffers), "release", broken_release)
    with pytest.raises(PromptCacheError, match="the step serving this request failed: the decode step broke"):
        engine.generate(prompt, max_new_tokens=6)
    assert faults == {"feed": 0, "release": 0}  # both faults struck
    with ThreadPoolExecutor(1) as pool:  # a dead loop would leave this caller waiting: bounded, not timed
        again = pool.submit(engine.generate, prompt, max_new_tokens=6).result(timeout=120)
    assert again.token_ids == alone.token_ids
    assert engine.scheduler.stats()["failed"] == 1


def test_a_failing_prefill_chunk_fails_its_request_alone(engine):
    """A packed pass (a newcomer's chunk riding on the running row's decode step) that raises
    fails the newcomer only: the running row takes its step without it and answers as alone.
    The fault is injected into the packed pass, as the test above injects one into the encoder."""
    engine.stop_token_ids.clear()
    keeper_prompt = build_prompt("Keep going.", engine.names[:2])
    keeper_alone = engine.generate(keeper_prompt, max_new_tokens=300)
    original = engine.forward.packed

    def broken(*args, **kwargs):
        raise RuntimeError("the packed pass broke")

    keeper = engine.stream(keeper_prompt, max_new_tokens=300)
    next(keeper)
    engine.forward.packed = broken
    try:
        with pytest.raises(RuntimeError, match="the packed pass broke"):
            engine.generate(build_prompt("And harbour 7?", engine.names[6:8]), max_new_tokens=4)
    finally:
        engine.forward.packed = original
    for _ in keeper:
        pass
    assert keeper.result.token_ids == keeper_alone.token_ids
    assert engine.scheduler.stats()["failed"] == 1


def test_the_queue_bound_answers_with_the_typed_error(make_engine):
    engine = make_engine("llama", max_running=1, max_queued=2)
    engine.stop_token_ids.clear()
    blocker = engine.stream("Keep the only row busy.", max_new_tokens=400)
    next(blocker)
    waiting = [engine.stream(f"Queued {i}.", max_new_tokens=2) for i in range(2)]
    with ThreadPoolExecutor(2) as pool:
        queued = [pool.submit(lambda s: "".join(s), s) for s in waiting]
        while engine.scheduler.stats()["queued"] < 2:  # both submitted (a wait for an event, not a timing)
            threading.Event().wait(0.005)
        with pytest.raises(QueueFull, match="max_queued"):
            engine.generate("One too many.", max_new_tokens=2)
        assert isinstance(QueueFull("x"), PromptCacheError)
        blocker.close()
        assert all(isinstance(q.result(), str) for q in queued)  # the queued ones are served, none lost
    assert engine.scheduler.stats()["refused"] == 1


def test_200_requests_under_a_buffer_budget_stay_within_it(make_engine):
    budget = 2 * 1024 * 1024  # the tiny model's KV is 512 bytes a token: a few rows of 256 entries at once
    engine = make_engine("llama", buffer_budget=budget, max_queued=256)
    names = engine.add_documents([f"Fact {i}: the value of item {i} is {i * i}." for i in range(20)], progress=False)
    prompts = [build_prompt(f"Value of item {i % 20}?", names[i % 20 : i % 20 + 2]) for i in range(200)]
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda p: engine.generate(p, max_new_tokens=8), prompts))
    assert len(results) == 200 and all(r.stats.generated_tokens > 0 for r in results)
    stats = engine.scheduler.stats()
    assert 0 < stats["buffer_bytes_peak"] <= budget
    assert stats["finished"] >= 200
    with pytest.raises(PromptCacheError, match="buffer_budget"):
        engine.generate_batch(prompts[:20], max_new_tokens=8)  # alone more than the budget: refused at submission


def test_the_pools_idle_buffers_count_in_the_buffer_budget_and_go_before_a_request_waits(make_engine):
    """The buffer pool keeps finished requests' single-row buffers for reuse. They were outside
    the budget: idle buffers filling it and a batch's own buffers beside them held more than the
    budget. Now they count (``buffer_bytes_idle``) and are let go when a request needs their room."""
    budget = 2 * 1024 * 1024  # four of the pool's 1,024-entry single-row buffers of the tiny model's 512-byte tokens
    engine = make_engine("llama", buffer_budget=budget)
    engine.stop_token_ids.clear()
    taken = [engine.buffers.acquire(1024) for _ in range(4)]  # four requests' buffers at once, then all idle
    for buffer in taken:
        engine.buffers.release(buffer)
    assert engine.buffers.idle == 4 and engine.scheduler.stats()["buffer_bytes_idle"] == budget
    prompts = [f"Question {i}: what comes next?" for i in range(4)]
    assert len(engine.generate_batch(prompts, max_new_tokens=8)) == 4  # served, not left waiting for room
    stats = engine.scheduler.stats()
    assert engine.buffers.idle == 0 and stats["buffer_bytes"] == stats["buffer_bytes_idle"] == 0
    assert 0 < stats["buffer_bytes_peak"] <= budget  # idle buffers included


def test_limits_are_checked(make_engine):
    for bad in ({"max_running": 0}, {"max_step_tokens": -1}, {"max_queued": 1.5}, {"queue_timeout_s": -1}, {"buffer_budget": 0},
                {"fuse_prefill": "yes"}):
        with pytest.raises(PromptCacheError, match=next(iter(bad))):
            make_engine("llama", **bad)


def test_callers_arriving_apart_share_the_documents_they_import(engine):
    """Through the scheduler: a caller decoding alone has copied its documents; callers that
    arrive later with the same documents read them as one part with it, so the batch holds
    the documents once. Outputs equal lone calls."""
    engine.stop_token_ids.clear()
    docs = engine.names[:4]
    prompts = [build_prompt(f"What about harbour {i}?", docs) for i in range(5)]
    lone = [engine.generate(p, max_new_tokens=20 if i else 300).token_ids for i, p in enumerate(prompts)]
    stats = engine.scheduler.stats()
    first = engine.stream(prompts[0], max_new_tokens=300)  # decoding long after the others arrive
    got = [None] * len(prompts)

    def rest() -> None:
        with ThreadPoolExecutor(4) as pool:
            for i, result in zip(range(1, 5), pool.map(lambda p: engine.generate(p, max_new_tokens=20), prompts[1:])):
                got[i] = result.token_ids

    late = None
    for _ in first:
        if late is None:  # the first row is decoding: the others arrive now
            late = threading.Thread(target=rest)
            late.start()
    late.join()
    got[0] = first.result.token_ids
    assert got == lone
    after = engine.scheduler.stats()
    assert after["promoted"] - stats["promoted"] >= 1


def test_a_tickets_status_follows_it_through_the_loop_and_it_leaves_the_table_at_the_end(engine):
    """One status per submission (pc_rag.callers.RequestStatus): waiting when built, running while
    its text comes, finished with its result, cancelled when its caller leaves; each of its
    requests names it as owner; the scheduler's table of tickets empties once every one is final."""
    import time

    from pc_rag.callers import RequestStatus, wait
    from pc_rag.decode.sampling import sampling_params

    engine.stop_token_ids.clear()

    def ticket(max_new_tokens: int):
        plans = engine._prepare([build_prompt("Tell me about harbour 1.", engine.names[:2])], True)
        params = sampling_params({"max_new_tokens": max_new_tokens}, engine.generation_config)
        return engine._ticket(plans, params, True, time.perf_counter(), share=True)

    done = ticket(6)
    assert done.status is RequestStatus.WAITING and done.requests[0].owner == (done, 0) and not done.closed
    seen: list[RequestStatus] = []
    done.listeners.append(lambda: seen.append(done.status))
    text = "".join(wait(engine.scheduler.submit(done), engine.scheduler.cancel))
    assert text and set(seen[:-1]) == {RequestStatus.RUNNING} and seen[-1] is RequestStatus.FINISHED and done.closed

    left = ticket(400)
    stream = wait(engine.scheduler.submit(left), engine.scheduler.cancel)
    next(stream)
    stream.close()  # the caller leaves
    while left.events.get()[0] != "error":
        pass
    assert left.status is RequestStatus.CANCELLED
    engine.scheduler.close()
    assert engine.scheduler._tickets == {}
