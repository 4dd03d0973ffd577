"""What LangChain, LlamaIndex and transformers users read off every call: token usage with the
cached part, a response-cache key that tells apart settings that change answers, and the store's
hit statistics."""

from __future__ import annotations

import pytest

from pc_rag import PromptCache, build_prompt

DOCS = [
    "The lighthouse on the northern cape was automated in 1987 and still flashes every ten seconds.",
    "Ferries to the island leave twice a day in summer and once a day in winter, weather permitting.",
]


@pytest.fixture
def engine(make_engine):
    engine = make_engine("llama")
    engine.add_documents(DOCS, progress=False)
    return engine


def _dropin(engine) -> str:
    return engine.render_chat([{"role": "user", "content": DOCS[0] + "\n\nWhen was it automated?"}])


def test_langchain_usage_reports_cache_reads(engine):
    from pc_rag.integrations.langchain import ChatPromptCache, PromptCacheLLM

    chat = ChatPromptCache(engine=engine, max_new_tokens=4)
    message = chat.invoke(DOCS[0] + "\n\nWhen was it automated?")
    info = message.response_metadata
    usage = message.usage_metadata
    assert usage["input_token_details"]["cache_read"] == info["cached_tokens"] > 0
    assert usage["input_tokens"] == info["cached_tokens"] + info["computed_tokens"]
    chunks = list(chat.stream(DOCS[0] + "\n\nWhen was it automated?"))
    last = [c for c in chunks if c.usage_metadata]
    assert len(last) == 1 and last[0].usage_metadata["input_token_details"]["cache_read"] == info["cached_tokens"]
    result = PromptCacheLLM(engine=engine, max_new_tokens=4).generate([_dropin(engine), _dropin(engine)])
    token_usage = result.llm_output["token_usage"]
    infos = [g[0].generation_info for g in result.generations]
    assert token_usage["cached_tokens"] == sum(i["cached_tokens"] for i in infos) > 0
    assert token_usage["prompt_tokens"] == sum(i["cached_tokens"] + i["computed_tokens"] for i in infos)
    assert token_usage["total_tokens"] == token_usage["prompt_tokens"] + token_usage["completion_tokens"]


def test_langchain_response_cache_never_serves_one_setting_for_another(engine):
    from langchain_core.caches import InMemoryCache

    from pc_rag.integrations.langchain import PromptCacheLLM

    cached, full = PromptCacheLLM(engine=engine, max_new_tokens=4), PromptCacheLLM(engine=engine, max_new_tokens=4, use_cache=False)
    # what LangChain keys its response cache on (llm_string is built from these)
    assert cached._identifying_params != full._identifying_params
    for other in (PromptCacheLLM(engine=engine, max_new_tokens=4, top_k=5), PromptCacheLLM(engine=engine, max_new_tokens=4, pml=True),
                  PromptCacheLLM(engine=PromptCache(engine.model, engine.tokenizer, recompute=2), max_new_tokens=4)):
        assert other._identifying_params != cached._identifying_params
    assert PromptCacheLLM(engine=engine, max_new_tokens=4)._identifying_params == cached._identifying_params
    response_cache = InMemoryCache()
    cached.cache = full.cache = response_cache
    first = cached.generate([_dropin(engine)]).generations[0][0].generation_info
    second = full.generate([_dropin(engine)]).generations[0][0].generation_info
    assert first["cached_tokens"] > 0 and second["cached_tokens"] == 0  # the full-prefill call really ran


def test_llama_index_token_counting_handler_counts_real_tokens(engine):
    from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
    from llama_index.core.llms import ChatMessage

    from pc_rag.integrations.llama_index import PromptCacheLLM

    counter = TokenCountingHandler()
    llm = PromptCacheLLM(engine=engine, max_new_tokens=4, callback_manager=CallbackManager([counter]))
    response = llm.complete(_dropin(engine))
    usage = response.raw["usage"]
    assert usage["cached_tokens"] == response.additional_kwargs["cached_tokens"] > 0
    assert counter.prompt_llm_token_count == usage["prompt_tokens"] and counter.completion_llm_token_count == usage["completion_tokens"]
    chat = llm.chat([ChatMessage(role="user", content=DOCS[1] + "\n\nHow often?")])
    assert chat.raw["usage"]["prompt_tokens"] == chat.additional_kwargs["cached_tokens"] + chat.additional_kwargs["computed_tokens"]


