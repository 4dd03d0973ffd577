"""Passages pasted into plain prompts again and again, learned as documents (``learn_passages=``):
counted per scope, queued behind callers' documents, reused by drop-in as the same document added
by hand would be, and never seen by another scope or another API key."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
import torch

from pc_rag import PromptCacheError
from pc_rag.background import BackgroundEncoder
from pc_rag.prompt.documents import DocumentRecord
from pc_rag.prompt.recurring import RecurringPassages, learned_collection, splitter

from .conftest import SQUAD
from .servers import MODEL, ServerProcess

PASSAGE = ("The river delta holds seven villages, each with a market on a different day of the week, so that a "
           "trader who follows the boats can sell every morning. Salt, dried fish and woven mats travel upstream; "
           "grain and timber come down. A <module name=\"x\"/> tag and {braces} in the text stay text.")
OTHER = ("Lighthouses along the northern coast were first lit with whale oil, then with kerosene, and since the "
         "nineteen-twenties with electric lamps whose beams turn once every ten seconds. Each keeper kept a log of "
         "ships, weather and the hours the lamp burned, and the logs are now read by historians.")


def chat(engine, content: str) -> str:
    return engine.render_chat([{"role": "user", "content": content}])


def test_passages_are_the_long_texts_between_markers_and_blank_lines():
    passages = RecurringPassages(2, splitter(["<|im_start|>user\n", "<|im_end|>\n"]), min_chars=40)
    prompt = f"<|im_start|>user\n{PASSAGE}\n \n{OTHER}\n\nshort question?<|im_end|>\n<|im_start|>user\n{PASSAGE}<|im_end|>\n"
    assert passages.passages(prompt) == [PASSAGE, OTHER]  # each once, in order; the question too short
    assert passages.sighted("c", [PASSAGE]) == [] and passages.sighted("other", [PASSAGE]) == []  # counted per collection
    assert passages.sighted("c", [PASSAGE, OTHER]) == [PASSAGE]  # the second sighting in "c"
    assert passages.sighted("c", [PASSAGE]) == []  # counted from zero again
    with pytest.raises(PromptCacheError, match="learn_passages"):
        RecurringPassages(0, splitter([]))


def test_sightings_and_learned_passages_are_bounded():
    passages = RecurringPassages(2, splitter([]), min_chars=1, tracked=2, kept=2)
    passages.sighted("c", ["a", "b", "c"])  # "a" forgotten: only two counted at once
    assert passages.sighted("c", ["a", "c"]) == ["c"]
    assert passages.keep("c", ["n1", "n2"]) == [] and passages.keep("c", ["n3"]) == ["n1"]  # the oldest learned leaves
    assert passages.keep("c", ["n2"]) == [] and passages.keep("c", ["n4"]) == ["n3"]  # kept again: the newest


def test_a_learned_passage_waits_for_the_documents_callers_added():
    order: list[str] = []

    def add(records: list[DocumentRecord], *, schema: str, **_: object) -> list[str]:
        order.append(schema)
        return [record.name for record in records]

    queue = BackgroundEncoder(add, grace_s=3600.0)  # nothing starts before join()
    queue.submit("_learned", None, [DocumentRecord("p", PASSAGE, {})], behind=True)
    queue.submit("docs", None, [DocumentRecord("d", OTHER, {})])
    assert queue.join(timeout=60)
    assert order == ["docs", "_learned"]
    queue.close()


def test_a_learned_passage_waiting_for_its_share_does_not_hold_back_a_callers_document():
    from pc_rag.forward.turns import ModelTurns

    order: list[str] = []
    added = threading.Event()

    def add(records: list[DocumentRecord], *, schema: str, **_: object) -> list[str]:
        order.append(schema)
        added.set()
        return [record.name for record in records]

    turns = ModelTurns(share=0.1)
    queue = BackgroundEncoder(add, turns=turns, grace_s=0.0)
    with turns.serving():
        with turns.background(behind=True):
            end = time.perf_counter() + 0.01
            while time.perf_counter() < end:  # a learned passage's pass: ~0.09 s of steps owed
                pass
        queue.submit("_learned", None, [DocumentRecord("p", PASSAGE, {})], behind=True)
        queue.submit("docs", None, [DocumentRecord("d", OTHER, {})])
        assert added.wait(timeout=60) and order == ["docs"]  # no step ran: the passage still waits
        while queue.pending:
            with turns.step():
                pass
    assert order == ["docs", "_learned"]
    queue.close()


def test_a_passage_computed_twice_is_reused_as_the_same_document_added_by_hand(make_engine):
    engine = make_engine("llama", learn_passages=2)
    first, second, third = (chat(engine, f"{PASSAGE}\n\n{q}") for q in ("Which days?", "What goes upstream?", "Why?"))
    engine.generate(first, max_new_tokens=1)
    assert engine.wait_for_documents(timeout=60) and learned_collection(None) not in engine.schemas  # seen once
    engine.generate(second, max_new_tokens=1)
    assert engine.wait_for_documents(timeout=60)
    learned = engine.schemas[learned_collection(None)]
    assert [record.text for record in learned.documents.values()] == [PASSAGE]  # markup in it stayed text
    assert engine.store_stats()["passages_learned"] == 1
    plan = engine.plan(third)
    assert plan.cached_tokens >= len(engine.tokenizer(PASSAGE)["input_ids"]) - 2  # (boundary tokens may merge)

    by_hand = make_engine("llama")  # the same weights, the passage added as a document
    by_hand.add_documents([PASSAGE], schema="by_hand", progress=False)
    assert by_hand.plan(third).cached_tokens == plan.cached_tokens
    assert torch.equal(engine.next_token_logits(third), by_hand.next_token_logits(third))


def test_what_one_scope_learned_another_does_not_read(make_engine):
    engine = make_engine("llama", learn_passages=1)
    prompt = chat(engine, f"{OTHER}\n\nWho reads the logs?")
    engine.generate(prompt, max_new_tokens=1, collections=["alpha"])
    assert engine.wait_for_documents(timeout=60)
    assert engine.plan(prompt, collections=["alpha"]).cached_tokens > 0
    assert engine.plan(prompt, collections=["beta"]).cached_tokens == 0
    assert engine.plan(prompt, collections=["alpha", "beta"]).cached_tokens == 0  # another scope, another collection
    with pytest.raises(PromptCacheError, match="_learned"):  # nobody adds to, or poses as, a learned collection
        engine.add_documents([PASSAGE], schema=learned_collection(frozenset({"beta"})))


def test_a_model_without_drop_in_learns_nothing(make_engine, caplog):
    engine = make_engine("llama", learn_passages=2, drop_in=False)
    assert engine.passages is None and "not learning passages" in caplog.text


KEY_A, KEY_B = "key-of-learning-a-0001", "key-of-learning-b-0002"


@pytest.fixture(scope="module")
def learning_server(tmp_path_factory):
    # two keys with the same collection: what one pastes, the other must not find faster
    server = ServerProcess(tmp_path_factory.mktemp("learning"), "--learn-passages", "2",
                           keys={KEY_A: ["shared"], KEY_B: ["shared"]})
    yield server
    server.close()


def test_a_key_reuses_what_it_pasted_twice_and_another_key_does_not(learning_server):
    passage = json.loads(SQUAD.read_text())["data"][0]["paragraphs"][3]["context"]

    def ask(key: str, question: str) -> dict:
        response = httpx.post(learning_server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                              json={"model": MODEL, "messages": [{"role": "user", "content": f"{passage}\n\n{question}"}], "max_tokens": 4})
        assert response.status_code == 200, response.text
        return response.json()["usage"]

    assert ask(KEY_A, "Who?")["prompt_tokens_details"]["cached_tokens"] == 0
    ask(KEY_A, "Where?")  # the second sighting: queued to be learned
    learning_server.wait_for(lambda: ask(KEY_A, "When?")["prompt_tokens_details"]["cached_tokens"] > 50, "the passage learned")
    usage = ask(KEY_B, "When?")
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0 and usage["prompt_tokens"] > 100
    assert learning_server.metric("pcrag_kv_passages_learned_total") == 1
    assert not re.search(r"Traceback|ERROR", learning_server.log.read_text())
