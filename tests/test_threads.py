"""Decode steps on a CPU run with the thread count measured faster on them (pc_rag.forward.threads),
and every other pass keeps the caller's count."""

from __future__ import annotations

import pytest
import torch

from pc_rag.forward.threads import SKIPPED, TRIALS, DecodeThreads, width_class


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def measure(threads: DecodeThreads, rows: int, seconds: dict[int, float]) -> list[int]:
    """Steps of ``rows`` rows until a count is kept, each taking ``seconds[count]``: the counts used."""
    used = []
    while width_class(rows) not in threads.chosen:
        count, timed = threads.next_count(rows, current=2)
        used.append(count)
        if timed:
            threads.record(rows, count, seconds[count], current=2)
        assert len(used) < 100, "no count was ever kept"
    return used


@pytest.mark.parametrize("faster", [1, 2])
def test_the_faster_count_is_kept_for_each_width(faster):
    threads = DecodeThreads("cpu")
    slower = 3 - faster
    used = measure(threads, 1, {faster: 0.010, slower: 0.020})
    assert threads.chosen == {1: faster}
    assert sorted(set(used)) == [1, 2] and len(used) == SKIPPED + 2 * TRIALS  # both measured, alternately
    assert threads.next_count(1, current=2) == (faster, False)  # kept, no longer timed
    # another width is measured on its own: its steps can favour the other count
    measure(threads, 8, {faster: 0.020, slower: 0.010})
    assert threads.chosen == {1: faster, width_class(8): slower}


def test_one_thread_or_a_fixed_count_is_not_measured():
    threads = DecodeThreads("cpu")
    assert threads.next_count(1, current=1) == (1, False)
    assert DecodeThreads("cpu", fixed=3).next_count(4, current=2) == (3, False)
    assert not DecodeThreads("meta").enabled  # an accelerator's step: the count is left alone


def test_the_callers_count_is_put_back_even_when_the_step_raises(two_threads):
    threads = DecodeThreads("cpu", fixed=1)
    seen = []
    with pytest.raises(RuntimeError):
        with threads.step(1):
            seen.append(torch.get_num_threads())
            raise RuntimeError("the model failed")
    assert seen == [1] and torch.get_num_threads() == 2


def test_decode_steps_run_with_the_measured_count_and_prefill_with_all(make_engine, two_threads):
    """The real path: the scheduler thread's forward passes, observed from inside the model."""
    engine = make_engine("llama")
    engine.stop_token_ids = set()
    passes: list[tuple[int, int]] = []  # (new tokens per row, threads) of every forward pass
    engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: passes.append((kwargs["input_ids"].shape[1], torch.get_num_threads())), with_kwargs=True)
    engine.add_documents(["The tower was finished in 1889 and stands in Paris."], ids=["tower"])
    steps = SKIPPED + 2 * TRIALS + 4
    engine.generate("<doc id='tower'/> When was the tower finished?", max_new_tokens=steps + 1)
    chosen = engine.forward.decode_threads.chosen
    assert set(chosen) == {1} and chosen[1] in (1, 2)
    decode = [threads for width, threads in passes if width == 1]
    assert len(decode) == steps and set(decode[SKIPPED:SKIPPED + 2 * TRIALS]) == {1, 2}  # both counts measured
    assert set(decode[SKIPPED + 2 * TRIALS:]) == {chosen[1]}  # then the kept one
    assert {threads for width, threads in passes if width > 1} == {2}  # the prompt's pass: every thread
    passes.clear()
    engine.generate("<doc id='tower'/> Where does the tower stand?", max_new_tokens=3)
    assert [threads for width, threads in passes if width > 1] == [2]  # the count was put back after the steps
    assert [threads for width, threads in passes if width == 1] == [chosen[1]] * 2
