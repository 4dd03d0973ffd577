"""Constrained decoding (``json_schema=``) and tool calling: output that always parses.

A randomly initialised model is the adversary here: left alone it writes noise, so every
document it writes that parses and matches the schema is the grammar's doing.
"""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from pc_rag import PromptCacheError
from pc_rag.constrained import closed
from pc_rag.integrations.langchain import ChatPromptCache
from pc_rag.tools import TOOLS_SYSTEM_TEXT, call_schema, parse_calls

# every value bounded, so even a random model finishes the document within the budget
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["fact", "opinion", "unknown"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["kind", "score", "ok", "tags"],
    "additionalProperties": False,
}


class Answer(BaseModel):
    kind: str
    score: int = Field(ge=0, le=99)
    ok: bool
    tags: list[str]


def check(text: str) -> dict:
    value = json.loads(text)
    Answer.model_validate(value)
    assert set(value) == {"kind", "score", "ok", "tags"} and value["kind"] in ("fact", "opinion", "unknown")
    assert set(value["tags"]) <= {"a", "b"} and len(value["tags"]) <= 2
    return value


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_random_model_writes_only_documents_of_the_schema(make_engine, arch):
    engine = make_engine(arch)
    prompt = "Answer in JSON: is the sky blue?"
    free = engine.generate(prompt, max_new_tokens=40)
    with pytest.raises(json.JSONDecodeError):  # unconstrained, the random model writes noise
        json.loads(free.text)
    greedy = engine.generate(prompt, max_new_tokens=80, json_schema=SCHEMA)
    assert greedy.finish_reason == "stop"
    check(greedy.text)
    for seed in range(4):  # sampling from the masked distribution, also at a high temperature
        sampled = engine.generate(prompt, max_new_tokens=80, json_schema=json.dumps(SCHEMA), temperature=1.5, seed=seed)
        assert sampled.finish_reason == "stop"
        check(sampled.text)


def test_batch_rows_each_follow_the_schema_and_equal_single_requests(make_engine):
    engine = make_engine("llama")
    prompts = ["First question?", "A second, longer question about something else?", "Third?"]
    batch = engine.generate_batch(prompts, max_new_tokens=80, json_schema=SCHEMA)
    for prompt, result in zip(prompts, batch):
        check(result.text)
        assert result.token_ids == engine.generate(prompt, max_new_tokens=80, json_schema=SCHEMA).token_ids


def test_the_grammar_wins_over_processors_that_ban_its_only_token(make_engine):
    # no_repeat_ngram_size=1 bans every token already written; the schema forces repeats
    engine = make_engine("llama")
    schema = {"type": "object", "properties": {"x": {"const": "aaaa aaaa aaaa"}, "y": {"const": "aaaa aaaa aaaa"}},
              "required": ["x", "y"], "additionalProperties": False}
    result = engine.generate("Repeat", max_new_tokens=60, json_schema=schema, no_repeat_ngram_size=1)
    assert json.loads(result.text) == {"x": "aaaa aaaa aaaa", "y": "aaaa aaaa aaaa"}


def test_any_json_object_with_true(make_engine):
    result = make_engine("llama").generate("JSON please", max_new_tokens=120, json_schema=True)
    if result.finish_reason == "stop":
        assert isinstance(json.loads(result.text), dict)
    else:  # cut by max_new_tokens: still a prefix of a JSON object
        assert result.text.startswith("{")


@pytest.mark.parametrize("bad", [{"type": "no-such-type"}, "{not json", 42])
def test_bad_schema_is_refused_before_any_work(make_engine, bad):
    engine = make_engine("llama")
    encoded = engine.store_stats()["encoded"]
    with pytest.raises(PromptCacheError, match="json_schema"):
        engine.generate("hi", json_schema=bad)
    assert engine.store_stats()["encoded"] == encoded


def test_closed_schema_adds_no_keys_beyond_its_properties():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}},
              "$defs": {"X": {"type": "object", "properties": {"c": {"type": "string"}}, "additionalProperties": True}}}
    out = closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["$defs"]["X"]["additionalProperties"] is True  # what a schema says is kept
    assert "additionalProperties" not in schema  # the caller's schema is not modified


# -- tools ------------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather at a place.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                                       "required": ["a", "b"]}}}

PICK = {"type": "function", "function": {"name": "pick", "description": "Pick an option.",
                                         "parameters": {"type": "object", "properties": {"option": {"enum": ["x", "y"]}}, "required": ["option"]}}}


def test_a_forced_call_from_a_random_model_names_a_bound_tool_with_valid_arguments(make_engine):
    engine = make_engine("llama")
    for seed in range(3):
        text = engine.generate("call", max_new_tokens=60, json_schema=call_schema([ADD]), temperature=1.2, seed=seed).text
        (call,) = parse_calls(text, [ADD])
        assert call["name"] == "add" and set(call["arguments"]) == {"a", "b"}
        assert all(isinstance(v, int) for v in call["arguments"].values())
    # a named choice among several tools: always that one
    text = engine.generate("call", max_new_tokens=60, json_schema=call_schema([WEATHER, PICK], "pick")).text
    assert parse_calls(text, [WEATHER, PICK]) == [{"name": "pick", "arguments": {"option": json.loads(text)["arguments"]["option"]}}]


