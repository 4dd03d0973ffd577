"""``pc-rag serve --compile``: the decode step compiled before the port opens, answers as eager.

A tiny model saved to a folder (compiling the embedded model takes minutes on this CPU): two
server processes, one compiled and one eager, asked the same things by concurrent ``openai``
clients, plain completions and chats over documents (the rows that carry APE's bias).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from .servers import ServerProcess
from .test_server import add_and_wait

DOCS = [{"id": f"h{i}", "text": f"Harbour {i} handles {i * 11} ships a day and lies {i * 3} km from the old town."} for i in range(6)]


def answers(server: ServerProcess, model: str) -> list[str]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    add_and_wait(server, "harbours", DOCS)

    def ask(i: int) -> str:
        if i % 2:
            return client.completions.create(model=model, prompt=f"Caller {i} counts: one, two,", max_tokens=8 + i,
                                             temperature=0).choices[0].text
        messages = [{"role": "user", "content": f"How many ships at harbour {i}?"}]
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8 + i, temperature=0,
                                               extra_body={"documents": [f"h{i}", f"h{i + 1}"], "collection": "harbours"})
        return reply.choices[0].message.content

    with ThreadPoolExecutor(5) as pool:
        return list(pool.map(ask, range(5)))


def test_a_compiled_server_compiles_before_its_port_opens_and_answers_as_an_eager_one(saved_model, tmp_path):
    (tmp_path / "compiled").mkdir()
    (tmp_path / "eager").mkdir()
    model = saved_model.name
    compiled = ServerProcess(tmp_path / "compiled", "--model", str(saved_model), "--compile", "default", "--max-running", "4")
    try:
        # ServerProcess returned once /health answered: the warm-up had run by then
        assert "decode step compiled (default) for 3 shapes" in compiled.log.read_text()
        assert httpx.get(compiled.url + "/health").json()["compile"] == "default"
        warmed = compiled.metric("pcrag_compiled_steps_total")
        assert warmed > 0 and compiled.metric("pcrag_compiled_shapes") == 3
        got = answers(compiled, model)
        assert compiled.metric("pcrag_compiled_steps_total") > warmed
    finally:
        compiled.close()
    eager = ServerProcess(tmp_path / "eager", "--model", str(saved_model))
    try:
        assert httpx.get(eager.url + "/health").json()["compile"] is None
        assert answers(eager, model) == got
        assert eager.metric("pcrag_compiled_steps_total") == 0
    finally:
        eager.close()
