"""LlamaIndex function calling and structured output, through LlamaIndex's own agent and program APIs.

The embedded model is small: what is asserted is what the grammar guarantees (a required call
names a bound tool with arguments of its schema; a structured reply is an instance of the output
class), plus the call the model makes for an arithmetic question it gets right with the tool.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult
from llama_index.core.base.llms.types import ChatMessage, ToolCallBlock
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.program import FunctionCallingProgram
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, Field

from pc_rag import PromptCacheError
from pc_rag.integrations.llama_index import PromptCacheLLM


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


TOOLS = [FunctionTool.from_defaults(add), FunctionTool.from_defaults(get_weather)]


class Joke(BaseModel):
    setup: str = Field(description="the question")
    punchline: str = Field(description="the answer")


@pytest.fixture(scope="module")
def llm(smollm):
    return PromptCacheLLM(engine=smollm, max_new_tokens=96, generate_kwargs={"no_repeat_ngram_size": 10})


def test_a_function_calling_llm(llm):
    assert isinstance(llm, FunctionCallingLLM)
    assert llm.metadata.is_function_calling_model and llm.metadata.is_chat_model


def test_chat_with_tools_required_call_parses_into_tool_selections(llm):
    response = llm.chat_with_tools(TOOLS, user_msg="What is 2 plus 5? Use the tool.", tool_required=True)
    (call,) = llm.get_tool_calls_from_response(response)
    assert call.tool_name == "add" and call.tool_kwargs == {"a": 2, "b": 5} and call.tool_id.startswith("call_")
    assert response.additional_kwargs["finish_reason"] == "tool_calls"
    (block,) = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
    assert block.tool_name == "add"
    assert json.loads(response.message.additional_kwargs["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 5}
    # a tool named by tool_choice, also in OpenAI's dict spelling; streamed, the call arrives whole
    named = llm.chat_with_tools(TOOLS, user_msg="Weather in Paris?", tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [c.tool_name for c in llm.get_tool_calls_from_response(named)] == ["get_weather"]
    *_, last = llm.stream_chat_with_tools(TOOLS, user_msg="What is 2 plus 5? Use the tool.", tool_required=True)
    assert [c.tool_kwargs for c in llm.get_tool_calls_from_response(last)] == [{"a": 2, "b": 5}]


def test_a_text_reply_is_no_tool_call(llm):
    response = llm.chat_with_tools(TOOLS, user_msg="Say hello.", tool_choice="none")
    assert response.message.content and llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="expected at least one tool call"):
        llm.get_tool_calls_from_response(response)


def test_predict_and_call_runs_the_tool(llm):
    answer = llm.predict_and_call(TOOLS, user_msg="What is 2 plus 5?", tool_choice="add")
    assert answer.response == "7" and answer.sources[0].tool_name == "add"
    answer = asyncio.run(llm.apredict_and_call(TOOLS, user_msg="What is 2 plus 5?", tool_choice="add"))
    assert answer.response == "7"


def test_function_agent_calls_the_tool_and_reads_its_result(llm):
    async def run() -> tuple[list[tuple[str, dict, str]], str]:
        agent = FunctionAgent(tools=TOOLS, llm=llm, initial_tool_choice="add", system_prompt="Answer briefly.")
        handler = agent.run("What is 2 plus 5?")
        calls = [(event.tool_name, event.tool_kwargs, str(event.tool_output)) async for event in handler.stream_events()
                 if isinstance(event, ToolCallResult)]
        return calls, str(await handler)

    calls, _ = asyncio.run(run())
    assert calls[0] == ("add", {"a": 2, "b": 5}, "7")


def test_a_tool_round_trip_renders_calls_and_results(llm):
    call = ChatMessage(role="assistant", blocks=[ToolCallBlock(tool_call_id="c1", tool_name="add", tool_kwargs={"a": 2, "b": 5})])
    result = ChatMessage(role="tool", content="7", additional_kwargs={"tool_call_id": "c1"})
    prompt, _, tools = llm._chat_request([ChatMessage(role="user", content="What is 2 plus 5?"), call, result],
                                         {"tools": [t.metadata.to_openai_tool() for t in TOOLS]})
    assert '"arguments": {"a": 2, "b": 5}' in prompt and "tool\n7" in prompt and len(tools) == 2


def test_structured_predict_and_structured_llm_always_parse(llm):
    joke = llm.structured_predict(Joke, PromptTemplate("Tell me a joke about {topic}."), topic="cats")
    assert isinstance(joke, Joke)
    reply = llm.as_structured_llm(Joke).chat([ChatMessage(role="user", content="A joke about dogs.")])
    assert isinstance(reply.raw, Joke) and set(json.loads(reply.message.content)) == {"setup", "punchline"}
    assert isinstance(asyncio.run(llm.astructured_predict(Joke, PromptTemplate("A joke about {topic}."), topic="owls")), Joke)
    *_, last = llm.stream_structured_predict(Joke, PromptTemplate("Tell me a joke about {topic}."), topic="birds")
    assert isinstance(last, Joke)
    # at a budget that cuts the joke short, the document still closes
    short = llm.structured_predict(Joke, PromptTemplate("Tell me a long joke about {topic}."), llm_kwargs={"max_new_tokens": 16}, topic="cats")
    assert isinstance(short, Joke)


def test_function_calling_program_through_a_forced_call(llm):
    program = FunctionCallingProgram.from_defaults(output_cls=Joke, prompt_template_str="A joke about {topic}.", llm=llm)
    assert isinstance(program(topic="fish"), Joke)


def test_a_budget_too_small_for_any_document_is_a_clear_error(llm, smollm):
    needed = smollm.min_json_tokens(Joke.model_json_schema())
    assert needed is not None and needed > 3
    with pytest.raises(PromptCacheError, match=f"the shortest document of the schema takes {needed} tokens"):
        llm.structured_predict(Joke, PromptTemplate("A joke about {topic}."), llm_kwargs={"max_new_tokens": 3}, topic="cats")
