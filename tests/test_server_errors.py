"""Which side a server's error blames: a request the engine fails to serve is a 5xx (the client's
SDK retries it), never the 400 that tells a client its input is wrong.

The server runs in this process (uvicorn on a free port, real ``openai`` and ``httpx`` clients) so
that a decode step's failure can be injected, as tests/test_scheduler.py injects its faults: a
real engine offers no failure to provoke."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
import uvicorn

from pc_rag import ServingFailed
from pc_rag.server.app import create_app

from .servers import free_port


@pytest.fixture
def served(make_engine):
    """A tiny engine served on a free port: (engine, base url)."""
    engine = make_engine("llama")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, model_name="tiny"), host="127.0.0.1", port=port,
                                           http="h11", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    ready = threading.Event()
    while not server.started:  # waits for an event, bounded by the join below failing loudly
        if not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        ready.wait(0.05)
    yield engine, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)


def test_a_failed_decode_step_is_a_500_and_a_closed_engine_a_503(served, monkeypatch):
    from pc_rag.decode.loop import RunningBatch

    engine, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    alone = client.completions.create(model="tiny", prompt="How far is the harbour?", max_tokens=4)
    feed = RunningBatch.feed
    faults = {"feed": 1}

    def broken_feed(self, alongside=None):
        if faults["feed"]:
            faults["feed"] -= 1
            raise RuntimeError("the decode step broke")
        return feed(self, alongside)

    monkeypatch.setattr(RunningBatch, "feed", broken_feed)
    with pytest.raises(openai.InternalServerError) as failed:
        client.completions.create(model="tiny", prompt="How far is the harbour?", max_tokens=4)
    assert failed.value.status_code == 500 and "trying again may succeed" in str(failed.value)
    assert "decode step broke" not in str(failed.value)  # the engine's internals stay in its log
    with pytest.raises(ServingFailed, match="the step serving this request failed"):  # the library's caller sees why
        faults["feed"] = 1
        engine.generate("How far is the harbour?", max_new_tokens=4)
    # the loop lives on: the same request answers as before
    again = client.completions.create(model="tiny", prompt="How far is the harbour?", max_tokens=4)
    assert again.choices[0].text == alone.choices[0].text
    engine.scheduler.close()
    reply = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Still there?", "max_tokens": 2}, timeout=60)
    assert reply.status_code == 503 and reply.json()["error"]["type"] == "server_error", reply.text