def test_store_stats_count_every_tier(make_tiny, tokenizer, tmp_path):
    engine = PromptCache(make_tiny("llama"), tokenizer, kv_dir=tmp_path, recompute=0)
    names = engine.add_documents(DOCS, progress=False)
    stats = engine.store_stats()
    assert set(stats) == {"encoded", "hits_memory", "hits_disk", "hits_remote", "misses", "evictions", "bytes_memory", "bytes_disk",
                          "background_pending", "tokens_memory", "bytes_per_token", "recomputed_tokens", "passages_learned"}
    assert stats["passages_learned"] == 0  # learn_passages is off by default
    assert stats["bytes_per_token"] == round(stats["bytes_memory"] / stats["tokens_memory"]) == engine.spec.kv_bytes_per_token() + 8
    assert stats["background_pending"] == 0
    assert stats["encoded"] == 3 and stats["bytes_memory"] > 0 and stats["bytes_disk"] > 0  # two documents and the system turn
    prompt = build_prompt("Lighthouse?", names)
    engine.generate(prompt, max_new_tokens=2)
    after = engine.store_stats()
    assert after["hits_memory"] >= stats["hits_memory"] + 3 and after["encoded"] == 3 and after["hits_remote"] == 0
    engine.store.clear_memory()
    engine.generate(prompt, max_new_tokens=2)
    loaded = engine.store_stats()
    assert loaded["hits_disk"] == 3 and loaded["encoded"] == 3
    tight = PromptCache(engine.model, tokenizer, memory_budget=1, recompute=0)
    tight.add_documents(DOCS, progress=False)
    assert tight.store_stats()["evictions"] >= 2


def _gate_prefill(engine, monkeypatch):
    """Hold every prefill until the returned event is set (by the event loop, in the tests)."""
    import threading

    loop_ran = threading.Event()
    prefill = engine.forward.prefill_batch

    def gated(*args, **kwargs):
        assert loop_ran.wait(30), "the event loop was blocked while the model ran"
        return prefill(*args, **kwargs)

    monkeypatch.setattr(engine.forward, "prefill_batch", gated)
    return loop_ran


@pytest.mark.parametrize("call", ["acomplete", "astream_complete", "achat", "astream_chat"])
def test_llama_index_async_never_blocks_the_event_loop(engine, monkeypatch, call):
    """The model's prefill waits until the event loop has run another coroutine: an async method
    that decoded on the loop would wait on itself (here: 30 s, then fail)."""
    import asyncio

    from llama_index.core.llms import ChatMessage

    from pc_rag.integrations.llama_index import PromptCacheLLM

    llm = PromptCacheLLM(engine=engine, max_new_tokens=4)
    loop_ran = _gate_prefill(engine, monkeypatch)
    messages = [ChatMessage(role="user", content="Hello there")]

    async def consume(stream):
        return [response async for response in stream][-1]

    async def run():
        if call == "acomplete":
            work = llm.acomplete("Hello there")
        elif call == "achat":
            work = llm.achat(messages)
        elif call == "astream_complete":
            work = consume(await llm.astream_complete("Hello there"))
        else:
            work = consume(await llm.astream_chat(messages))
        task = asyncio.ensure_future(work)
        await asyncio.sleep(0)  # the call starts; the model must now be running off the loop
        loop_ran.set()
        return (await asyncio.wait_for(task, 60)).additional_kwargs

    info = asyncio.run(run())
    assert info["generated_tokens"] >= 1 and info["cached_tokens"] == 0


@pytest.mark.parametrize("adapter", ["llm", "chat"])
@pytest.mark.parametrize("call", ["ainvoke", "astream", "abatch"])
def test_langchain_async_never_blocks_the_event_loop(engine, monkeypatch, adapter, call):
    """As for LlamaIndex: the prefill waits until the loop has run, so a native async method that
    decoded on the loop would wait on itself. Streams deliver pieces as they are decoded."""
    import asyncio

    from pc_rag.integrations.langchain import ChatPromptCache, PromptCacheLLM

    llm = (PromptCacheLLM if adapter == "llm" else ChatPromptCache)(engine=engine, max_new_tokens=4)
    loop_ran = _gate_prefill(engine, monkeypatch)

    async def consume():
        return [piece async for piece in llm.astream("Hello there")]

    async def run():
        if call == "ainvoke":
            work = llm.ainvoke("Hello there")
        elif call == "abatch":
            work = llm.abatch(["Hello there", "Good morning"])
        else:
            work = consume()
        task = asyncio.ensure_future(work)
        await asyncio.sleep(0)
        loop_ran.set()
        return await asyncio.wait_for(task, 60)

    out = asyncio.run(run())
    if call == "astream":
        text = "".join(p if isinstance(p, str) else p.text for p in out)
        expected = llm.invoke("Hello there")
        assert text == (expected if isinstance(expected, str) else expected.text)
        assert len([p for p in out if (p if isinstance(p, str) else p.text)]) >= 2  # piece by piece, not one block
    else:
        assert out


