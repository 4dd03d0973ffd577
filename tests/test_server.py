"""``pc-rag serve`` as a process on a port, driven by the clients users drive it with: the
``openai`` SDK, LangChain's ``ChatOpenAI``, LlamaIndex's ``OpenAILike`` and raw ``httpx``."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import jsonschema
import openai
import pytest

from .conftest import SQUAD
from .servers import MODEL, ServerProcess

QUESTION = "Where was Super Bowl 50 played?"


@pytest.fixture(scope="module")
def client(pcrag_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=pcrag_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def passage() -> str:
    return json.loads(SQUAD.read_text())["data"][0]["paragraphs"][0]["context"]


def add_and_wait(server: ServerProcess, collection: str, documents: list[dict], key: str | None = None) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(f"{server.url}/v1/collections/{collection}/documents", json={"documents": documents}, headers=headers)
    assert response.status_code == 202, response.text
    assert [d["id"] for d in response.json()["data"]] == [d["id"] for d in documents]

    def encoded() -> bool:
        listing = httpx.get(f"{server.url}/v1/collections/{collection}/documents", headers=headers).json()["data"]
        return {d["id"] for d in listing if d["status"] == "encoded"} >= {d["id"] for d in documents}

    server.wait_for(encoded, "documents encoded")


# -- the openai SDK -----------------------------------------------------------------------------
def test_models_and_health(client, pcrag_server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(pcrag_server.url + "/health").json()["status"] == "ok"


def test_chat_and_stream_agree_and_report_usage(client):
    messages = [{"role": "user", "content": "Name a primary colour."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the stream says what the whole reply says
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_text_completions_one_choice_per_prompt(client):
    reply = client.completions.create(model=MODEL, prompt=["The capital of France is", "One, two, three,"], max_tokens=4)
    assert [c.index for c in reply.choices] == [0, 1] and all(c.text for c in reply.choices)
    alone = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=4)
    assert alone.choices[0].text == reply.choices[1].text


def test_several_choices_per_prompt(client):
    """``n`` choices: seeded sampling gives each its own sample and the same reply again; the
    prompt's tokens are counted once."""
    messages = [{"role": "user", "content": "Name an animal."}]
    one = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, n=3, temperature=1.2, seed=5)
    texts = [c.message.content for c in reply.choices]
    assert [c.index for c in reply.choices] == [0, 1, 2] and len(set(texts)) > 1
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, n=3, temperature=1.2, seed=5)
    assert [c.message.content for c in again.choices] == texts
    assert reply.usage.prompt_tokens == one.usage.prompt_tokens and reply.usage.completion_tokens > one.usage.completion_tokens
    text = client.completions.create(model=MODEL, prompt=["The capital of France is", "One, two, three,"], max_tokens=4, n=2)
    alone = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=4)
    assert [c.index for c in text.choices] == [0, 1, 2, 3]
    assert text.choices[2].text == text.choices[3].text == alone.choices[0].text  # greedy: the prompt's choices agree
    first = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4)
    assert text.usage.prompt_tokens == first.usage.prompt_tokens + alone.usage.prompt_tokens


def test_several_choices_streamed(client):
    """``n`` choices streamed: each chunk names its choice, each choice's chunks spell what the
    whole reply's choice says, with its own finish and log-probabilities, and usage counts the
    prompt once."""
    messages = [{"role": "user", "content": "Name an animal."}]
    settings = dict(model=MODEL, messages=messages, max_tokens=8, n=3, temperature=1.2, seed=5, logprobs=True)
    whole = client.chat.completions.create(**settings)
    chunks = list(client.chat.completions.create(**settings, stream=True, stream_options={"include_usage": True}))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
        assert [t.token for c in mine if c.logprobs for t in c.logprobs.content] == [t.token for t in choice.logprobs.content]
    assert len({c.message.content for c in whole.choices}) > 1
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    text = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=4, n=2)
    pieces = list(client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=4, n=2, stream=True))
    assert ["".join(p.choices[0].text for p in pieces if p.choices[0].index == i) for i in (0, 1)] == [c.text for c in text.choices]


