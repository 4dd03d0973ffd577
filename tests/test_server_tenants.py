"""``pc-rag serve --api-keys``: tenants that never see each other, a flood that gets 429s without
losing or doubling a request, and a key held to its ``max_in_flight`` while the others are served.
A real server process with three keys and small limits."""

from __future__ import annotations

import asyncio
import json
import re
import socket

import httpx
import pytest

from pc_rag import PromptCacheError
from pc_rag.cli import main
from pc_rag.server.quota import Quota
from pc_rag.server.tenants import Tenants
from pc_rag.server.wire import ApiError

from .conftest import SQUAD
from .servers import MODEL, ServerProcess

KEY_A, KEY_B, KEY_C = "key-of-tenant-a-0001", "key-of-tenant-b-0002", "key-of-tenant-c-0003"
KEY_D = "key-of-tenant-d-0004"  # 60 tokens a minute: a chat request of 8 new tokens uses ~40
KEY_E = "key-of-tenant-e-0005"  # a bound no test reaches: its minute's tokens are read
KEY_F = "key-of-tenant-f-0006"  # 120 tokens a minute: a chat request of 8 new tokens with a module reference is priced ~76


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("keyed"), "--max-running", "2", "--max-queued", "2",
                           keys={KEY_A: ["alpha"], KEY_B: ["beta"], KEY_C: {"collections": ["gamma"], "max_in_flight": 1},
                                 KEY_D: {"collections": ["delta"], "max_tokens_per_minute": 60},
                                 KEY_E: {"collections": ["epsilon"], "max_tokens_per_minute": 10**9},
                                 KEY_F: {"collections": ["zeta"], "max_tokens_per_minute": 120}})
    yield server
    server.close()


def call(server: ServerProcess, method: str, path: str, key: str | None, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, server.url + path, headers=headers, timeout=120, **kwargs)