def test_parse_calls_reads_calls_and_nothing_else():
    assert parse_calls('{"name": "add", "arguments": {"a": 1, "b": 2}}', [ADD]) == [{"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert parse_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', [ADD])[0]["arguments"] == {"a": 1}
    assert parse_calls('{"name": "rm_rf", "arguments": {}}', [ADD]) == []  # not a bound tool
    assert parse_calls('{"name": "add", "arguments": "1, 2"}', [ADD]) == []  # arguments not an object
    assert parse_calls("The answer is 3.", [ADD]) == []
    with pytest.raises(PromptCacheError, match="not a bound tool"):
        call_schema([ADD], "get_weather")
    with pytest.raises(PromptCacheError, match="OpenAI-style"):
        call_schema([{"name": "add"}])
    with pytest.raises(PromptCacheError, match="needs tools"):
        call_schema([])


def test_tools_go_to_the_system_turn_of_a_template_without_tools(smollm):
    prompt = smollm.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 1 and 2"}], tools=[ADD])
    assert "Be brief." in prompt and TOOLS_SYSTEM_TEXT.split("{tools}")[0] in prompt and '"name": "add"' in prompt
    # an earlier call is written as the JSON object the model is asked to write
    history = smollm.render_chat([
        {"role": "user", "content": "Add 1 and 2"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ], tools=[ADD])
    assert '{"name": "add", "arguments": {"a": 1, "b": 2}}' in history


def test_tools_go_through_a_template_that_renders_them(tokenizer):
    from copy import deepcopy

    from pc_rag.model import render_chat

    render_chat(tokenizer, None, [{"role": "user", "content": "hi"}], tools=[ADD])  # the plain template probed first
    tool_aware = deepcopy(tokenizer)
    tool_aware.chat_template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "[call {{ c.function.name }}]{% endfor %}{% endif %}</{{ m.role }}>{% endfor %}<assistant>")
    prompt = render_chat(tool_aware, None, [
        {"role": "user", "content": "Add"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]},
    ], tools=[ADD, WEATHER])
    assert prompt.startswith("<tools>add;get_weather;</tools>") and "[call add]" in prompt
    assert TOOLS_SYSTEM_TEXT.split("{tools}")[0] not in prompt


# -- LangChain --------------------------------------------------------------------------------------
@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def get_weather(city: str) -> str:
    """Get the weather in a city."""
    return "sunny"


class Joke(BaseModel):
    """A joke."""

    setup: str = Field(description="the question")
    punchline: str = Field(description="the answer")


@pytest.fixture(scope="module")
def chat(smollm):
    # the settings of the standard suite (tests/test_langchain_standard.py): room to finish, no loops
    return ChatPromptCache(engine=smollm, max_new_tokens=256, no_repeat_ngram_size=10)


def test_bind_tools_forced_call_parses_into_tool_calls(chat):
    message = chat.bind_tools([add, get_weather], tool_choice="add").invoke("What is 2 plus 5? Use the tool.")
    assert message.content == "" and message.response_metadata["finish_reason"] == "tool_calls"
    (call,) = message.tool_calls
    assert call["name"] == "add" and call["args"] == {"a": 2, "b": 5} and call["id"].startswith("call_")
    streamed = None
    for chunk in chat.bind_tools([add, get_weather], tool_choice="any").stream("What is 2 plus 5? Use the tool."):
        streamed = chunk if streamed is None else streamed + chunk
    assert [c["name"] for c in streamed.tool_calls] == ["add"] and streamed.tool_calls[0]["args"] == {"a": 2, "b": 5}
    assert streamed.usage_metadata["output_tokens"] > 0
    # streaming=True: invoke decodes through the stream, and the call survives joining the chunks
    by_stream = chat.model_copy(update={"streaming": True}).bind_tools([add], tool_choice="any").invoke("What is 2 plus 5? Use the tool.")
    assert by_stream.tool_calls and by_stream.tool_calls[0]["args"] == {"a": 2, "b": 5}


def test_a_tool_round_trip_renders_and_answers(chat):
    messages = [SystemMessage("Answer briefly."), HumanMessage("What is 2 plus 5?"),
                AIMessage("", tool_calls=[{"name": "add", "args": {"a": 2, "b": 5}, "id": "c1", "type": "tool_call"}]),
                ToolMessage("7", tool_call_id="c1", name="add")]
    prompt, _, tools = chat._request(messages, None, {"tools": [WEATHER, ADD], "tool_choice": "none"})
    assert tools == [] and '"arguments": {"a": 2, "b": 5}' in prompt and "tool\n7" in prompt
    answer = chat.bind_tools([add]).invoke(messages)
    assert isinstance(answer, AIMessage) and (answer.content or answer.tool_calls)


def test_with_structured_output_always_parses(chat):
    joke = chat.with_structured_output(Joke).invoke("Tell me a joke about cats.")
    assert isinstance(joke, Joke) and joke.setup and joke.punchline
    as_dict = chat.with_structured_output(Joke.model_json_schema()).invoke("Tell me a joke about dogs.")
    assert set(as_dict) == {"setup", "punchline"}
    raw = chat.with_structured_output(Joke, include_raw=True).invoke("Tell me a joke about birds.")
    assert raw["parsing_error"] is None and isinstance(raw["parsed"], Joke) and isinstance(raw["raw"], AIMessage)
    by_tool = chat.with_structured_output(Joke, method="function_calling").invoke("Tell me a joke about fish.")
    assert isinstance(by_tool, Joke)
    assert isinstance(chat.with_structured_output(Joke, method="json_mode", include_raw=True).invoke(
        "A joke about cats as JSON with keys setup and punchline.")["raw"], AIMessage)


def test_bad_tool_arguments_are_typed_errors(chat):
    with pytest.raises(PromptCacheError, match="tool_choice"):
        chat.bind_tools([add], tool_choice="multiply")
    with pytest.raises(PromptCacheError, match="response_format"):
        chat.invoke("hi", response_format={"type": "xml"})
    with pytest.raises(PromptCacheError, match="method"):
        chat.with_structured_output(Joke, method="regex")
    with pytest.raises(PromptCacheError, match="needs tools"):
        chat.invoke("hi", tool_choice="any")