GENERATION = [
    {"repetition_penalty": 1.5},
    {"no_repeat_ngram_size": 2},
    {"min_new_tokens": 12},
    {"repetition_penalty": 1.3, "no_repeat_ngram_size": 3, "min_new_tokens": 4},
]


@pytest.mark.parametrize("arguments", GENERATION, ids=lambda a: "+".join(a))
@pytest.mark.parametrize("use_cache", [True, False])
def test_transformers_generation_arguments_match_transformers_generate(make_tiny, tokenizer, arguments, use_cache):
    """Greedy with transformers' logits processors: the same tokens as the model's own generate()."""
    import torch

    model = make_tiny("llama", seed=7)
    engine = PromptCache(model, tokenizer, recompute=0)
    prompt = "the the the cat sat on the mat and the cat sat on the"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    if "min_new_tokens" in arguments:  # a random model rarely ends: make its first greedy token the end
        engine.stop_token_ids = {engine.generate(prompt, max_new_tokens=1).token_ids[0]}
    eos = sorted(engine.stop_token_ids)
    with torch.no_grad():
        reference = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=eos[0], **arguments)[0, ids.shape[1]:]
    reference = reference.tolist()
    if any(t in eos for t in reference):
        reference = reference[: min(reference.index(t) for t in eos if t in reference)]
    ours = engine.generate(prompt, max_new_tokens=16, use_cache=use_cache, **arguments)
    assert ours.token_ids == reference
    plain = engine.generate(prompt, max_new_tokens=16, use_cache=use_cache)
    assert plain.token_ids != ours.token_ids  # the argument really changed the answer
    batch = engine.generate_batch([prompt, "another prompt, a different one"], max_new_tokens=16, use_cache=use_cache, **arguments)
    assert batch[0].token_ids == reference


def test_the_models_generation_config_is_honoured_unless_a_call_overrides_it(make_tiny, tokenizer):
    """transformers' generate() reads the model's generation_config; so does the engine, setting by setting."""
    import torch
    from transformers import GenerationConfig

    model = make_tiny("llama", seed=7)
    prompt = "the the the cat sat on the mat and the cat sat on the"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    model.generation_config = GenerationConfig(repetition_penalty=1.5, no_repeat_ngram_size=2, max_new_tokens=12)
    engine = PromptCache(model, tokenizer, recompute=0)
    engine.stop_token_ids = set()
    with torch.no_grad():  # transformers with the same config and no arguments
        reference = model.generate(ids, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert len(reference) == 12
    assert engine.generate(prompt).token_ids == reference
    plain = engine.generate(prompt, repetition_penalty=1.0, no_repeat_ngram_size=0, max_new_tokens=12)
    assert plain.token_ids != reference  # the config really changed the answer; a call overrides it
    # a per-call generation_config, as transformers takes it, over the model's
    assert engine.generate(prompt, generation_config=GenerationConfig(max_new_tokens=3)).stats.generated_tokens == 3
    assert engine.generate(prompt, generation_config={"max_new_tokens": 5}).stats.generated_tokens == 5
    # sampling defaults apply only when the config samples; an explicit temperature decides alone
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, top_k=5, max_new_tokens=8)
    engine = PromptCache(model, tokenizer, recompute=0)
    engine.stop_token_ids = set()
    sampled = engine.generate(prompt, seed=3)
    assert sampled.token_ids == engine.generate(prompt, seed=3, do_sample=True, temperature=0.7, top_k=5).token_ids
    greedy = engine.generate(prompt, temperature=0.0)
    assert greedy.token_ids == engine.generate(prompt, do_sample=False).token_ids
    assert greedy.token_ids == engine.generate(prompt, generation_config=GenerationConfig(max_new_tokens=8), temperature=0).token_ids
    with pytest.raises(Exception, match="generation_config must be"):
        engine.generate(prompt, generation_config=42)


