"""Constrained decoding (``json_schema=``) and tool calling: output that always parses.

A randomly initialised model is the adversary here: left alone it writes noise, so every
document it writes that parses and matches the schema is the grammar's doing.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from pc_rag import PromptCacheError
from pc_rag.integrations.langchain import ChatPromptCache
from pc_rag.prompt.schemas import closed
from pc_rag.prompt.tools import TOOLS_SYSTEM_TEXT, call_schema, parse_calls

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
    engine = make_engine("llama")
    for budget in (2, 5, 120):  # a random model writes on while it may; the budget closes the object
        result = engine.generate("JSON please", max_new_tokens=budget, json_schema=True)
        assert result.finish_reason == "stop" and isinstance(json.loads(result.text), dict)


# -- documents that close within the budget ---------------------------------------------------------
# nothing bounded: a random model left alone writes strings, numbers and arrays without end
OPEN = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "inner": {"type": "object", "properties": {"note": {"type": "string"}, "n": {"type": "integer"}}, "required": ["note", "n"]},
    },
    "required": ["title", "score", "tags", "inner"],
}

# lower bounds the closing must meet, not just end
DEMANDING = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "minLength": 3},
        "kind": {"enum": ["alpha", "beta"]},
        "n": {"type": "integer", "minimum": 10},
        "xs": {"type": "array", "items": {"type": "integer"}, "minItems": 2},
        "flag": {"type": "boolean"},
    },
    "required": ["code", "kind", "n", "xs", "flag"],
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("schema", [OPEN, DEMANDING], ids=["open", "demanding"])
def test_an_unbounded_schema_closes_within_every_budget_that_can_hold_it(make_engine, arch, schema):
    engine = make_engine(arch)
    needed = engine.min_json_tokens(schema)
    assert needed is not None and needed > 10
    for budget in (needed, needed + 1, needed + 2, needed + 5, needed + 11, needed + 30):
        for sampling in ({}, {"temperature": 1.3, "seed": budget}):
            result = engine.generate("JSON:", max_new_tokens=budget, json_schema=schema, **sampling)
            assert result.finish_reason == "stop" and len(result.token_ids) <= budget, (budget, sampling, result.text)
            jsonschema.validate(json.loads(result.text), schema)
    if schema is not OPEN:
        return
    # rows of a batch close each within its own budget
    for result in engine.generate_batch(["JSON:", "Another, longer prompt: JSON"], max_new_tokens=needed + 4, json_schema=OPEN):
        jsonschema.validate(json.loads(result.text), OPEN)
    # a budget that cannot hold any document ends at it: finish_reason "length", never a forced early end
    cut = engine.generate("JSON:", max_new_tokens=3, json_schema=OPEN)
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.text)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_forced_call_closes_within_a_small_budget(make_engine, arch):
    engine = make_engine(arch)
    schema = call_schema([ADD, WEATHER])
    needed = engine.min_json_tokens(schema)
    for budget in range(needed, needed + 8):
        text = engine.generate("call", max_new_tokens=budget, json_schema=schema, temperature=1.2, seed=budget).text
        (call,) = parse_calls(text, [ADD, WEATHER])
        assert (call["name"], set(call["arguments"])) in (("add", {"a", "b"}), ("get_weather", {"city"}))


def test_stop_strings_do_not_cut_a_constrained_document(make_engine):
    engine = make_engine("llama")
    free = engine.generate("JSON:", max_new_tokens=40, json_schema=OPEN)
    stopped = engine.generate("JSON:", max_new_tokens=40, json_schema=OPEN, stop=['"', "a", "{"])
    assert stopped.text == free.text and stopped.finish_reason == "stop"
    jsonschema.validate(json.loads(stopped.text), OPEN)


def test_the_closing_walk_completes_partial_documents(make_engine):
    engine = make_engine("llama")
    vocabulary = engine._vocabulary
    from pc_rag.decode.constrained import schema_text

    for prefix in ('{"title": "abc', '{"title": "a\\', '{"title": "", "score": 1.5', '{"title": "", "score": 0, "tags": ["x", "y',
                   '{"title": "", "score": 0, "tags": [], "inner": {"note": "n'):
        matcher = vocabulary.matcher(schema_text(OPEN))
        for token in engine.tokenizer.encode(prefix, add_special_tokens=False):
            matcher.accept(token)
        closing = matcher.closing()
        text = prefix + engine.tokenizer.decode(closing)
        jsonschema.validate(json.loads(text), OPEN)


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
    # a model's reply is untrusted: a name that is not a string is text, never an error
    assert parse_calls('{"name": {"description": "add"}, "arguments": {}}', [ADD]) == []
    assert parse_calls('[{"name": ["add"], "arguments": {}}]', [ADD]) == []
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

    from pc_rag.prompt.chat import render_chat

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
    # the settings of the standard suite (tests/test_langchain_standard.py): no loops, a budget that closes
    return ChatPromptCache(engine=smollm, max_new_tokens=96, no_repeat_ngram_size=10)


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
    # the 135M model's setup runs on until the budget steers the document shut: the punchline may be empty
    assert isinstance(joke, Joke) and joke.setup and isinstance(joke.punchline, str)
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


ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}}, "required": ["answer", "confidence"]}


def test_the_embedded_model_closes_its_document_at_small_budgets_and_past_stop_strings(smollm):
    # the reports: max_new_tokens cut '{"answer": "\\rit PCA', stop='a' cut '{"'
    prompt = smollm.render_chat([{"role": "user", "content": "What is PCA? Reply in JSON."}])
    needed = smollm.min_json_tokens(ANSWER)
    for budget in (needed, needed + 3, needed + 9):
        result = smollm.generate(prompt, max_new_tokens=budget, json_schema=ANSWER)
        assert result.finish_reason == "stop" and len(result.token_ids) <= budget
        jsonschema.validate(json.loads(result.text), ANSWER)
    stopped = smollm.generate(prompt, max_new_tokens=24, json_schema=ANSWER, stop="a")
    assert stopped.finish_reason == "stop" and "a" in json.loads(stopped.text)["answer"]


def test_langchain_structured_output_and_forced_calls_parse_at_small_budgets(chat, smollm):
    call_needed = smollm.min_json_tokens(call_schema([WEATHER], "get_weather"))
    for extra in (0, 4):
        joke = chat.with_structured_output(Joke).invoke("Tell me a long joke about cats.", max_new_tokens=14 + extra)
        assert isinstance(joke, Joke)
        message = chat.bind_tools([add, get_weather], tool_choice="get_weather").invoke(
            "What is the weather in the city of Llanfairpwllgwyngyll? Use the tool.", max_new_tokens=call_needed + extra)
        assert [c["name"] for c in message.tool_calls] == ["get_weather"] and set(message.tool_calls[0]["args"]) == {"city"}
    needed = smollm.min_json_tokens(closed(Joke.model_json_schema()))
    with pytest.raises(PromptCacheError, match=f"max_new_tokens=3.*the shortest document of the schema takes {needed} tokens"):
        chat.with_structured_output(Joke).invoke("Tell me a joke about cats.", max_new_tokens=3)
