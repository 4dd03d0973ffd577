"""``pc-rag serve --api-keys``: tenants that never see each other, and a flood that gets 429s
without losing or doubling a request. A real server process with two keys and small limits."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from .conftest import SQUAD
from .servers import MODEL, ServerProcess

KEY_A, KEY_B = "key-of-tenant-a-0001", "key-of-tenant-b-0002"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("keyed"), "--max-running", "2", "--max-queued", "2",
                           keys={KEY_A: ["alpha"], KEY_B: ["beta"]})
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