def test_stop_and_seed(client):
    messages = [{"role": "user", "content": "Describe the sea in one sentence."}]
    free = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20).choices[0].message.content
    stop = free.split()[2]  # a word the reply writes
    stopped = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and free.startswith(stopped.choices[0].message.content)
    assert stop not in stopped.choices[0].message.content
    sampled = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=1.0, seed=7)
               .choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1]  # the same seed samples the same reply


def test_logprobs_of_chat_and_text_completions(client):
    """One entry per generated token, in OpenAI's two shapes: the tokens spell the reply, greedy's
    token is its step's most likely, alternatives come most likely first."""
    messages = [{"role": "user", "content": "Name a primary colour."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 10
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for token in content:
        assert token.logprob <= 0 and bytes(token.bytes) == token.token.encode()
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
        assert len(token.top_logprobs) == 3 and token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == reply.choices[0].message.content
    text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, logprobs=2).choices[0]
    assert "".join(text.logprobs.tokens) == text.text and len(text.logprobs.token_logprobs) == 5
    assert text.logprobs.text_offset == [sum(len(t) for t in text.logprobs.tokens[:i]) for i in range(5)]
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(lp) for top, lp in zip(text.logprobs.top_logprobs,
                                                                                       text.logprobs.token_logprobs))
    for bad, says in (({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be from 0 to 20"),
                      ({"top_logprobs": 2}, "top_logprobs needs logprobs: true")):
        with pytest.raises(openai.BadRequestError, match=says):
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **bad)
    # streamed: each chunk carries the tokens its text completes, and the lists joined are the whole reply's
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, logprobs=True, top_logprobs=3,
                                                 stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    with_text = [c.choices[0] for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(with_text) > 1 and all("".join(t.token for t in c.logprobs.content) == c.delta.content for c in with_text)
    pieces = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, logprobs=2, stream=True))
    assert [t for p in pieces if p.choices[0].logprobs for t in p.choices[0].logprobs.tokens] == text.logprobs.tokens
    offsets = [o for p in pieces if p.choices[0].logprobs for o in p.choices[0].logprobs.text_offset]
    assert offsets == text.logprobs.text_offset and sum(bool(p.choices[0].text) for p in pieces) > 1
    # a stop sequence holds text back: its tokens come with the text that shows them, those it cuts at the end
    stopped = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, logprobs=0, stream=True,
                                             stop=[text.text[3:6]]))
    whole = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, logprobs=0, stop=[text.text[3:6]])
    assert [t for p in stopped if p.choices[0].logprobs for t in p.choices[0].logprobs.tokens] == whole.choices[0].logprobs.tokens
    assert "".join(p.choices[0].text for p in stopped) == whole.choices[0].text


def test_logit_bias_forces_and_bans_tokens(client, tokenizer):
    (blue,) = tokenizer.encode(" blue", add_special_tokens=False)
    forced = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, logit_bias={str(blue): 100})
    assert forced.choices[0].text == " blue blue blue"
    plain = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=1).choices[0].text
    (chosen,) = tokenizer.encode(plain, add_special_tokens=False)
    banned = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=1, logit_bias={str(chosen): -100})
    assert banned.choices[0].text not in ("", plain)


def test_openai_penalties_change_a_repetitive_reply(client):
    messages = [{"role": "user", "content": "List the numbers from 1 to 20, separated by commas."}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30).choices[0].message.content
    penalized = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, frequency_penalty=2.0,
                                               presence_penalty=1.0).choices[0].message.content
    assert plain.count(",") > penalized.count(",")  # each comma costs more than the last


def test_forced_tool_call_and_json_schema(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
                                           tool_choice="required", max_tokens=40)
    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    streamed = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
                                                   tool_choice="required", max_tokens=40, stream=True))
    calls = [c.choices[0].delta.tool_calls for c in streamed if c.choices and c.choices[0].delta.tool_calls]
    assert calls[0][0].function.arguments == call.function.arguments
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    person = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(person.choices[0].message.content), schema)