def ask(server: ServerProcess, key: str, content: str, **extra) -> httpx.Response:
    return call(server, "POST", "/v1/chat/completions", key,
                json={"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra})


def test_keys_are_required_and_checked(keyed):
    assert call(keyed, "GET", "/v1/models", None).status_code == 401
    wrong = call(keyed, "GET", "/v1/models", "key-of-nobody-at-all")
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert call(keyed, "GET", "/v1/models", KEY_A).status_code == 200
    assert KEY_A not in keyed.log.read_text() and KEY_B not in keyed.log.read_text()  # keys never logged


def test_nothing_crosses_between_tenants(keyed):
    passage = json.loads(SQUAD.read_text())["data"][0]["paragraphs"][1]["context"]
    question = f"{passage}\n\nWho won Super Bowl 50?"
    unseen_collection = call(keyed, "GET", "/v1/collections/alpha/documents", KEY_B)
    before = ask(keyed, KEY_B, question).json()  # tenant B, before tenant A holds the passage
    added = call(keyed, "POST", "/v1/collections/alpha/documents", KEY_A, json={"documents": [{"id": "sb50-p1", "text": passage}]})
    assert added.status_code == 202
    keyed.wait_for(lambda: call(keyed, "GET", "/v1/collections/alpha/documents", KEY_A).json()["data"][0]["status"] == "encoded",
                   "tenant A's document encoded")
    assert ask(keyed, KEY_A, question).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 100  # A reads it
    after = ask(keyed, KEY_B, question).json()
    # B's answer and reuse are those of a server that never saw A's document
    assert after["choices"][0]["message"] == before["choices"][0]["message"]
    assert after["usage"] == before["usage"] and after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # A's collection and document answer B exactly as ones that do not exist
    seen = call(keyed, "GET", "/v1/collections/alpha/documents", KEY_B)
    assert (seen.status_code, seen.json()) == (unseen_collection.status_code, unseen_collection.json()) and seen.status_code == 404
    for response in (call(keyed, "DELETE", "/v1/collections/alpha/documents/sb50-p1", KEY_B),
                     call(keyed, "POST", "/v1/collections/alpha/documents", KEY_B, json={"documents": [{"id": "x", "text": "y"}]}),
                     ask(keyed, KEY_B, "Who won?", documents=["sb50-p1"], collection="alpha")):
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    assert call(keyed, "GET", "/v1/collections/alpha/documents", KEY_A).json()["data"][0]["id"] == "sb50-p1"  # still A's


async def test_a_flood_gets_429s_and_every_request_one_answer(keyed):
    before = {status: keyed.metric("pcrag_requests_total", endpoint="chat", status=status) for status in ("200", "429")}
    async with httpx.AsyncClient(base_url=keyed.url, timeout=300, headers={"Authorization": f"Bearer {KEY_A}"}) as client:
        async def one(i: int) -> httpx.Response:
            return await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": f"Repeat the number {i}."}], "max_tokens": 6})

        responses = await asyncio.gather(*(one(i) for i in range(16)))
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 429}, statuses  # 2 running + 2 queued: the rest are refused at once
    for refused in (r for r in responses if r.status_code == 429):
        assert refused.headers["Retry-After"] and refused.json()["error"]["type"] == "rate_limit_error"
    ids = [r.json()["id"] for r in responses if r.status_code == 200]
    assert len(set(ids)) == len(ids)
    # the server counted each request once, with the status its client got
    assert keyed.metric("pcrag_requests_total", endpoint="chat", status="200") - before["200"] == statuses.count(200)
    assert keyed.metric("pcrag_requests_total", endpoint="chat", status="429") - before["429"] == statuses.count(429)


def test_a_key_past_its_max_in_flight_gets_429_while_other_keys_are_served(keyed):
    """Key C (``max_in_flight: 1``) holds its slot with a request whose body is still arriving
    (deterministic: the slot is taken before the body is read); its next request is refused at
    once, key B's is served, and C's slot comes back when its first request is answered."""
    refused_before = keyed.metric("pcrag_tenant_refused_total", tenant="key #3")
    payload = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}).encode()
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=120) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY_C}\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                     + payload[:10])
        keyed.wait_for(lambda: keyed.metric("pcrag_tenant_in_flight", tenant="key #3") == 1, "key C's slot taken")
        refused = ask(keyed, KEY_C, "Say hello.")
        assert refused.status_code == 429 and refused.headers["Retry-After"]
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert "key #3" in refused.json()["error"]["message"] and KEY_C not in refused.text  # named by position, never by key
        assert ask(keyed, KEY_B, "Say hello.").status_code == 200  # another key is served meanwhile
        sock.sendall(payload[10:])  # the held request's body arrives: it is answered
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200") and b'"chat.completion"' in reply
    assert keyed.metric("pcrag_tenant_in_flight", tenant="key #3") == 0
    assert ask(keyed, KEY_C, "Say hello.").status_code == 200  # its slot came back
    assert keyed.metric("pcrag_tenant_refused_total", tenant="key #3") - refused_before == 1
    # a text completion of two prompts holds two slots: more than C may ever hold, so 400, not 429
    too_many = call(keyed, "POST", "/v1/completions", KEY_C, json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2})
    assert too_many.status_code == 400 and "max_in_flight" in too_many.json()["error"]["message"]
    assert keyed.metric("pcrag_tenant_in_flight", tenant="key #3") == 0


