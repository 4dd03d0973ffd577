"""Decode steps on a CPU run with the thread count measured faster on them (pc_rag.forward.threads),
and every other pass keeps the caller's count."""

from __future__ import annotations

import pytest
import torch

from pc_rag.forward.threads import NARROW_PASS_TOKENS, SKIPPED, TRIALS, DecodeThreads, attention_threads, narrow_pass, width_class
from pc_rag.kernels.products import kernel_threads


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


# ---------------------------------------------------------------------------------------------
# Narrow prefill passes: torch's own ops on one thread, products and attention on the caller's count
# ---------------------------------------------------------------------------------------------
def test_a_narrow_pass_runs_torch_on_one_thread_and_the_kernels_and_attention_on_all(two_threads):
    seen = []
    with pytest.raises(RuntimeError):
        with narrow_pass(58, enabled=True):
            seen.append((torch.get_num_threads(), kernel_threads()))
            with attention_threads():
                seen.append((torch.get_num_threads(), kernel_threads()))
                with attention_threads():  # packed attention calls attention again: the count it found is put back
                    pass
                seen.append((torch.get_num_threads(), kernel_threads()))
            seen.append((torch.get_num_threads(), kernel_threads()))
            raise RuntimeError("the model failed")
    assert seen == [(1, 2), (2, 2), (2, 2), (1, 2)]
    assert (torch.get_num_threads(), kernel_threads()) == (2, 2)  # put back, whatever the pass raised
    with attention_threads():  # outside a narrow pass: nothing changes
        assert torch.get_num_threads() == 2


@pytest.mark.parametrize("tokens, enabled", [(NARROW_PASS_TOKENS + 1, True), (58, False)])
def test_a_wide_pass_or_a_model_off_the_kernels_keeps_every_thread(two_threads, tokens, enabled):
    with narrow_pass(tokens, enabled=enabled):
        assert (torch.get_num_threads(), kernel_threads()) == (2, 2)


def test_a_cached_prompt_on_int4_runs_its_norms_on_one_thread_and_its_products_on_two(make_tiny, tokenizer, two_threads):
    """Through the engine: the computed tokens of a cached prompt are a narrow pass on an int4 model
    (the norms' hook sees one thread, the kernels two); full prefill of a long prompt, and every pass
    of a float32 model (its products are torch's), keep both threads; the first token is full prefill's."""
    from pc_rag import PromptCache, build_prompt

    answers = {}
    for weights in ("int4", "float32"):
        model = make_tiny("llama", seed=3)
        engine = PromptCache(model, tokenizer, weights=weights, recompute=0)
        assert engine.forward.narrow_passes == (weights == "int4")
        seen: list[tuple[int, int]] = []
        model.model.norm.register_forward_hook(lambda *_: seen.append((torch.get_num_threads(), kernel_threads())))
        document = " ".join(f"word{i}" for i in range(120))
        assert len(engine.tokenize(document)) > NARROW_PASS_TOKENS  # cached; full prefill is wider than a narrow pass
        prompt = build_prompt("What is this?", engine.add_documents([document]))
        seen.clear()
        answers[weights] = engine.generate(prompt, max_new_tokens=1).text
        assert seen == ([(1, 2)] if weights == "int4" else [(2, 2)])  # the cached prompt's one prefill pass
        seen.clear()
        assert engine.generate(prompt, max_new_tokens=1, use_cache=False).text == answers[weights]
        assert seen == [(2, 2)]  # full prefill: wider than a narrow pass
    assert torch.get_num_threads() == 2