def test_pasted_documents_are_read_from_the_cache(client, pcrag_server, passage):
    add_and_wait(pcrag_server, "squad", [{"id": "sb50-p0", "text": passage, "metadata": {"title": "Super_Bowl_50"}}])
    messages = [{"role": "user", "content": f"{passage}\n\n{QUESTION}"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert first.usage.prompt_tokens_details.cached_tokens > 100
    by_id = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=8,
                                           extra_body={"documents": ["sb50-p0"], "collection": "squad"})
    assert by_id.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens_details.cached_tokens
    missing = httpx.post(pcrag_server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "documents": ["no-such-doc"], "collection": "squad"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_a_replaced_document_is_queued_until_its_new_text_is_encoded(client, pcrag_server):
    """Before, the listing said "encoded" of the old text while the new one waited: a client that
    replaced a document and waited for "encoded" was served the old text."""
    def cached(text: str) -> int:
        add_and_wait(pcrag_server, "replaced", [{"id": "ferry", "text": text}])
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "When does it leave?"}],
                                               max_tokens=2, extra_body={"documents": ["ferry"], "collection": "replaced"})
        return reply.usage.prompt_tokens_details.cached_tokens

    short = cached("The ferry leaves at nine.")
    assert cached("The ferry leaves at nine in summer and at ten in winter, weather permitting, from the north pier.") > short


def test_documents_listed_paged_and_deleted(pcrag_server):
    docs = [{"id": f"note-{i}", "text": f"Note number {i} says the meeting room is {i} floors up."} for i in range(3)]
    add_and_wait(pcrag_server, "notes", docs)
    url = pcrag_server.url + "/v1/collections/notes/documents"
    page = httpx.get(url, params={"limit": 2}).json()
    assert [d["id"] for d in page["data"]] == ["note-0", "note-1"] and page["has_more"]
    rest = httpx.get(url, params={"limit": 2, "after": page["last_id"]}).json()
    assert [d["id"] for d in rest["data"]] == ["note-2"] and not rest["has_more"]
    assert httpx.delete(url + "/note-1").json() == {"id": "note-1", "object": "document", "deleted": True}
    assert [d["id"] for d in httpx.get(url).json()["data"]] == ["note-0", "note-2"]
    assert httpx.delete(url + "/note-1").status_code == 404


