"""``pc-rag serve --replicas 2`` on a local Ray runtime over a real ``redis-server``: requests go to
the replica whose memory holds their documents (more memory-tier hits than Ray Serve's default
router), and a replica killed under a request has it answered by the other."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from .conftest import SQUAD, RedisServer
from .servers import MODEL, ServerProcess

GROUPS = 4  # documents read together: 2 passages each


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    folder = tmp_path_factory.mktemp("redis")
    server = RedisServer(folder).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def groups() -> list[list[str]]:
    paragraphs = [p["context"] for a in json.loads(SQUAD.read_text())["data"] for p in a["paragraphs"]]
    return [paragraphs[2 * i : 2 * i + 2] for i in range(GROUPS)]


def replicas(tmp_path_factory, redis: RedisServer, router: str) -> ServerProcess:
    return ServerProcess(tmp_path_factory.mktemp(f"replicas-{router}"), "--replicas", "2", "--remote-store", redis.url,
                         "--router", router, startup_s=600)


def add_groups(server: ServerProcess, collection: str, groups: list[list[str]]) -> None:
    documents = [{"id": f"g{g}-{i}", "text": text} for g, group in enumerate(groups) for i, text in enumerate(group)]
    assert httpx.post(f"{server.url}/v1/collections/{collection}/documents", json={"documents": documents}, timeout=60).status_code == 202

    def encoded() -> bool:
        listing = httpx.get(f"{server.url}/v1/collections/{collection}/documents", timeout=60).json()
        return len([d for d in listing.get("data", []) if d["status"] == "encoded"]) == len(documents)

    server.wait_for(encoded, "documents encoded and seen by the replica asked", timeout=300)


def ask(server: ServerProcess, group: list[str], question: str, max_tokens: int = 2) -> dict:
    content = "\n\n".join(group) + f"\n\n{question}"
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=300,
                          json={"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens})
    assert response.status_code == 200, response.text
    return response.json()


def memory_served(server: ServerProcess, groups: list[list[str]], rounds: int, tokenizer) -> tuple[float, list[dict]]:
    """Ask about each group in turn, ``rounds`` times: the fraction of requests (after a replica's
    first) whose documents were all read from the replica's memory: reused (cached), with nothing
    loaded from Redis. (A replica's first requests may compute them instead: pc_rag.kv.load_or_compute.)"""
    last: dict[str, dict] = {}
    served, counted, replies = 0, 0, []
    for _ in range(rounds):
        for group in groups:
            reply = ask(server, group, "What is this about?")
            reused = reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= sum(len(tokenizer(t).input_ids) for t in group) - 20
            replica = reply["pc_rag"]["replica"]
            before = last.get(replica["id"])
            if before is not None:
                counted += 1
                served += reused and replica["hits_remote"] == before["hits_remote"] and replica["misses"] == before["misses"]
            last[replica["id"]] = replica
            replies.append(reply)
    return served / counted, replies


def test_affinity_routing_reads_memory_more_often_than_the_default_router(tmp_path_factory, redis, groups, tokenizer):
    rates = {}
    for router in ("affinity", "default"):
        server = replicas(tmp_path_factory, redis, router)
        try:
            add_groups(server, "docs", groups)
            rates[router], replies = memory_served(server, groups, rounds=4, tokenizer=tokenizer)
            if router == "affinity":
                refusals_are_the_engines_own(server)
                killed_replica_is_answered_again(server, groups, replies)
        finally:
            server.close()
        redis.client().flushall()  # the next server starts from an empty Redis, as this one did
    assert rates["affinity"] > rates["default"], rates


def refusals_are_the_engines_own(server: ServerProcess) -> None:
    """A request a replica refuses is answered with the engine's error, its field and code, as by
    one engine: it was Ray's wrapper, whose message is the replica's traceback (its pid, address
    and file paths), with neither field nor code."""
    hi = [{"role": "user", "content": "hi"}]
    for fields, says, param, code in [({"messages": [{"role": "user", "content": "word " * 9000}]}, "context window (8192)", "messages",
                                       "context_length_exceeded"),
                                      ({"messages": hi, "stop": ""}, "stop sequences must be non-empty", "stop", None)]:
        for stream in (False, True):
            response = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                                  json={"model": MODEL, "max_tokens": 2, "stream": stream, **fields})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["message"].startswith(("the prompt needs", says)) and says in error["message"], error["message"][:300]
            assert (error["param"], error["code"]) == (param, code)


def killed_replica_is_answered_again(server: ServerProcess, groups: list[list[str]], replies: list[dict]) -> None:
    """The replica that holds group 0 is killed as a long request over group 0 goes to it (the
    router sends it there, or it is already being served there): the other replica answers it."""
    holder = replies[-GROUPS]["pc_rag"]["replica"]["pid"]  # served group 0 last
    answer: dict = {}
    request = threading.Thread(target=lambda: answer.update(ask(server, groups[0], "Summarise this in detail.", max_tokens=120)))
    request.start()
    os.kill(holder, signal.SIGKILL)
    request.join(300)
    assert answer["choices"][0]["message"]["content"]
    assert answer["pc_rag"]["replica"]["pid"] != holder
