"""A process that built an engine and served requests forks (Python's default ``multiprocessing``
start method on Linux, gunicorn ``--preload``, Celery's prefork workers): the child serves its own
requests, with the scheduler's loop, the background encoder and the C step's thread pool started
afresh there (``pc_rag.forks``, ``thread_pool.c``). Before, the child's first ``generate`` never
returned: the loop thread existed only in the parent, and the pool's condition variable kept the
parent's waiters."""

from __future__ import annotations

import multiprocessing
import queue as queues

import pytest

from pc_rag import PromptCache, build_prompt

DOCUMENTS = ["The Denver Broncos won Super Bowl 50 against the Carolina Panthers, 24-10.",
             "Super Bowl 50 was played at Levi's Stadium in Santa Clara, California."]
QUESTION = "Who won Super Bowl 50?"
WAIT_S = 180  # a hang shows as this timeout; a working child answers in seconds


def _serve_in_child(engine: PromptCache, prompt: str, answers: multiprocessing.Queue) -> None:
    first = engine.generate(prompt, max_new_tokens=8)
    names = engine.add_documents(["Levi's Stadium is the home of the San Francisco 49ers."], background=True)
    assert engine.wait_for_documents(timeout=60)  # the background encoder: its worker is the child's own
    second = engine.generate(prompt, max_new_tokens=8)  # the pool's second multi-threaded steps, too
    answers.put((first.token_ids, second.token_ids, len(names)))


def serve_in_a_forked_child(engine: PromptCache, prompt: str) -> tuple[list[int], list[int], int]:
    context = multiprocessing.get_context("fork")
    answers = context.Queue()
    child = context.Process(target=_serve_in_child, args=(engine, prompt, answers), daemon=True)
    child.start()
    try:
        return answers.get(timeout=WAIT_S)
    except queues.Empty:
        pytest.fail(f"the forked child did not answer within {WAIT_S} s (exit code {child.exitcode})")
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()


@pytest.mark.parametrize("weights", ["int4", "float32"])
def test_a_forked_child_of_an_engine_that_served_requests_serves_its_own(make_tiny, tokenizer, weights):
    engine = PromptCache(make_tiny("llama"), tokenizer, weights=weights)
    names = engine.add_documents(DOCUMENTS)
    prompt = build_prompt(QUESTION, names)
    in_parent = [engine.generate(prompt, max_new_tokens=8).token_ids for _ in range(2)]
    first, second, added = serve_in_a_forked_child(engine, prompt)
    assert first == second == in_parent[0] == in_parent[1]
    assert added == 1
    assert engine.generate(prompt, max_new_tokens=8).token_ids == in_parent[0]  # the parent serves on


def test_a_forked_child_of_the_embedded_engine_answers_as_its_parent(smollm):
    """The real engine at its defaults (4-bit blocks, the C step on its own threads)."""
    names = smollm.add_documents(DOCUMENTS)
    prompt = build_prompt(QUESTION, names)
    in_parent = smollm.generate(prompt, max_new_tokens=8).token_ids
    first, second, _ = serve_in_a_forked_child(smollm, prompt)
    assert first == second == in_parent