def test_a_stream_holds_its_slot_until_it_ends_or_its_client_leaves(keyed):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
            "max_tokens": 2000, "stream": True}
    headers = {"Authorization": f"Bearer {KEY_C}"}
    with httpx.stream("POST", keyed.url + "/v1/chat/completions", json=body, headers=headers, timeout=120) as response:
        events = response.iter_lines()  # kept: a dropped iterator closes the response
        assert next(events).startswith("data: ")
        assert ask(keyed, KEY_C, "Say hello.").status_code == 429  # the stream holds C's one slot
    # the client hung up mid-stream: the slot comes back (and the row is let go)
    keyed.wait_for(lambda: keyed.metric("pcrag_tenant_in_flight", tenant="key #3") == 0, "the stream's slot given back")
    keyed.wait_for(lambda: keyed.metric("pcrag_running_rows") == 0, "the stream's row let go")
    # a stream read to its end gives its slot back too
    short = {**body, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    with httpx.stream("POST", keyed.url + "/v1/chat/completions", json=short, headers=headers, timeout=120) as response:
        assert response.status_code == 200 and "data: [DONE]" in list(response.iter_lines())
    keyed.wait_for(lambda: keyed.metric("pcrag_tenant_in_flight", tenant="key #3") == 0, "the finished stream's slot given back")
    assert ask(keyed, KEY_C, "Say hello.").status_code == 200


def test_a_stream_whose_client_leaves_while_queued_is_let_go_before_admission(keyed):
    """Two long streams fill the server's 2 rows; a third stream waits in the queue and its client
    hangs up before its first token. It leaves the queue at once, never admitted (it was waited
    on until its first piece: prefilled, and its row held, for nobody)."""
    long = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
            "max_tokens": 2000, "min_tokens": 2000, "stream": True}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    cancelled = keyed.metric("pcrag_scheduler_cancelled_total")
    with httpx.stream("POST", keyed.url + "/v1/chat/completions", json=long, headers=headers, timeout=120) as first, \
            httpx.stream("POST", keyed.url + "/v1/chat/completions", json=long, headers=headers, timeout=120) as second:
        running = [first.iter_lines(), second.iter_lines()]  # kept: a dropped iterator closes the response
        assert all(next(lines).startswith("data: ") for lines in running)
        assert keyed.metric("pcrag_running_rows") == 2
        payload = json.dumps({**long, "messages": [{"role": "user", "content": "Say hi."}]}).encode()
        with socket.create_connection(("127.0.0.1", keyed.port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Authorization: Bearer {KEY_B}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
            keyed.wait_for(lambda: keyed.metric("pcrag_queue_depth") == 1, "the third stream queued")
        keyed.wait_for(lambda: keyed.metric("pcrag_queue_depth") == 0, "the queued stream let go")
        assert keyed.metric("pcrag_scheduler_cancelled_total") == cancelled + 1
        assert keyed.metric("pcrag_running_rows") == 2  # the long streams still run: it was never admitted
        assert keyed.metric("pcrag_tenant_in_flight", tenant="key #2") == 0  # its slot given back
    keyed.wait_for(lambda: keyed.metric("pcrag_running_rows") == 0, "the long streams' rows let go")


def test_in_flight_bounds_from_the_key_file_and_the_flag():
    tenants = Tenants({KEY_A: ["alpha"], KEY_B: {"collections": ["beta"], "max_in_flight": 5},
                       KEY_C: {"collections": [], "max_in_flight": None}}, max_in_flight=2)
    a, b, c = (tenants.authenticate(f"Bearer {key}") for key in (KEY_A, KEY_B, KEY_C))
    assert (a.max_in_flight, b.max_in_flight, c.max_in_flight) == (2, 5, None)  # the flag, the key's own, none
    assert (a.name, b.name, c.name) == ("key #1", "key #2", "key #3")
    twins = Tenants({KEY_A: ["alpha"], KEY_B: ["alpha"]}, max_in_flight=1)  # the same rights, two tenants
    quota = Quota()
    quota.take(twins.authenticate(f"Bearer {KEY_A}"))
    quota.take(twins.authenticate(f"Bearer {KEY_B}"))  # not refused: key #1's slot is not key #2's
    for bad, says in [({KEY_A: {"collections": ["a"], "max_in_flight": 0}},
                       "key #1 of the API key file: max_in_flight must be an integer >= 1"),
                      ({KEY_A: {"collections": ["a"], "max_in_flight": True}}, "max_in_flight must be an integer"),
                      ({KEY_A: {"collections": ["a"], "max_in_flight": "3"}}, "max_in_flight must be an integer"),
                      ({KEY_A: {"max_in_flight": 3}}, 'takes "collections" (required)'),
                      ({KEY_A: {"collections": ["a"], "max_inflight": 3}}, "not ['max_inflight']"),
                      ({KEY_A: {"collections": "alpha"}}, "key #1 of the API key file: its collections must be a list")]:
        with pytest.raises(PromptCacheError, match=re.escape(says)):
            Tenants(bad)
    with pytest.raises(PromptCacheError, match="max_in_flight_per_key must be an integer >= 1"):
        Tenants({KEY_A: ["alpha"]}, max_in_flight=0)


def test_a_key_past_its_tokens_per_minute_waits_while_others_are_served(keyed):
    """A request holds what it may use (its prompt and max_tokens) once its body is read: a key's
    request that would take its minute past the bound gets 429 with the seconds until enough
    leave the minute, so the key never uses more than its bound (before, the request that
    crossed it was served and the key used ~80 of its 60 tokens)."""
    answers = []
    while len(answers) < 5 and (not answers or answers[-1].status_code == 200):
        answers.append(ask(keyed, KEY_D, "Say hi."))
    used = sum(a.json()["usage"]["total_tokens"] for a in answers if a.status_code == 200)
    refused = answers[-1]
    assert refused.status_code == 429 and 0 < used <= 60
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and f"used {used} tokens in the last minute" in error["message"]
    assert "this request may use" in error["message"] and "max_tokens_per_minute: 60" in error["message"]
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert ask(keyed, KEY_A, "Say hi.").status_code == 200  # other keys are served meanwhile
    assert keyed.metric("pcrag_tenant_refused_total", tenant="key #4") >= 1
    assert keyed.metric("pcrag_tenant_tokens_last_minute", tenant="key #4") == used
    alone = ask(keyed, KEY_D, "Say hi.", max_tokens=100)  # more than the bound by itself: it could never be served
    assert alone.status_code == 400 and "may use at most 60 a minute" in alone.json()["error"]["message"]


def test_the_documents_a_request_imports_are_priced_with_its_prompt(keyed):
    """A document named in the body stands in the rendered prompt as a short module reference;
    priced by that text alone, a request of "Say hi." importing a 100-token document fitted a
    120-token minute (~76 tokens) and then used ~170 of it."""
    text = " ".join(f"Fact {i} is that the number {i} follows {i - 1}." for i in range(1, 9))  # ~100 tokens
    added = call(keyed, "POST", "/v1/collections/zeta/documents", KEY_F, json={"documents": [{"id": "facts", "text": text}]})
    assert added.status_code == 202
    keyed.wait_for(lambda: call(keyed, "GET", "/v1/collections/zeta/documents", KEY_F).json()["data"][0]["status"] == "encoded",
                   "the document encoded")
    priced = ask(keyed, KEY_F, "Say hi.", documents=["facts"])
    assert priced.status_code == 400, priced.text
    assert "may use at most 120 a minute" in priced.json()["error"]["message"]
    assert ask(keyed, KEY_F, "Say hi.").status_code == 200  # the same request without the document fits


def test_a_client_that_leaves_is_charged_what_its_reply_used(keyed):
    """A stream its client cut, or a whole reply it did not wait for, is charged to the key's
    minute (its prompt, and what was streamed or the reply's budget): a key that left just before
    each reply's end was never charged."""
    def spent() -> float:
        return keyed.metric("pcrag_tenant_tokens_last_minute", tenant="key #5")

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
            "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", keyed.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_E}"},
                      timeout=120) as response:
        events = (line for line in response.iter_lines() if line)
        assert all(next(events).startswith("data: ") for _ in range(3))
        assert keyed.metric("pcrag_tenant_tokens_held", tenant="key #5") > 2000  # its prompt and max_tokens, while it runs
    keyed.wait_for(lambda: spent() > 0, "the cut stream charged")
    assert keyed.metric("pcrag_tenant_tokens_held", tenant="key #5") == 0  # let go of as it was charged
    keyed.wait_for(lambda: keyed.metric("pcrag_running_rows") == 0, "the stream's row let go")
    assert spent() < 2000  # its prompt and the few tokens streamed, not its budget
    before = spent()
    payload = json.dumps({**body, "stream": False}).encode()
    with socket.create_connection(("127.0.0.1", keyed.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY_E}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        keyed.wait_for(lambda: keyed.metric("pcrag_running_rows") == 1, "request admitted")
    keyed.wait_for(lambda: spent() >= before + 2000, "the abandoned reply charged its budget")


def test_requests_in_flight_hold_what_they_may_use_of_the_minute():
    """Slots.reserve, on a clock the test moves: what requests in flight hold counts against the
    bound with what the minute spent, a charge lets go of the hold at once, and a request that
    alone may use more than the bound is refused for good (400), not told to retry."""
    now = [0.0]
    tenant = Tenants({KEY_A: {"collections": ["a"], "max_tokens_per_minute": 100}}).authenticate(f"Bearer {KEY_A}")
    quota = Quota(clock=lambda: now[0])
    first = quota.take(tenant)
    first.reserve(70)
    second = quota.take(tenant)  # 70 held, none spent: room for one more token
    with pytest.raises(ApiError) as refused:
        second.reserve(40)
    assert refused.value.status == 429 and "holds 70 for its requests in flight" in refused.value.message
    assert "retry when a request has finished" in refused.value.message
    second.release()
    assert quota.reserved(tenant) == 70
    now[0] = 5.0
    first.charge(60)  # it used less than it held
    assert (quota.reserved(tenant), quota.spent(tenant)) == (0, 60)
    first.release()
    later = quota.take(tenant)
    later.reserve(40)  # 60 spent + 40 held: exactly the bound
    assert quota.reserved(tenant) == 40
    with pytest.raises(ApiError) as full:
        quota.take(tenant)  # nothing left of the minute until the 60 leave it at t=65
    assert full.value.status == 429 and full.value.headers["Retry-After"] == "60"
    later.release()  # a request that failed: what it held is let go, nothing charged
    assert (quota.reserved(tenant), quota.spent(tenant), quota.held(tenant)) == (0, 60, 0)
    doomed = quota.take(tenant)
    with pytest.raises(PromptCacheError, match=r"may use 101 tokens .* may use at most 100 a minute \(max_tokens_per_minute\)"):
        doomed.reserve(101)
    doomed.release()
    handed = quota.take(tenant)
    handed.reserve(30)
    stream = handed.hand_over()  # a streamed response holds them from here on
    handed.release()
    assert quota.reserved(tenant) == 30
    stream.release()
    assert (quota.reserved(tenant), quota.held(tenant)) == (0, 0)


def test_tokens_per_minute_leave_the_minute_on_time():
    """The window, on a clock the test moves (the server's is time.monotonic)."""
    now = [0.0]
    tenants = Tenants({KEY_A: {"collections": ["a"], "max_tokens_per_minute": 100}, KEY_B: ["b"]}, max_tokens_per_minute=7)
    tenant = tenants.authenticate(f"Bearer {KEY_A}")
    assert (tenant.max_tokens_per_minute, tenants.authenticate(f"Bearer {KEY_B}").max_tokens_per_minute) == (100, 7)
    quota = Quota(clock=lambda: now[0])
    quota.take(tenant).release()
    quota.spend(tenant, 60)
    now[0] = 10.0
    quota.take(tenant).release()  # 60 < 100: served, and it uses 50 more
    quota.spend(tenant, 50)
    now[0] = 20.0
    with pytest.raises(ApiError) as refused:
        quota.take(tenant)
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "40"  # the first 60 leave at t=60
    assert quota.held(tenant) == 0 and quota.spent(tenant) == 110
    now[0] = 60.0
    quota.take(tenant).release()
    assert quota.spent(tenant) == 50
    now[0] = 70.0
    assert quota.spent(tenant) == 0
    for bad in (0, -5, 2.5, "100"):
        with pytest.raises(PromptCacheError, match="max_tokens_per_minute must be an integer >= 1"):
            Tenants({KEY_A: {"collections": ["a"], "max_tokens_per_minute": bad}})


def test_slots_are_given_back_once():
    tenant = Tenants({KEY_A: ["alpha"]}, max_in_flight=3).authenticate(f"Bearer {KEY_A}")
    quota = Quota()
    first = quota.take(tenant)
    first.grow(2)
    assert quota.held(tenant) == 2
    with pytest.raises(ApiError) as refused:
        quota.take(tenant, 2)
    assert refused.value.status == 429 and quota.held(tenant) == 2  # a refusal holds nothing
    with pytest.raises(PromptCacheError, match="asks for 4 generations"):
        quota.take(tenant).grow(4)  # more than the bound: never servable (its one slot stays held until released)
    streamed = first.hand_over()
    first.release()  # handed over: gives back nothing
    assert quota.held(tenant) == 3
    streamed.release()
    streamed.release()
    assert quota.held(tenant) == 1


def test_the_per_key_flags_need_api_keys(capsys):
    assert main(["serve", "--max-in-flight-per-key", "2"]) == 2
    assert "needs --api-keys" in capsys.readouterr().err
    assert main(["serve", "--max-tokens-per-minute-per-key", "2000"]) == 2
    assert "--max-tokens-per-minute-per-key bounds each API key: it needs --api-keys" in capsys.readouterr().err


async def test_a_stream_whose_client_is_gone_before_its_first_byte_still_closes():
    """A client gone before the response starts: the events' generator never runs (so its own
    ``finally`` could not free anything); the response still closes the scheduler stream and
    gives back the key's slots."""
    from starlette.requests import ClientDisconnect

    from pc_rag.server.streaming import EventStream

    started, closed = [], []

    async def events():
        started.append(True)
        yield "data: never sent\n\n"

    async def close() -> None:
        closed.append(True)

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        raise OSError("the client is gone")

    with pytest.raises(ClientDisconnect):
        await EventStream(events(), close)({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
    assert closed == [True] and started == []