def test_generation_argument_aliases_and_errors(make_engine):
    from pc_rag import PromptCacheError

    engine = make_engine("llama")
    greedy = engine.generate("Once upon a time", max_new_tokens=8)
    assert engine.generate("Once upon a time", max_new_tokens=8, temperature=0.9, do_sample=False).token_ids == greedy.token_ids
    assert engine.generate("Once upon a time", max_new_tokens=8, stop_strings=["e"]).text == engine.generate(
        "Once upon a time", max_new_tokens=8, stop=["e"]).text
    for bad, message in (({"num_beams": 4}, "unknown generation arguments: num_beams"), ({"repetition_penalty": 0}, "repetition_penalty"),
                         ({"stop": "x", "stop_strings": "y"}, "not both"), ({"min_new_tokens": -1}, "min_new_tokens")):
        with pytest.raises(PromptCacheError, match=message):
            engine.generate("Once upon a time", max_new_tokens=4, **bad)


def test_from_pretrained_takes_transformers_loading_arguments(saved_model, tokenizer, monkeypatch):
    import transformers

    seen = {}
    for cls in (transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        original = cls.from_pretrained.__func__

        def spy(klass, source, *args, _original=original, _name=cls.__name__, **kwargs):
            seen[_name] = kwargs
            return _original(klass, source, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    engine = PromptCache.from_pretrained(saved_model, revision="main", trust_remote_code=True, device_map="cpu")
    for name in ("AutoTokenizer", "AutoModelForCausalLM"):  # the tokenizer comes from the same revision
        assert seen[name]["revision"] == "main" and seen[name]["trust_remote_code"] is True
    assert seen["AutoModelForCausalLM"]["device_map"] == "cpu" and engine.generate("Hi", max_new_tokens=2).stats.generated_tokens >= 1
    seen.clear()
    own = PromptCache.from_pretrained(saved_model, tokenizer=tokenizer)  # your own tokenizer object
    assert own.tokenizer is tokenizer and "AutoTokenizer" not in seen


def test_langchain_repetition_penalty_is_a_field_and_per_call(engine):
    from pc_rag.integrations.langchain import ChatPromptCache

    prompt = "the the the cat sat on the mat and the cat sat on the"
    expected = engine.generate(engine.render_chat([{"role": "user", "content": prompt}]), max_new_tokens=12, repetition_penalty=1.5).text
    assert ChatPromptCache(engine=engine, max_new_tokens=12, repetition_penalty=1.5).invoke(prompt).content == expected
    assert ChatPromptCache(engine=engine, max_new_tokens=12).invoke(prompt, repetition_penalty=1.5).content == expected


@pytest.mark.parametrize("adapter", ["llm", "chat"])
def test_langchain_from_model_id_like_huggingface_pipeline(saved_model, adapter):
    from pc_rag import PromptCacheError
    from pc_rag.integrations.langchain import ChatPromptCache, PromptCacheLLM

    cls = PromptCacheLLM if adapter == "llm" else ChatPromptCache
    llm = cls.from_model_id(str(saved_model), model_kwargs={"recompute": 0, "dtype": "float32"},
                            pipeline_kwargs={"max_new_tokens": 3, "repetition_penalty": 1.3})
    assert llm.engine.recompute == 0 and llm.engine.dtype.is_floating_point
    llm.engine.stop_token_ids = set()
    out = llm.invoke("Hello there", skip_prompt=True)  # HuggingFacePipeline's per-call switch: what we do anyway
    text = out if isinstance(out, str) else out.content
    expected = llm.engine.generate("Hello there" if adapter == "llm" else llm.engine.render_chat([{"role": "user", "content": "Hello there"}]),
                                   max_new_tokens=3, repetition_penalty=1.3)
    assert text == expected.text  # pipeline_kwargs reach every generation
    assert llm._identifying_params["pipeline_kwargs"] == {"max_new_tokens": 3, "repetition_penalty": 1.3}
    with pytest.raises(PromptCacheError, match="without the prompt"):
        llm.invoke("Hello there", skip_prompt=False)
    with pytest.raises(PromptCacheError, match="without the prompt"):
        llm.invoke("Hello there", return_full_text=True)
