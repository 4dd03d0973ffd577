"""LlamaIndex adapters end to end: RetrieverQueryEngine on the embedded models."""

from __future__ import annotations

import pytest
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, QueryBundle

from pc_rag.integrations.llama_index import PromptCacheLLM, PromptCacheRetriever

QUESTION = "Who won Super Bowl 50?"


def test_retriever_returns_nodes_with_modules(squad_retriever):
    retriever = PromptCacheRetriever(squad_retriever, k=3)
    nodes = retriever.retrieve(QUESTION)
    assert len(nodes) == 3 and all(isinstance(n, NodeWithScore) for n in nodes)
    assert all(n.node.metadata["module"] in squad_retriever.names for n in nodes)
    assert nodes[0].score >= nodes[-1].score
    # shown to the LLM as a module reference, to embedders and users as its text
    assert nodes[0].node.get_content(metadata_mode="llm").startswith("[[pc-rag-module ")
    assert nodes[0].node.get_content(metadata_mode="none") == squad_retriever.texts[squad_retriever.names.index(nodes[0].node.node_id)]
    plain = PromptCacheRetriever(squad_retriever, k=1, references=False).retrieve(QueryBundle(QUESTION))[0]
    assert plain.node.get_content(metadata_mode="llm") == plain.node.get_content(metadata_mode="none")


@pytest.mark.parametrize("mode", ["compact", "simple_summarize"])
@pytest.mark.parametrize("references", [True, False])
def test_query_engine_reuses_module_kv(smollm, squad_retriever, smollm_streams, mode, references):
    llm = PromptCacheLLM(engine=smollm, max_new_tokens=24)
    engine = RetrieverQueryEngine.from_args(PromptCacheRetriever(squad_retriever, k=3, references=references), llm=llm, response_mode=mode)
    response = engine.query(QUESTION)
    # answer quality is the quality benchmark's business (a 135M model, approximate KV); here: it answers
    assert str(response).strip() and len(response.source_nodes) == 3
    (stream,) = smollm_streams
    result = stream.result
    retrieved = [n.node.node_id for n in response.source_nodes]
    if references or mode == "compact":
        assert sorted(result.stats.modules) == sorted(retrieved)
        assert result.stats.cached_tokens > 300 and result.stats.computed_tokens < result.stats.cached_tokens
    else:
        # simple_summarize formats its context as the repr() of a list of strings, which escapes
        # quotes and newlines: texts containing them are no longer verbatim (references survive)
        assert set(result.stats.modules) < set(retrieved) and result.stats.cached_tokens > 0


def test_streaming_query_engine(smollm, squad_retriever, smollm_streams):
    llm = PromptCacheLLM(engine=smollm, max_new_tokens=24)
    engine = RetrieverQueryEngine.from_args(PromptCacheRetriever(squad_retriever, k=2), llm=llm, streaming=True)
    response = engine.query("Where was Super Bowl 50 played?")
    pieces = list(response.response_gen)
    assert len(pieces) > 3 and "".join(pieces).strip()
    assert smollm_streams[0].result.stats.cached_tokens > 0


def test_llm_complete_chat_and_metadata(smollm):
    llm = PromptCacheLLM(engine=smollm, max_new_tokens=8)
    meta = llm.metadata
    assert meta.context_window == smollm.context_window == 8192 and meta.num_output == 8 and meta.is_chat_model
    # an instruct model completes a question as its user turn (as raw text it ended its turn at once: '')
    answer = PromptCacheLLM(engine=smollm, max_new_tokens=12).complete("What is the capital of France?")
    assert "Paris" in answer.text and answer.additional_kwargs["generated_tokens"] > 1
    completion = llm.complete("The capital of France is")
    assert completion.text and {"cached_tokens", "computed_tokens", "ttft_s"} <= set(completion.additional_kwargs)
    streamed = list(llm.stream_complete("The capital of France is"))
    assert streamed[-1].text == completion.text and "".join(r.delta for r in streamed) == completion.text
    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Say hi.")]
    reply = llm.chat(messages)
    assert reply.message.content and reply.additional_kwargs["computed_tokens"] > 0
    assert [r.delta for r in llm.stream_chat(messages)][-1] == "" and list(llm.stream_chat(messages))[-1].message.content == reply.message.content


