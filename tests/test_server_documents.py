"""Documents under load, over HTTP (``pc-rag serve`` as a process, two tenants' keys): a DELETE of a
queued document answers at once and the document never comes back, a request naming a queued
document is answered (never 404), documents reach ``encoded`` while another tenant's traffic never
stops, and the process exits within its shutdown deadline with a generation still running."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from pc_rag import UnknownModule
from pc_rag.server.wire import api_error

from .conftest import SQUAD
from .servers import MODEL, ServerProcess

KEY_A, KEY_B = "key-of-documents-tenant-a", "key-of-documents-tenant-b"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("documents"), "--max-running", "4", "--max-queued", "16",
                           keys={KEY_A: ["alpha"], KEY_B: ["beta"]})
    yield server
    server.close()


@pytest.fixture(scope="module")
def passages() -> list[str]:
    return [p["context"] for article in json.loads(SQUAD.read_text())["data"] for p in article["paragraphs"]]


def call(server: ServerProcess, method: str, path: str, key: str, **kwargs) -> httpx.Response:
    return httpx.request(method, server.url + path, headers={"Authorization": f"Bearer {key}"}, timeout=180, **kwargs)


def chat(server: ServerProcess, key: str, content: str, **extra) -> httpx.Response:
    return call(server, "POST", "/v1/chat/completions", key,
                json={"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra})


def listing(server: ServerProcess, key: str, collection: str) -> dict[str, dict]:
    response = call(server, "GET", f"/v1/collections/{collection}/documents", key, params={"limit": 1000})
    return {d["id"]: d for d in response.json()["data"]} if response.status_code == 200 else {}


def test_a_queued_document_is_deleted_at_once_and_never_comes_back(served, passages):
    """Before, a DELETE of a queued document waited for the whole queue (120 s under load), then
    answered 404 and deleted nothing: the document was listed "encoded" afterwards."""
    documents = [{"id": f"q{i}", "text": text} for i, text in enumerate(passages[:8])]
    assert call(served, "POST", "/v1/collections/alpha/documents", KEY_A, json={"documents": documents}).status_code == 202
    statuses = listing(served, KEY_A, "alpha")
    assert statuses["q7"]["status"] in ("queued", "in_progress") and statuses["q7"]["last_error"] is None
    for name in ("q7", "q6"):
        deleted = call(served, "DELETE", f"/v1/collections/alpha/documents/{name}", KEY_A)
        assert deleted.status_code == 200 and deleted.json() == {"id": name, "object": "document", "deleted": True}
        assert name not in listing(served, KEY_A, "alpha")
    served.wait_for(lambda: {d["status"] for d in listing(served, KEY_A, "alpha").values()} == {"encoded"}, "the rest encoded")
    assert set(listing(served, KEY_A, "alpha")) == {f"q{i}" for i in range(6)}  # never added back
    assert call(served, "DELETE", "/v1/collections/alpha/documents/q7", KEY_A).status_code == 404  # gone: now 404
    # the other tenant's DELETE of it is a 404 with the body of a collection that does not exist
    foreign = call(served, "DELETE", "/v1/collections/alpha/documents/q0", KEY_B)
    nowhere = call(served, "DELETE", "/v1/collections/nowhere/documents/q0", KEY_B)
    assert foreign.status_code == nowhere.status_code == 404
    assert foreign.json()["error"]["message"].replace("alpha", "nowhere") == nowhere.json()["error"]["message"]


def test_a_request_naming_a_queued_document_is_answered(served, passages):
    """Before: it waited for the whole queue (up to 120 s), then answered 404 if it was still queued."""
    documents = [{"id": f"w{i}", "text": text} for i, text in enumerate(passages[8:14])]
    assert call(served, "POST", "/v1/collections/alpha/documents", KEY_A, json={"documents": documents}).status_code == 202
    reply = chat(served, KEY_A, "What is this about?", documents=["w5", "w4"], collection="alpha")
    assert reply.status_code == 200, reply.text
    text_tokens = reply.json()["usage"]["prompt_tokens"]
    assert text_tokens > 100  # the documents were read: waited for (first in the queue), or as text
    served.wait_for(lambda: {d["status"] for d in listing(served, KEY_A, "alpha").values()} == {"encoded"}, "all encoded")
    again = chat(served, KEY_A, "What is this about?", documents=["w5", "w4"], collection="alpha").json()["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] > 100  # now imported


def test_documents_reach_encoded_while_another_tenants_traffic_never_stops(served, passages):
    """Before, the background encoder waited for a moment with no request at all: under steady
    traffic no document was ever encoded."""
    stop = threading.Event()
    answered: list[tuple[int, float]] = []

    def traffic() -> None:
        while not stop.is_set():
            started = time.monotonic()
            status = chat(served, KEY_B, "Count to three.").status_code
            answered.append((status, time.monotonic() - started))

    clients = [threading.Thread(target=traffic) for _ in range(6)]  # more than --max-running: never idle
    for client in clients:
        client.start()
    try:
        served.wait_for(lambda: len(answered) >= 6, "traffic flowing")
        documents = [{"id": f"load{i}", "text": text} for i, text in enumerate(passages[14:20])]
        assert call(served, "POST", "/v1/collections/alpha/documents", KEY_A, json={"documents": documents}).status_code == 202
        before = len(answered)
        served.wait_for(lambda: {listing(served, KEY_A, "alpha").get(f"load{i}", {}).get("status") for i in range(6)} == {"encoded"},
                        "documents encoded under load", timeout=240)
        assert len(answered) > before  # the traffic went on meanwhile
    finally:
        stop.set()
        for client in clients:
            client.join()
    assert {status for status, _ in answered} == {200}
    assert max(seconds for _, seconds in answered) < 120  # no request waited out the old bound


def test_a_document_deleted_after_it_was_named_answers_404_not_400():
    # the race (deleted between the server's check and the request's plan) as the server answers it
    error = api_error(UnknownModule("module reference to unknown module 'x' in schema 'alpha'", schema="alpha", name="x"))
    assert (error.status, error.body()["error"]["code"]) == (404, "not_found")
    assert error.body()["error"]["message"] == "document 'x' in collection 'alpha' not found"


def test_sigterm_with_a_generation_running_exits_within_the_deadline(tmp_path, tokenizer):
    server = ServerProcess(tmp_path, "--shutdown-timeout-s", "2")
    try:
        banned = {str(token): -100 for token in {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}}
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "Once upon a time", "max_tokens": 4000, "stream": True, "logit_bias": banned}) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # generating now
            server.process.send_signal(signal.SIGTERM)
            server.process.wait(timeout=30)  # before: it waited for the whole generation (4000 tokens)
    finally:
        server.close()
    # uvicorn re-raises the signal once it has shut down gracefully: the requests were cancelled, the engine closed
    assert server.process.returncode in (0, -signal.SIGTERM)
    log = server.log.read_text()
    assert "timeout graceful shutdown exceeded" in log and "engine closed" in log