# -- bad input ----------------------------------------------------------------------------------
def _chat(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


# ``param`` names the field at fault as the request spelled it (the openai SDK's error.param):
# those the engine refused (seed, stop, logit_bias, penalties) came back with none
@pytest.mark.parametrize(("body", "status", "says", "param"), [
    (b"{not json", 400, "not valid JSON", None),
    (b"[1, 2]", 400, "JSON object", None),
    (_chat(max_tokens="8"), 400, "max_tokens", "max_tokens"),
    (json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}).encode(), 400, "messages.0.role", "messages.0.role"),
    (_chat(n=17), 400, "n: Input should be less", "n"),
    (_chat(presence_penalty=2.5), 400, "presence_penalty", "presence_penalty"),
    (_chat(temperature=3), 400, "temperature", "temperature"),
    (_chat(tool_choice="get_x"), 400, "tool_choice", "tool_choice"),
    (_chat(response_format={"type": "yaml"}), 400, "response_format", "response_format"),
    (json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404, "gpt-4o", "model"),
    # a seed past 64 bits was a 500; a logit_bias was ignored (the reply unbiased, nothing said)
    (_chat(seed=2**80, temperature=1), 400, "seed", "seed"),
    (_chat(logit_bias={"50": 101}), 400, "logit_bias of token 50 must be a number from -100 to 100", "logit_bias"),
    (_chat(logit_bias={"hello": 5}), 400, "logit_bias keys are token ids", "logit_bias"),
    (_chat(logit_bias={"99999999": 5}), 400, "the model's vocabulary has 49152 tokens", "logit_bias"),
    # JSON's Infinity passed the wire's check (> 0) and reached the sampler
    (_chat(repetition_penalty=float("inf")), 400, "repetition_penalty must be a finite number", "repetition_penalty"),
    (_chat(stop=""), 400, "stop sequences must be non-empty", "stop"),
    # 100,000 stops in one body slowed every tenant's decode steps (each searched after every token)
    (_chat(stop=[f"{i:08d}" for i in range(100_000)]), 400, "at most 16 stop sequences", "stop"),
    # an image part: the error names the part's type, not the string the content could have been
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(),
     400, "'image_url'", "messages.0.content.0.type"),
], ids=lambda value: "body" if isinstance(value, bytes) else None)
def test_bad_requests_get_openai_shaped_errors(pcrag_server, body, status, says, param):
    response = httpx.post(pcrag_server.url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param


@pytest.mark.parametrize("field", ["echo", "suffix", "best_of"])
def test_text_completion_fields_not_served_are_named(pcrag_server, field):
    value = {"echo": True, "suffix": "!", "best_of": 2}[field]
    response = httpx.post(pcrag_server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field  # was "echo" for all three


def test_unknown_fields_are_ignored(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_body={"some_vendor_field": {"x": 1}, "logit_bias_mode": "none"})
    assert reply.usage.completion_tokens == 2


def test_oversized_body_and_long_prompt(pcrag_server):
    huge = httpx.post(pcrag_server.url + "/v1/chat/completions", content=b"x" * (9 * 1024 * 1024))
    assert huge.status_code == 413
    long = httpx.post(pcrag_server.url + "/v1/completions", json={"model": MODEL, "prompt": "word " * 9000, "max_tokens": 4})
    assert long.status_code == 400
    error = long.json()["error"]
    assert "context window (8192)" in error["message"] and any(int(w) > 8192 for w in error["message"].split() if w.isdigit())
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")  # OpenAI's code for it
    # a prompt that fits with a max_tokens that does not: refused up front, as OpenAI and vLLM refuse it
    # (before, it was queued and its answer cut at the window, finish_reason "length")
    past = httpx.post(pcrag_server.url + "/v1/completions", json={"model": MODEL, "prompt": "word " * 4000, "max_tokens": 5000})
    assert past.status_code == 400
    error = past.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens") and "max_tokens 5000 more" in error["message"]
    assert httpx.get(pcrag_server.url + "/health").status_code == 200  # and the server lives on


def test_a_document_that_cannot_be_encoded_is_refused_when_added(pcrag_server):
    """Accepted (202), then dropped by the background encoder, its error only in the server's log:
    never listed, so a client waiting for "encoded" waited for ever."""
    url = f"{pcrag_server.url}/v1/collections/longdocs/documents"
    too_long = httpx.post(url, json={"documents": [{"id": "fits", "text": "A short note."}, {"id": "huge", "text": "word " * 9000}]})
    assert too_long.status_code == 400
    error = too_long.json()["error"]
    assert "document 'huge' needs" in error["message"] and (error["param"], error["code"]) == ("documents", "context_length_exceeded")
    assert httpx.get(url).status_code == 404  # nothing of the request was queued
    # a collection is a folder under --kv-dir: a name past the filesystem's bound was accepted, then
    # failed to encode (OSError); now no such collection can exist (404, as for any invalid name)
    long_name = httpx.post(f"{pcrag_server.url}/v1/collections/{'c' * 300}/documents", json={"documents": [{"text": "x"}]})
    assert long_name.status_code == 404


def test_a_body_that_never_arrives_times_out(pcrag_server):
    """A client that announces a body and stalls (slowloris) gets a 408 and the server lives on."""
    with socket.create_connection(("127.0.0.1", pcrag_server.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        reply = b""  # the server's 2 s body timeout (--body-timeout-s) answers: read its status line and body
        while b"did not arrive" not in reply and (chunk := sock.recv(4096)):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 2 s" in reply
    assert httpx.get(pcrag_server.url + "/health").status_code == 200


def test_disconnects_free_their_rows(pcrag_server):
    cancelled = pcrag_server.metric("pcrag_scheduler_cancelled_total")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
            "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", pcrag_server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    # the streaming client is gone: its row is let go, long before 2000 tokens
    pcrag_server.wait_for(lambda: pcrag_server.metric("pcrag_scheduler_cancelled_total") > cancelled, "stream cancelled")
    pcrag_server.wait_for(lambda: pcrag_server.metric("pcrag_running_rows") == 0, "rows free")
    pcrag_server.wait_for(lambda: pcrag_server.metric("pcrag_kv_buffer_bytes") == 0, "its KV buffer let go")
    # a client waiting for a whole reply that hangs up is let go too
    payload = json.dumps({**body, "stream": False}).encode()
    with socket.create_connection(("127.0.0.1", pcrag_server.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        pcrag_server.wait_for(lambda: pcrag_server.metric("pcrag_running_rows") == 1, "request admitted")
    pcrag_server.wait_for(lambda: pcrag_server.metric("pcrag_scheduler_cancelled_total") > cancelled + 1, "request cancelled")
    assert pcrag_server.metric("pcrag_requests_total", endpoint="chat", status="499") >= 1


def test_a_refused_prompt_lets_its_siblings_go(pcrag_server):
    """A text completion of several prompts, one of them refused (too long): the 400 answers for
    all, and the prompts served beside it stop too, rather than decode 2,000 tokens for nobody,
    outside the key's requests in flight and its tokens per minute."""
    steps = pcrag_server.metric("pcrag_scheduler_steps_total")
    body = {"model": MODEL, "prompt": ["Write a very long story about a dragon.", "word " * 9000],
            "max_tokens": 2000, "min_tokens": 2000}
    reply = httpx.post(pcrag_server.url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 400 and "context window (8192)" in reply.json()["error"]["message"]
    # a request after it: planned and admitted after the sibling (had the sibling been left to run)
    after = httpx.post(pcrag_server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 1}, timeout=120)
    assert after.status_code == 200
    pcrag_server.wait_for(lambda: pcrag_server.metric("pcrag_running_rows") == 0, "rows free")
    assert pcrag_server.metric("pcrag_scheduler_steps_total") - steps < 200  # not 2,000 decode steps


def test_a_request_needing_more_kv_buffer_than_the_budget_is_refused_with_400(client, pcrag_server):
    """``--buffer-budget-mb 320``: 8,000 new tokens need a ~377 MB buffer of the embedded model's
    45 KB a token, so the request is refused at once, saying why, and the server serves on."""
    with pytest.raises(openai.BadRequestError, match="buffer_budget"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8000)
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3).choices


def test_metrics_count_requests_and_tokens(client, pcrag_server):
    before = pcrag_server.metric("pcrag_requests_total", endpoint="chat", status="200")
    generated = pcrag_server.metric("pcrag_generated_tokens_total")
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert pcrag_server.metric("pcrag_requests_total", endpoint="chat", status="200") == before + 1
    assert pcrag_server.metric("pcrag_generated_tokens_total") == generated + 3
    assert pcrag_server.metric("pcrag_ttft_seconds_count") >= 1


def test_a_stream_whose_client_leaves_mid_reply_is_in_the_metrics(pcrag_server):
    """A stream's first token is observed once, when it is sent, whether or not its client stays:
    clients who give up on a slow reply are not missing from the TTFT histogram, and the tokens
    sent to them are counted as generated."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
            "stream": True}
    ttft = pcrag_server.metric("pcrag_ttft_seconds_count")
    with httpx.stream("POST", pcrag_server.url + "/v1/chat/completions", json={**body, "max_tokens": 3}, timeout=60) as response:
        assert any(line == "data: [DONE]" for line in response.iter_lines())
    assert pcrag_server.metric("pcrag_ttft_seconds_count") == ttft + 1  # a whole stream: once
    generated = pcrag_server.metric("pcrag_generated_tokens_total")
    with httpx.stream("POST", pcrag_server.url + "/v1/chat/completions", json={**body, "max_tokens": 2000}, timeout=60) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        texts = [json.loads(next(events)[6:])["choices"][0]["delta"].get("content") for _ in range(4)]
        assert all(isinstance(text, str) for text in texts) and "".join(texts)  # the role chunk, then text
    assert pcrag_server.metric("pcrag_ttft_seconds_count") == ttft + 2
    pcrag_server.wait_for(lambda: pcrag_server.metric("pcrag_generated_tokens_total") >= generated + 3, "the tokens sent to it counted")
    assert pcrag_server.metric("pcrag_generated_tokens_total") < generated + 2000


# -- LangChain and LlamaIndex pointed at the server ----------------------------------------------
def test_langchain_chat_openai(pcrag_server, passage):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    llm = ChatOpenAI(model=MODEL, base_url=pcrag_server.url + "/v1", api_key="unused", max_tokens=24, stream_usage=True)
    add_and_wait(pcrag_server, "squad", [{"id": "sb50-p0", "text": passage}])
    message = llm.invoke(f"{passage}\n\n{QUESTION}")
    assert message.content and message.usage_metadata["input_token_details"]["cache_read"] > 100
    scored = llm.bind(logprobs=True).invoke(f"{passage}\n\n{QUESTION}")  # a RAG app's confidence signal
    assert scored.content == message.content
    assert "".join(t["token"] for t in scored.response_metadata["logprobs"]["content"]) == message.content
    scored_stream = None
    for chunk in llm.bind(logprobs=True).stream(f"{passage}\n\n{QUESTION}"):
        scored_stream = chunk if scored_stream is None else scored_stream + chunk
    assert scored_stream.response_metadata["logprobs"] == scored.response_metadata["logprobs"]
    streamed = None
    for chunk in llm.stream(f"{passage}\n\n{QUESTION}"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.content == message.content

    class Answer(BaseModel):
        city: str

    parsed = llm.with_structured_output(Answer).invoke("Which city hosts the Eiffel Tower?")
    assert isinstance(parsed, Answer) and parsed.city

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    called = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Rome?")
    assert called.tool_calls and called.tool_calls[0]["name"] == "get_weather"


def test_a_prompt_past_the_context_window_is_langchains_context_overflow(pcrag_server):
    """ChatOpenAI raises LangChain's ContextOverflowError on OpenAI's ``context_length_exceeded``
    (a chain trims its history on it): pc-rag's 400 carried no code, so it raised a plain BadRequestError."""
    from langchain_core.exceptions import ContextOverflowError
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=pcrag_server.url + "/v1", api_key="unused", max_tokens=4, max_retries=0)
    with pytest.raises(ContextOverflowError) as caught:
        llm.invoke("word " * 9000)
    assert isinstance(caught.value, openai.BadRequestError) and caught.value.param == "messages"
    assert llm.invoke("Say hi.").content  # the server lives on


async def test_langchain_async_callers_at_once(pcrag_server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=pcrag_server.url + "/v1", api_key="unused", max_tokens=8)
    questions = [f"Say the number {i}." for i in range(4)]
    together = await asyncio.gather(*(llm.ainvoke(q) for q in questions))
    alone = [llm.invoke(q) for q in questions]
    assert [m.content for m in together] == [m.content for m in alone]


def test_llama_index_openai_like(pcrag_server):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=MODEL, api_base=pcrag_server.url + "/v1", api_key="unused", is_chat_model=True,
                     context_window=8192, max_tokens=8, temperature=0.0)  # LlamaIndex's default samples at 0.1
    reply = llm.chat([ChatMessage(role="user", content="Name a fruit.")])
    assert reply.message.content
    streamed = "".join(r.delta or "" for r in llm.stream_chat([ChatMessage(role="user", content="Name a fruit.")]))
    assert streamed == reply.message.content
    completer = OpenAILike(model=MODEL, api_base=pcrag_server.url + "/v1", api_key="unused", is_chat_model=False, max_tokens=4)
    assert completer.complete("The capital of France is").text