def test_llm_logprobs_in_llama_index_openais_shape(smollm):
    """Per generated token, its step's most likely tokens (LlamaIndex OpenAI's ``logprobs``), from
    complete, chat and their streams alike; with no alternatives asked for, the token itself."""
    llm = PromptCacheLLM(engine=smollm, max_new_tokens=8, logprobs=True, top_logprobs=2)
    completion = llm.complete("The capital of France is")
    assert len(completion.logprobs) == completion.additional_kwargs["generated_tokens"]
    assert "".join(step[0].token for step in completion.logprobs) == completion.text  # greedy: the most likely
    assert all(len(step) == 2 and step[0].logprob >= step[1].logprob for step in completion.logprobs)
    assert list(llm.stream_complete("The capital of France is"))[-1].logprobs == completion.logprobs
    messages = [ChatMessage(role="user", content="Say hi.")]
    reply = llm.chat(messages)
    assert "".join(step[0].token for step in reply.logprobs) == reply.message.content
    assert list(llm.stream_chat(messages))[-1].logprobs == reply.logprobs
    chosen = PromptCacheLLM(engine=smollm, max_new_tokens=8).complete("The capital of France is", logprobs=True)
    assert [[p.token for p in step] for step in chosen.logprobs] == [[step[0].token] for step in completion.logprobs]
    assert PromptCacheLLM(engine=smollm, max_new_tokens=8).complete("The capital of France is").logprobs is None


def test_huggingface_llm_prompt_options(make_engine):
    """HuggingFaceLLM's options, with its meaning: query_wrapper_prompt, completion_to_prompt,
    system_prompt, messages_to_prompt, generate_kwargs, context_window."""
    from llama_index.core import PromptTemplate

    from pc_rag import PML

    engine = make_engine("llama")
    prompts: list[tuple[str, dict]] = []
    original = engine.stream

    def spy(prompt, **kwargs):
        prompts.append((prompt, kwargs))
        return original(prompt, **kwargs)

    engine.stream = spy  # type: ignore[method-assign]
    wrapped = PromptCacheLLM(engine=engine, max_new_tokens=2, query_wrapper_prompt=PromptTemplate("Q: {query_str}\nA:"),
                             completion_to_prompt=lambda text: f"<s>{text}</s>", generate_kwargs={"repetition_penalty": 1.2, "max_new_tokens": 3})
    wrapped.complete("why?")
    assert prompts[-1][0] == "<s>Q: why?\nA:</s>"
    assert prompts[-1][1]["repetition_penalty"] == 1.2 and prompts[-1][1]["max_new_tokens"] == 3
    wrapped.complete("raw text", formatted=True)  # formatted: used as given
    assert prompts[-1][0] == "raw text"
    wrapped.complete("why?", max_new_tokens=1)  # a per-call keyword wins over generate_kwargs
    assert prompts[-1][1]["max_new_tokens"] == 1
    system = PromptCacheLLM(engine=engine, max_new_tokens=2, system_prompt="Be brief.")
    system.complete("why?")  # a chat model completes a user turn, behind the system prompt
    assert prompts[-1][0] == engine.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "why?"}])
    system.chat([ChatMessage(role="user", content="Hi")])  # the system prompt becomes the system turn
    assert prompts[-1][0] == engine.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    custom = PromptCacheLLM(engine=engine, max_new_tokens=2,
                            messages_to_prompt=lambda messages: " | ".join(f"{m.role.value}: {m.content}" for m in messages))
    custom.chat([ChatMessage(role="user", content="<prompt schema=\"docs\"><x/></prompt>")])
    assert prompts[-1][0] == 'user: <prompt schema="docs"><x/></prompt>' and not isinstance(prompts[-1][0], PML)  # text, never markup
    assert PromptCacheLLM(engine=engine, context_window=512).metadata.context_window == 512
    with pytest.raises(Exception, match="unknown generation arguments: num_beams"):
        PromptCacheLLM(engine=engine, generate_kwargs={"num_beams": 2}).complete("x")
